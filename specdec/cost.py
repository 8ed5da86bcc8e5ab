"""Measured target step cost T(k): the table, its measurement and its on-disk cache.

On CPU a forward over k new tokens is NOT free (about 2x a 1-token step at k=2, see docs/architecture.md),
so gamma and tree size come from a measured table ``T(k)`` (ms for k new tokens after a fixed
prefix), cached per (model, device, dtype, threads, torch version, ...). The budget choosers
that read it live in specdec.budget; `specdec profile` (specdec.profile) prints and plots it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .files import write_text_atomic
from .paths import CACHE_ENV_VAR, cache_root

DEFAULT_KS = (1, 2, 3, 4, 6, 8, 12, 16)
# What a table's milliseconds are: wall clock (what the budget choosers want), or the process's CPU
# time (all its threads), which a shared, oversubscribed machine inflates far less: for comparing
# forwards (weight formats, k) there, not for choosing gammas
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


# ============================================================================ the table


@dataclass
class CostTable:
    """Median forward time ``ms[i]`` for ``k[i]`` new tokens; ``key`` identifies the setup."""

    key: dict = field(default_factory=dict)
    k: list[int] = field(default_factory=list)
    ms: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.k = [int(v) for v in self.k]
        self.ms = [float(v) for v in self.ms]
        if not self.k or len(self.k) != len(self.ms):
            raise ValueError(
                f"cost table needs >= 1 point and equal-length k and ms, got {len(self.k)} k "
                f"and {len(self.ms)} ms"
            )
        if any(b <= a for a, b in zip(self.k, self.k[1:])) or self.k[0] < 1:
            raise ValueError(f"k must be strictly increasing integers >= 1, got {self.k}")
        if any(not v > 0 for v in self.ms):
            raise ValueError(f"ms must all be > 0, got {self.ms}")

    def t(self, k: float) -> float:
        """T(k) in ms: linear between measured points, linear extrapolation outside them.

        Extrapolation uses the nearest segment's slope, floored at 0 so a noisy last segment
        cannot make larger forwards look cheaper; with one point T is constant.
        """
        if not k > 0:
            raise ValueError(f"k (tokens in the forward) must be > 0, got {k}")
        ks, ms = self.k, self.ms
        if len(ks) == 1:
            return ms[0]
        if k >= ks[-1]:
            slope = max(0.0, (ms[-1] - ms[-2]) / (ks[-1] - ks[-2]))
            return ms[-1] + slope * (k - ks[-1])
        if k <= ks[0]:
            slope = max(0.0, (ms[1] - ms[0]) / (ks[1] - ks[0]))
            return max(ms[0] + slope * (k - ks[0]), 1e-9)
        right = bisect.bisect_right(ks, k)
        left = right - 1
        fraction = (k - ks[left]) / (ks[right] - ks[left])
        return ms[left] + fraction * (ms[right] - ms[left])

    def plausible(self, slack: float = 0.8) -> bool:
        """False when a larger forward was measured much cheaper than a smaller one (T(k') <
        slack x T(k) for some k' > k): a forward over more tokens does the same work and more, so
        such a table was timed while something else held the CPU, and its choices would be wrong
        (drafting looks free when T(3) < T(1))."""
        return all(later >= slack * earlier for i, earlier in enumerate(self.ms) for later in self.ms[i + 1 :])

    def ratio(self, k: float) -> float:
        """T(k) / T(1): cost of a k-token forward in plain decoding steps."""
        return self.t(k) / self.t(1)

    def to_dict(self) -> dict:
        return {"key": dict(self.key), "k": list(self.k), "ms": list(self.ms)}

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON (atomically: a reader never sees half a file); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostTable:
        """Read a table saved by ``save`` or printed by ``specdec profile --json``."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read cost table {path}: {error}") from None
        if not isinstance(data, dict) or "k" not in data or "ms" not in data:
            raise ValueError(f"cost table {path} must be a JSON object with 'k' and 'ms' lists")
        return cls(key=data.get("key", {}), k=data["k"], ms=data["ms"])


def default_cache_path(key: dict) -> Path:
    """$SPECDEC_CACHE (default ~/.cache/specdec)/cost/<hash of key>.json."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return cache_root() / "cost" / f"{digest[:20]}.json"


def _target_device(target) -> torch.device:
    return torch.device(getattr(target, "device", "cpu"))


def cost_key(target, prefix_len: int = 64, clock: str = "wall") -> dict:
    """What a measured table depends on: model, device, dtype, threads, torch, machine (, clock)."""
    device = _target_device(target)
    key = {
        "model": str(target.name),
        "device": str(device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "prefix_len": int(prefix_len),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        # the linear kernel changes T(k) a lot (specdec.kernels): tables never mix backends
        "linear": str(getattr(target, "linear_backend", "torch")),
        # GGUF blocks stream ~6x fewer bytes than fp32 weights: a table is per weight format
        "weights": str(getattr(target, "weights", "fp32")),
    }
    library = getattr(target, "kernel_library", None)  # the compiled kernel its linears run on, or None
    if library is not None:
        # the build (source + flags + compiler digest): a table timed on an older kernel is stale
        key["kernel"] = Path(library.path).stem
        key["threads"] = library.threads()  # the kernel's count, also inside kernel_owns_threads
        # its forwards run torch's ops on one thread (Target.kernel_owns_threads): 11-21 ms less per
        # 1.5B forward than the tables timed with torch's ops on every thread
        key["torch_ops"] = "one thread"
        if key["weights"] == "gguf-a8" and library.amx:
            key["amx"] = True  # multi-row int8 K-quant linears on AMX tiles: another T(k) (same logits)
        if key["weights"] == "gguf-a8" and not library.interleave_weights:
            key["interleaved"] = False  # SPECDEC_KERNEL_INTERLEAVE=0: verify rows on the raw blocks, slower
    if device.type == "cuda" and torch.cuda.is_available():
        key["device_name"] = torch.cuda.get_device_name(device)
    if clock != "wall":  # wall-clock keys stay as they were (cached tables remain valid)
        key["clock"] = clock
    return key


# ============================================================================ measuring


def _synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so the timer measures the forward, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MEASURE_ATTEMPTS = 3  # measurements of a table before an implausible one is kept (with a warning)


def measure_cost_table(
    target,
    ks: Sequence[int] = DEFAULT_KS,
    prefix_len: int = 64,
    repeats: int = 5,
    timer: Callable[[], float] | None = None,
    progress: bool = True,
    warmup: int = 1,
    clock: str = "wall",
) -> CostTable:
    """Median ms of ``target.forward`` over k new tokens after a ``prefix_len`` prefix, per k.

    For each k: a fresh cache, a prefill of token ids ``arange(prefix_len) % vocab``, ``warmup``
    untimed forwards, then ``repeats`` timed ones, truncating the cache back to the prefix before
    each so every repeat sees the same context length. ``timer`` returns seconds (default: the
    ``clock``'s, see CLOCKS).
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    timer = timer or CLOCKS[clock]
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be non-empty integers >= 1, got {ks}")
    if prefix_len < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            "need prefix_len >= 1, repeats >= 1, warmup >= 0; "
            f"got {prefix_len}, {repeats}, {warmup}"
        )
    from tqdm.auto import tqdm

    device = _target_device(target)
    vocab_size = int(target.vocab_size)
    ids = torch.arange(prefix_len + ks[-1], device=device) % vocab_size  # [P + K]
    positions = torch.arange(prefix_len + ks[-1], device=device)  # [P + K]
    medians = []
    with torch.inference_mode():
        for k in tqdm(ks, desc="profiling T(k)", disable=not progress, file=sys.stderr):
            cache = target.new_cache(batch_size=1, max_len=prefix_len + k)
            target.forward(ids[None, :prefix_len], positions[None, :prefix_len], cache)
            step_ids = ids[None, prefix_len:prefix_len + k]  # [1, k]
            step_positions = positions[None, prefix_len:prefix_len + k]  # [1, k]
            samples_ms = []
            for repeat in range(warmup + repeats):
                cache.truncate(prefix_len)
                _synchronize(device)
                start = timer()
                target.forward(step_ids, step_positions, cache)
                _synchronize(device)
                elapsed_ms = (timer() - start) * 1000.0
                if repeat >= warmup:
                    samples_ms.append(elapsed_ms)
            medians.append(statistics.median(samples_ms))
            del cache
    return CostTable(key=cost_key(target, prefix_len, clock), k=ks, ms=medians)


# tables this process measured but could not write to the cache (read-only): measured once, warned once
_UNSAVED: dict[Path, CostTable] = {}


def get_or_measure(
    target,
    ks: Sequence[int] = DEFAULT_KS,
    prefix_len: int = 64,
    repeats: int = 5,
    path: str | os.PathLike | None = None,
    refresh: bool = False,
    progress: bool = True,
    timer: Callable[[], float] | None = None,
    clock: str = "wall",
) -> CostTable:
    """The cached table for this target's key if it covers ``ks``, else measure and cache it."""
    key = cost_key(target, prefix_len, clock)
    path = Path(path) if path is not None else default_cache_path(key)
    if not refresh and path.is_file():
        try:
            cached = CostTable.load(path)
        except ValueError:
            cached = None  # a corrupt cache file is re-measured, not fatal
        if cached is not None and cached.key == key and set(ks) <= set(cached.k) and cached.plausible():
            return cached
    unsaved = _UNSAVED.get(path)
    if not refresh and unsaved is not None and unsaved.key == key and set(ks) <= set(unsaved.k):
        return unsaved
    table = measure_cost_table(target, ks, prefix_len, repeats, timer=timer, progress=progress, clock=clock)
    for _ in range(MEASURE_ATTEMPTS - 1):
        if table.plausible():
            break
        # other work slowed some points down (it never speeds a forward up): measure again and
        # keep each k's fastest median
        again = measure_cost_table(target, ks, prefix_len, repeats, timer=timer, progress=progress, clock=clock)
        table = CostTable(key=table.key, k=table.k, ms=[min(a, b) for a, b in zip(table.ms, again.ms)])
    if not table.plausible():
        print(f"warning: the step-cost table for {key.get('model', 'this target')} still looks disturbed "
              f"(T(k) falls as k grows: {[round(v, 1) for v in table.ms]} ms); rerun `specdec profile` "
              "on a quieter machine", file=sys.stderr)
    try:
        table.save(path)
    except OSError as error:  # a read-only cache: the table still serves this process
        _UNSAVED[path] = table
        print(f"warning: cannot save the step-cost table to {path} ({error.strerror or error}); using it for this run "
              f"only (point {CACHE_ENV_VAR} at a writable directory to keep it)", file=sys.stderr)
    return table
