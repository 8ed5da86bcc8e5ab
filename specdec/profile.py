"""`specdec profile`: measure (or reuse) the target's step-cost table T(k), print and plot it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .cost import DEFAULT_KS, CostTable, default_cache_path, get_or_measure
from .models import add_weights_argument


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


def measure_memory_bandwidth(gib: float = 1.0, repeats: int = 5, clock: str = "wall") -> float:
    """Read bandwidth in GB/s: the best of `repeats` torch.sum passes over a `gib` GiB fp32 tensor
    (far larger than any cache) with torch's current thread count: what a weight stream can reach.
    `clock` as the cost table's (CLOCKS): "cpu" divides by the process's CPU time."""
    import torch

    from .cost import CLOCKS

    timer = CLOCKS[clock]
    data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)  # touched once: pages are mapped
    best = float("inf")
    for _ in range(repeats):
        start = timer()
        float(data.sum())
        best = min(best, timer() - start)
    return data.numel() * 4 / best / 1e9


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
    add_weights_argument(parser)
    parser.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)),
                        help="token counts to time, comma-separated")
    parser.add_argument("--prefix-len", type=int, default=64, help="context length before k")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per k (median)")
    parser.add_argument("--json", action="store_true",
                        help='print only {"k": [...], "ms": [...]} on stdout')
    parser.add_argument("--plot", default=None, help="save T(k)/T(1) vs k as this PNG")
    parser.add_argument("--cached", action="store_true",
                        help="reuse the cached table for this setup instead of re-measuring")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="'cpu': time forwards in process CPU time (all threads) instead of wall clock; "
                             "robust on a shared, oversubscribed machine, for comparing setups (a separate "
                             "cached table)")
    parser.add_argument("--bandwidth", action="store_true",
                        help="also measure the machine's memory read bandwidth (a 1 GiB torch.sum) and "
                             "print the weight stream's share of it")
    return parser


def run_profile(args: argparse.Namespace, load_target_fn: Callable | None = None, out=None) -> int:
    """Measure (or load) T(k) for ``args.model``, cache it, print it; returns the exit code."""
    if load_target_fn is None:
        from .api import load_target as load_target_fn
    out = out if out is not None else sys.stdout
    from .drafters.small_model import decode_cost_bytes

    ks = _parse_ks(args.ks)
    # keep stdout clean for --json: anything printed while loading/measuring goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        target = load_target_fn(args.model, dtype=args.dtype, weights=args.weights)
        table = get_or_measure(
            target, ks, prefix_len=args.prefix_len, repeats=args.repeats,
            refresh=not args.cached, progress=True, clock=getattr(args, "clock", "wall"),
        )
        if args.plot:
            plot_cost_table(table, args.plot)
        step_bytes = decode_cost_bytes(target)  # weights one forward streams (embedding lookup excluded)
        clock = getattr(args, "clock", "wall")
        bandwidth = measure_memory_bandwidth(clock=clock) if getattr(args, "bandwidth", False) else None
    requested = [k for k in table.k if k in set(ks)]
    if args.json:
        print(json.dumps({"k": requested, "ms": [table.t(k) for k in requested]}), file=out)
        return 0
    print(f"T(k) for {table.key.get('model')} on {table.key.get('device')} "
          f"({table.key.get('dtype')}, {table.key.get('weights')} weights, {table.key.get('threads')} threads, "
          f"prefix {table.key.get('prefix_len')}, {table.key.get('clock', 'wall')} clock)", file=out)
    print(f"{'k':>4} {'ms':>10} {'T(k)/T(1)':>10}", file=out)
    for k in requested:
        print(f"{k:>4} {table.t(k):>10.2f} {table.ratio(k):>10.2f}", file=out)
    if step_bytes == step_bytes:  # not NaN: a model whose weights we can count
        reached = step_bytes / (table.t(1) / 1000.0) / 1e9
        line = f"weights per step {step_bytes / 1e6:.0f} MB: T(1) streams them at {reached:.1f} GB/s"
        if bandwidth is not None:
            line += f" = {100 * reached / bandwidth:.0f} % of the measured {bandwidth:.1f} GB/s (1 GiB torch.sum, {clock} clock)"
        print(line, file=out)
    print(f"cached at {default_cache_path(table.key)}", file=out)
    if args.plot:
        print(f"plot saved to {args.plot}", file=out)
    return 0
