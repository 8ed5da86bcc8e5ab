"""`make demo`: the default model answers a built-in prompt, plain and speculative, in one run."""

from __future__ import annotations

import os
import sys

from rich.console import Console

from . import generate, load_target, make_drafter
from .models.registry import DEFAULT_MODEL

PROMPT = (
    "Here is a short Python function:\n\n"
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
    "Rewrite it with a docstring and type hints, keeping the same logic. Show the full function."
)
MODEL = os.environ.get("SPECDEC_DEMO_MODEL", DEFAULT_MODEL)
DRAFTER = os.environ.get("SPECDEC_DEMO_DRAFTER", "pld")  # best training-free drafter on this prompt kind


def main() -> int:
    console = Console()
    console.print(f"[bold]specdec demo[/bold]: {MODEL}, drafter {DRAFTER}")
    target = load_target(MODEL)
    console.print(f"[dim]prompt:[/dim] {PROMPT}\n")
    generate(target, "Hi", make_drafter(DRAFTER, target), max_new_tokens=4, gamma="auto")  # warm-up + cost table
    plain = generate(target, PROMPT, max_new_tokens=160)
    # gamma "auto": the measured cost table of this machine decides each step's draft length
    # (measured once, ~20 s, then cached), so speculation is switched off where it would not pay
    spec = generate(target, PROMPT, make_drafter(DRAFTER, target), max_new_tokens=160, gamma="auto")
    console.print(spec.text)
    console.print()
    same = "identical" if spec.tokens == plain.tokens else "[red]DIFFERENT[/red]"
    speedup = spec.stats.tokens_per_second / plain.stats.tokens_per_second
    console.print(f"plain decoding: {plain.stats.tokens_per_second:6.1f} tokens/s ({len(plain.tokens)} tokens)")
    console.print(
        f"{DRAFTER:>14}: {spec.stats.tokens_per_second:6.1f} tokens/s, tau {spec.stats.tau:.2f}, "
        f"speedup {speedup:.2f}x, output {same} to plain greedy decoding"
    )
    return 0 if spec.tokens == plain.tokens else 1


if __name__ == "__main__":
    sys.exit(main())
