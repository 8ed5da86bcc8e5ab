"""`specdec bench`'s command line: its arguments, the BenchConfig they make, the entry point."""

from __future__ import annotations

import argparse
import sys

from .questions import TASK_KINDS, default_questions_path
from .runner import DEFAULT_MAX_NEW_TOKENS, DEFAULT_METHODS, QUICK_LIMIT_PER_KIND, BenchConfig, run_benchmark
from ..budget import parse_gamma
from ..models import add_weights_argument
from ..models.registry import DEFAULT_MODEL


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="comma-separated: plain, drafter names (`specdec drafters`), hf-plain, hf-assisted, hf-pld, "
                             "llama-plain, llama-lookup (llama.cpp: pip install 'specdec[peers]'), vllm-plain, "
                             "vllm-ngram, vllm-suffix, vllm-draft-model, vllm-eagle3, vllm-dflash, vllm-dspark, vllm-medusa "
                             "(vLLM CPU in its own venv: specdec peers install vllm); "
                             "options as NAME:KEY=VALUE:KEY=VALUE; a drafter's gamma=N|auto replaces --gamma for "
                             "that method (default: %(default)s)")
    parser.add_argument("--target", default=DEFAULT_MODEL, help="target model: registry name, HF dir or .gguf")
    parser.add_argument("--draft-model", default=None,
                        help="draft model for small-model and hf-assisted (default: qwen2.5-coder-0.5b for "
                             "qwen2.5-coder-1.5b, else none)")
    parser.add_argument("--questions", default=None, help=f"Spec-Bench questions jsonl (default: {default_questions_path()})")
    parser.add_argument("--kinds", default=None, help=f"comma-separated task kinds (default: all of {', '.join(TASK_KINDS)})")
    parser.add_argument("--limit-per-category", type=int, default=None, metavar="N",
                        help=f"questions per task kind (quick profile default: {QUICK_LIMIT_PER_KIND})")
    parser.add_argument("--full", action="store_true", help="every question (instead of the quick profile)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--gamma", default="auto", help="'auto' (cost model; confidence scheduler for drafters that score "
                        "their positions) or a fixed draft length / node budget")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs are checked against plain)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_weights_argument(parser)
    parser.add_argument("--out", default=None, help="output folder (default: runs/bench-<timestamp>)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation per method")
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="rounds per question (every other round in reverse method order), each on a freshly built "
                             "method (vLLM's: an engine start per round); a turn's time is the median of its rounds, "
                             "every round's output is checked (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.full and args.limit_per_category is not None:
        raise ValueError("--full runs every question; do not combine it with --limit-per-category")
    gamma = parse_gamma(args.gamma)
    return BenchConfig(
        methods=[m for m in args.methods.split(",") if m.strip()],
        target=args.target,
        draft_model=args.draft_model,
        questions_path=args.questions,
        task_kinds=[k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None,
        limit_per_kind=None if args.full else (
            QUICK_LIMIT_PER_KIND if args.limit_per_category is None else args.limit_per_category
        ),
        max_new_tokens=args.max_new_tokens,
        gamma=gamma,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        dtype=args.dtype,
        weights=args.weights,
        out_dir=args.out,
        warmup=not args.no_warmup,
        repeats=args.repeats,
        progress=not args.no_progress,
    )


def run_bench(args: argparse.Namespace) -> int:
    """CLI entry (`specdec bench`): run, write results, print the Markdown table; 1 on a mismatch."""
    result = run_benchmark(config_from_args(args))
    print(result.markdown)
    print(f"\nresults: {result.out_dir}/results.json, results.md, *.png", file=sys.stderr)
    return result.exit_code
