"""Measured target step cost T(k) and the draft-budget choosers built on it.

On CPU a forward over k new tokens is NOT free (about 2x a 1-token step at k=2, see DESIGN.md),
so gamma and tree size come from a measured table ``T(k)`` (ms for k new tokens after a fixed
prefix), cached per (model, device, dtype, threads, torch version, ...).

Budget choosers maximise expected tokens per second for the coming step:

    chain:  argmax_g  E[tau](g) / (g * draft_ms_per_token + T(other + g + 1))
            E[tau](g) = 1 + sum_{d=1..g} prod_{j<=d} a_j
    tree:   argmax_n  (1 + sum_{i<n} score_i) / (draft_ms + n * per_node_ms + T(other + n + 1))
    batch:  argmax_n  (R + S_n) / (n * draft_ms + T(R + n)), S_n = the n best scores of all requests

Non-anticipation (DESIGN.md): for SAMPLED proposals the chosen budget must be a function of
information available BEFORE drafting -- the running per-depth acceptance estimates
(AcceptanceTracker) and this cost table -- never of the drafted tokens or their probabilities.
Scores computed from the drafter's own outputs are only allowed for deterministic proposals
(top-k tree expansion, n-gram matches), which carry no draft randomness.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
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

from .paths import cache_root

DEFAULT_KS = (1, 2, 3, 4, 6, 8, 12, 16)


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

    def ratio(self, k: float) -> float:
        """T(k) / T(1): cost of a k-token forward in plain decoding steps."""
        return self.t(k) / self.t(1)

    def to_dict(self) -> dict:
        return {"key": dict(self.key), "k": list(self.k), "ms": list(self.ms)}

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON (atomically: a reader never sees half a file); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
        temporary.write_text(json.dumps(self.to_dict(), indent=1))
        temporary.replace(path)
        return path

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


def cost_key(target, prefix_len: int = 64) -> dict:
    """What a measured table depends on: model, device, dtype, threads, torch, machine."""
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
    }
    if device.type == "cuda" and torch.cuda.is_available():
        key["device_name"] = torch.cuda.get_device_name(device)
    return key


# ============================================================================ measuring


def _synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so the timer measures the forward, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_cost_table(
    target,
    ks: Sequence[int] = DEFAULT_KS,
    prefix_len: int = 64,
    repeats: int = 5,
    timer: Callable[[], float] = time.perf_counter,
    progress: bool = True,
    warmup: int = 1,
) -> CostTable:
    """Median ms of ``target.forward`` over k new tokens after a ``prefix_len`` prefix, per k.

    For each k: a fresh cache, a prefill of token ids ``arange(prefix_len) % vocab``, ``warmup``
    untimed forwards, then ``repeats`` timed ones, truncating the cache back to the prefix before
    each so every repeat sees the same context length. ``timer`` returns seconds.
    """
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
    return CostTable(key=cost_key(target, prefix_len), k=ks, ms=medians)


def get_or_measure(
    target,
    ks: Sequence[int] = DEFAULT_KS,
    prefix_len: int = 64,
    repeats: int = 5,
    path: str | os.PathLike | None = None,
    refresh: bool = False,
    progress: bool = True,
    timer: Callable[[], float] = time.perf_counter,
) -> CostTable:
    """The cached table for this target's key if it covers ``ks``, else measure and cache it."""
    key = cost_key(target, prefix_len)
    path = Path(path) if path is not None else default_cache_path(key)
    if not refresh and path.is_file():
        try:
            cached = CostTable.load(path)
        except ValueError:
            cached = None  # a corrupt cache file is re-measured, not fatal
        if cached is not None and cached.key == key and set(ks) <= set(cached.k):
            return cached
    table = measure_cost_table(target, ks, prefix_len, repeats, timer=timer, progress=progress)
    table.save(path)
    return table


# ============================================================================ choosing budgets


def _check_probabilities(name: str, values: Sequence[float]) -> list[float]:
    values = [float(v) for v in values]
    for index, value in enumerate(values):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}[{index}] = {value} is not a probability in [0, 1]")
    return values


def _check_descending(name: str, values: Sequence[float]) -> list[float]:
    values = _check_probabilities(name, values)
    for index in range(1, len(values)):
        if values[index] > values[index - 1]:
            raise ValueError(
                f"{name} must be sorted descending (best candidate first); "
                f"index {index} ({values[index]}) > index {index - 1} ({values[index - 1]})"
            )
    return values


def _check_cost_inputs(draft_ms: float, budget: int, other: int, budget_name: str) -> None:
    if draft_ms < 0:
        raise ValueError(f"draft time must be >= 0 ms, got {draft_ms}")
    if budget < 0:
        raise ValueError(f"{budget_name} must be >= 0, got {budget}")
    if other < 0:
        raise ValueError(f"batch_tokens_other must be >= 0, got {other}")


def chain_path_scores(accept_probs_by_depth: Sequence[float]) -> list[float]:
    """Per-depth conditional acceptance a_d -> P(depths 1..d all accepted) = prod_{j<=d} a_j."""
    scores, running = [], 1.0
    for prob in _check_probabilities("accept_probs_by_depth", accept_probs_by_depth):
        running *= prob
        scores.append(running)
    return scores


def choose_chain_length(
    accept_probs_by_depth: Sequence[float],
    cost: CostTable,
    draft_ms_per_token: float,
    max_gamma: int,
    batch_tokens_other: int = 0,
) -> int:
    """Draft length g in 0..min(max_gamma, len(probs)) maximising expected tokens per ms.

    Objective: E[tau](g) / (g * draft_ms_per_token + T(batch_tokens_other + g + 1)), with
    E[tau](g) = 1 + sum_{d<=g} prod_{j<=d} a_j. Depths without an estimate are not drafted.
    Returns 0 (plain decoding this step) unless some g > 0 is strictly better; ties go to the
    shorter draft. Pass only pre-draft information (see the module docstring).
    """
    _check_cost_inputs(draft_ms_per_token, max_gamma, batch_tokens_other, "max_gamma")
    path_scores = chain_path_scores(accept_probs_by_depth)[:max_gamma]
    best_length = 0
    best_rate = 1.0 / cost.t(batch_tokens_other + 1)
    expected_tokens = 1.0
    for length, score in enumerate(path_scores, start=1):
        expected_tokens += score
        spent_ms = length * draft_ms_per_token + cost.t(batch_tokens_other + length + 1)
        rate = expected_tokens / spent_ms
        if rate > best_rate:
            best_length, best_rate = length, rate
    return best_length


def choose_tree_budget(
    node_scores: Sequence[float],
    cost: CostTable,
    draft_ms: float,
    max_nodes: int,
    batch_tokens_other: int = 0,
    draft_ms_per_node: float = 0.0,
) -> int:
    """Number of tree nodes n in 0..max_nodes maximising expected tokens per ms.

    ``node_scores`` (sorted descending) estimate P(the node's whole path is accepted); keeping
    the n best is a valid tree when every child scores <= its parent (true for path
    probabilities; order ties parent-first). Objective for n > 0:
    (1 + sum_{i<n} score_i) / (draft_ms + n * draft_ms_per_node + T(other + n + 1)); for n = 0
    (no drafting at all) 1 / T(other + 1). Ties go to the smaller tree.
    """
    _check_cost_inputs(draft_ms, max_nodes, batch_tokens_other, "max_nodes")
    if draft_ms_per_node < 0:
        raise ValueError(f"draft_ms_per_node must be >= 0, got {draft_ms_per_node}")
    scores = _check_descending("node_scores", node_scores)[:max_nodes]
    best_nodes = 0
    best_rate = 1.0 / cost.t(batch_tokens_other + 1)
    expected_tokens = 1.0
    for nodes, score in enumerate(scores, start=1):
        expected_tokens += score
        spent_ms = draft_ms + nodes * draft_ms_per_node + cost.t(batch_tokens_other + nodes + 1)
        rate = expected_tokens / spent_ms
        if rate > best_rate:
            best_nodes, best_rate = nodes, rate
    return best_nodes


def allocate_batch_budget(
    per_request_scores: Sequence[Sequence[float]],
    cost: CostTable,
    draft_ms: float,
    max_total_tokens: int | None = None,
) -> list[int]:
    """Split draft positions across the requests of one batched verify forward.

    Each request's scores (sorted descending; e.g. ``chain_path_scores`` or tree path
    probabilities) are the chances its next candidate positions survive. Positions are admitted
    in order of score across all requests (the best n of all positions, each request keeping a
    prefix of its list), and n is chosen to maximise expected total tokens per ms:

        (R + S_n) / (n * draft_ms + T(R + n))      R = requests, S_n = sum of the n best scores

    ``draft_ms`` is the cost per admitted position. Unlike "stop at the first position that does
    not help", this scans every n, so it is the exact optimum of the objective even where a
    measured T(k) has plateaus and steps. ``max_total_tokens`` caps R + n (scheduler limit).
    Returns the number of admitted positions per request (0 = plain decoding for it).
    """
    num_requests = len(per_request_scores)
    if num_requests == 0:
        return []
    _check_cost_inputs(draft_ms, 0, 0, "budget")
    candidates = []  # (score, request, position) for every draftable position
    for request, scores in enumerate(per_request_scores):
        for position, score in enumerate(_check_descending(f"scores[{request}]", scores)):
            candidates.append((score, request, position))
    # best first; within a request the earlier position wins ties, so selections stay prefixes
    candidates.sort(key=lambda item: (-item[0], item[1], item[2]))
    if max_total_tokens is not None:
        if max_total_tokens < num_requests:
            raise ValueError(
                f"max_total_tokens={max_total_tokens} is below the {num_requests} tokens the "
                "requests need without drafting"
            )
        candidates = candidates[:max_total_tokens - num_requests]
    best_admitted, best_rate = 0, num_requests / cost.t(num_requests)
    expected_tokens = float(num_requests)
    for admitted, (score, _, _) in enumerate(candidates, start=1):
        expected_tokens += score
        rate = expected_tokens / (admitted * draft_ms + cost.t(num_requests + admitted))
        if rate > best_rate:
            best_admitted, best_rate = admitted, rate
    budgets = [0] * num_requests
    for _, request, _ in candidates[:best_admitted]:
        budgets[request] += 1
    return budgets


@dataclass
class AcceptanceTracker:
    """Running per-depth acceptance estimates a_d = P(depth d accepted | depth d reached).

    Each depth keeps exponentially decayed counts (``decay`` per observation) shrunk toward
    ``prior`` with ``prior_weight`` pseudo-observations, so early estimates are sane and old
    behaviour fades. Depths never observed report the prior.
    """

    prior: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.95
    accepted_weight: list[float] = field(default_factory=list)  # decayed accepts per depth
    reached_weight: list[float] = field(default_factory=list)  # decayed reaches per depth

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {self.prior}")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    def update(self, drafted_depths: int, accepted: int) -> None:
        """One verify step: depths 1..drafted_depths were drafted, the first ``accepted`` kept."""
        if drafted_depths < 0 or not 0 <= accepted <= drafted_depths:
            raise ValueError(
                f"need 0 <= accepted <= drafted_depths, got accepted={accepted}, "
                f"drafted_depths={drafted_depths}"
            )
        reached = min(drafted_depths, accepted + 1)  # depths 1..reached were tried
        while len(self.reached_weight) < reached:
            self.reached_weight.append(0.0)
            self.accepted_weight.append(0.0)
        for index in range(reached):
            self.reached_weight[index] = self.decay * self.reached_weight[index] + 1.0
            self.accepted_weight[index] = (
                self.decay * self.accepted_weight[index] + (1.0 if index < accepted else 0.0)
            )

    def probs(self, max_depth: int) -> list[float]:
        """Estimated a_1..a_max_depth."""
        if max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {max_depth}")
        estimates = []
        for index in range(max_depth):
            accepted = self.accepted_weight[index] if index < len(self.accepted_weight) else 0.0
            reached = self.reached_weight[index] if index < len(self.reached_weight) else 0.0
            estimates.append(
                (self.prior * self.prior_weight + accepted) / (self.prior_weight + reached)
            )
        return estimates

    def path_scores(self, max_depth: int) -> list[float]:
        """P(depths 1..d all accepted) for d = 1..max_depth (input to allocate_batch_budget)."""
        return chain_path_scores(self.probs(max_depth))


# ============================================================================ plot + CLI


def plot_cost_table(table: CostTable, path: str | os.PathLike) -> Path:
    """Save a PNG of T(k)/T(1) vs k with the memory-bound ideal (1) for reference."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4))
    FigureCanvasAgg(figure)  # Agg without touching pyplot's global backend
    axes = figure.add_subplot()
    axes.plot(table.k, [table.ratio(k) for k in table.k], marker="o", label="measured T(k)/T(1)")
    axes.axhline(1.0, linestyle="--", color="gray", label="memory-bound ideal")
    axes.set_xlabel("k (new tokens in one forward)")
    axes.set_ylabel("T(k) / T(1)")
    model = table.key.get("model", "")
    device = table.key.get("device", "")
    axes.set_title(f"verify cost {model} {device}".strip())
    axes.set_ylim(bottom=0)
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


def _parse_ks(text: str) -> list[int]:
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--ks must be comma-separated integers like 1,2,4,8, got {text!r}"
        ) from None
    if not ks or min(ks) < 1:
        raise ValueError(f"--ks needs integers >= 1, got {text!r}")
    return ks


def add_profile_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``specdec profile``."""
    parser.add_argument("--model", required=True, help="registry name, HF dir or .gguf file")
    parser.add_argument("--dtype", default="float32", help="weights dtype for the target")
    parser.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)),
                        help="token counts to time, comma-separated")
    parser.add_argument("--prefix-len", type=int, default=64, help="context length before k")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per k (median)")
    parser.add_argument("--json", action="store_true",
                        help='print only {"k": [...], "ms": [...]} on stdout')
    parser.add_argument("--plot", default=None, help="save T(k)/T(1) vs k as this PNG")
    parser.add_argument("--cached", action="store_true",
                        help="reuse the cached table for this setup instead of re-measuring")
    return parser


def run_profile(args: argparse.Namespace, load_target_fn: Callable, out=None) -> int:
    """Measure (or load) T(k) for ``args.model``, cache it, print it; returns the exit code."""
    out = out if out is not None else sys.stdout
    ks = _parse_ks(args.ks)
    # keep stdout clean for --json: anything printed while loading/measuring goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        target = load_target_fn(args.model, dtype=args.dtype)
        table = get_or_measure(
            target, ks, prefix_len=args.prefix_len, repeats=args.repeats,
            refresh=not args.cached, progress=True,
        )
        if args.plot:
            plot_cost_table(table, args.plot)
    requested = [k for k in table.k if k in set(ks)]
    if args.json:
        print(json.dumps({"k": requested, "ms": [table.t(k) for k in requested]}), file=out)
        return 0
    print(f"T(k) for {table.key.get('model')} on {table.key.get('device')} "
          f"({table.key.get('dtype')}, {table.key.get('threads')} threads, "
          f"prefix {table.key.get('prefix_len')})", file=out)
    print(f"{'k':>4} {'ms':>10} {'T(k)/T(1)':>10}", file=out)
    for k in requested:
        print(f"{k:>4} {table.t(k):>10.2f} {table.ratio(k):>10.2f}", file=out)
    print(f"cached at {default_cache_path(table.key)}", file=out)
    if args.plot:
        print(f"plot saved to {args.plot}", file=out)
    return 0
