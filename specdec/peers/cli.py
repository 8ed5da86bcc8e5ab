"""`specdec peers [list]`, `specdec peers install NAME [--force]` and `specdec peers float-dir MODEL`
(routed here by specdec.cli)."""

from __future__ import annotations

import argparse
import json

from .envs import ENGINES, engine_env, install


def add_peers_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="peers_command")
    listing = actions.add_parser("list", help="the engines, their pinned versions, status and virtualenv (the default)")
    listing.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    installer = actions.add_parser("install", help="create an engine's own virtualenv under the cache (network + pip)")
    installer.add_argument("name", choices=sorted(ENGINES), help="the engine")
    installer.add_argument("--force", action="store_true", help="reinstall even when the install is complete")
    installer.set_defaults(peers_action=_install)
    float_dir = actions.add_parser("float-dir", help="write (once) and print a model's float32 HF directory, which "
                                                     "engines that read no GGUF blocks (vLLM) load")
    float_dir.add_argument("model", help="registry name, HF model directory or .gguf file")
    float_dir.set_defaults(peers_action=_float_dir)


def run_peers(args: argparse.Namespace) -> int:
    return getattr(args, "peers_action", _list)(args)


def _install(args: argparse.Namespace) -> int:
    print(install(engine_env(args.name), progress=True, force=args.force))
    return 0


def _float_dir(args: argparse.Namespace) -> int:
    from ..models.float_dir import float_model_dir

    print(float_model_dir(args.model, progress=True))
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = [{"name": env.name, "version": env.version, "status": env.status(), "python": str(env.python)}
            for env in ENGINES.values()]
    if getattr(args, "json", False):
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"{row['name']} {row['version']}: {row['status']}\n  python: {row['python']}")
    return 0
