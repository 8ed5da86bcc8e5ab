"""`specdec peers [list]` and `specdec peers install NAME [--force]` (routed here by specdec.cli)."""

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


def run_peers(args: argparse.Namespace) -> int:
    if getattr(args, "peers_command", None) == "install":
        print(install(engine_env(args.name), progress=True, force=args.force))
        return 0
    rows = [{"name": env.name, "version": env.version, "status": env.status(), "python": str(env.python)} for env in ENGINES.values()]
    if getattr(args, "json", False):
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"{row['name']} {row['version']}: {row['status']}\n  python: {row['python']}")
    return 0
