"""`specdec generate | models | drafters | theory | profile | bench | datastore | serve | train | export | peers`."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import time

# subcommand -> (module, function adding its arguments to a subparser, function running it).
# Each feature owns its arguments; the CLI only routes.
SUBCOMMANDS = {
    "theory": ("specdec.theory", "add_theory_arguments", "run_theory", "E[tau], speedup and optimal gamma tables"),
    "profile": ("specdec.profile", "add_profile_arguments", "run_profile", "measure the target's step-cost table T(k)"),
    "bench": ("specdec.bench.cli", "add_bench_arguments", "run_bench", "Spec-Bench: methods x task kinds, with peers"),
    "serve": ("specdec.server.serve", "add_serve_arguments", "run_serve", "OpenAI-compatible HTTP server"),
    "train": ("specdec.train.cli", "add_train_arguments", "run_train", "train drafters (medusa, mtp, eagle1, eagle3, dflash, dspark) and make their data"),
    "export": ("specdec.train.cli", "add_export_arguments", "run_export", "write a trained drafter in SGLang / vLLM layout"),
    "peers": ("specdec.peers.cli", "add_peers_arguments", "run_peers", "install and locate other engines (vLLM) in their own virtualenvs"),
}


def _load_target_with_status(name: str, dtype: str, weights: str | None = None):
    from rich.console import Console

    from .api import load_target

    console = Console(stderr=True)
    start = time.perf_counter()
    with console.status(f"loading {name} ..."):
        target = load_target(name, dtype=dtype, weights=weights)
    console.print(f"[dim]loaded {target.name} ({target.num_layers} layers, vocab {target.vocab_size}) in {time.perf_counter() - start:.1f}s[/dim]")
    return target


def cmd_generate(args) -> int:
    from .api import generate, stream
    from .budget import parse_gamma
    from .checks import check_text
    from .drafters import drafter_options, make_drafter
    from .sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    options = drafter_options(args.drafter, args.drafter_arg) if args.drafter else {}
    gamma = parse_gamma(args.gamma)  # before loading: a typo costs no model load
    check_text("prompt", args.prompt)  # bytes that are not UTF-8 in argv: the same error Target.encode_prompt gives
    target = _load_target_with_status(args.model, args.dtype, args.weights)
    drafter = make_drafter(args.drafter, target, **options) if args.drafter else None
    prompt = args.prompt
    if args.stream:
        for piece in stream(target, prompt, drafter, args.max_new_tokens, sampling, args.stop, gamma):
            print(piece, end="", flush=True)
        print()
        return 0
    result = generate(target, prompt, drafter, args.max_new_tokens, sampling, args.stop, gamma)
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
                          "stats": result.stats.to_dict()}))
        return 0
    print(result.text)
    tps = result.stats.tokens_per_second
    print(f"\n[{len(result.tokens)} tokens, {tps:.1f} tokens/s, tau {result.stats.tau:.2f}, {result.finish_reason}]",
          file=sys.stderr)
    if args.stats:
        print(result.stats.summary_table(), file=sys.stderr)
    return 0


def cmd_drafters(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .drafters import drafter_option_names, listed_drafters

    table = Table(title="drafters (use --drafter NAME --drafter-arg KEY=VALUE)")
    table.add_column("name")
    table.add_column("trees")
    table.add_column("options (defaults)")
    for name, cls in sorted(listed_drafters().items()):
        params = inspect.signature(cls.__init__).parameters
        opts = ", ".join(f"{option}={params[option].default!r}" for option in drafter_option_names(cls))
        table.add_row(name, "yes" if cls.cost.trees else "opt" if "tree" in opts else "no", opts)
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    from .models import add_weights_argument
    from .models.registry import DEFAULT_MODEL, add_models_arguments

    gen = sub.add_parser("generate", help="generate text (plain or speculative)")
    gen.add_argument("prompt", help="the user message (the chat template is applied when the model has one)")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="registry name, HF model directory, or .gguf file")
    gen.add_argument("--drafter", default=None, help="drafter name (see `specdec drafters`); none = plain decoding")
    gen.add_argument("--drafter-arg", action="append", default=[], metavar="KEY=VALUE", help="drafter option")
    gen.add_argument("--gamma", default="auto",
                     help="draft length / node budget per step: 'auto' (default: the measured cost table decides "
                          "each step, measured once per model and machine; a drafter that scores its positions "
                          "drafts its block and the confidence scheduler verifies the prefix worth it) or a fixed "
                          "int (that block, verified whole)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_weights_argument(gen)
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--stats", action="store_true", help="print speculative statistics")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats)")
    gen.set_defaults(func=cmd_generate)

    add_models_arguments(sub)  # sets func=run_models

    drafters = sub.add_parser("drafters", help="list drafters and their options")
    drafters.set_defaults(func=cmd_drafters)

    from .datastore import add_datastore_arguments

    add_datastore_arguments(sub)  # sets func=run_datastore

    for name, (module_name, add_fn, run_fn, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text)
        getattr(module, add_fn)(command)
        command.set_defaults(func=getattr(module, run_fn))
    return parser


def _add_debug_flag(parser: argparse.ArgumentParser, top: bool = True) -> None:
    """--debug on the top parser and on every (nested) subcommand, so it may follow any of them."""
    parser.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="show the traceback of an error (also SPECDEC_DEBUG=1)")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                _add_debug_flag(subparser, top=False)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, (ValueError, OSError, LookupError)) or type(error).__name__ in USER_ERRORS:
        return text
    if isinstance(error, MemoryError) or "out of memory" in text.lower():
        return f"out of memory: {text}"
    return f"internal error: {type(error).__name__}: {text} (run with --debug for the traceback)"


# errors a user causes (bad input, a damaged cache, a missing kernel) that are not ValueError/OSError
USER_ERRORS = ("ModelCacheError", "ChecksumError", "KernelUnavailable", "ContextLengthError", "KVBudgetError",
               "PeerInstallError")


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. Every failure is one `specdec: error: ...` line and a non-zero exit code;
    --debug (or SPECDEC_DEBUG=1) shows the traceback instead."""
    parser = build_parser()
    _add_debug_flag(parser)
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("SPECDEC_DEBUG", "") not in ("", "0")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # noqa: BLE001 - the last line of defence: never a traceback unless asked
        if debug:
            raise
        message = _one_line(error)
        print(f"specdec: error: {message}", file=sys.stderr)
        return 1 if message.startswith("internal error") else 2


if __name__ == "__main__":
    sys.exit(main())
