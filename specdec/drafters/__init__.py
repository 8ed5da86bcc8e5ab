"""Drafters: one file per method, each registered by name (see base.py)."""

import importlib
import pkgutil

from .base import DRAFTERS, DraftContext, Drafter, make_drafter, register_drafter

__all__ = ["DRAFTERS", "DraftContext", "Drafter", "make_drafter", "register_drafter"]


def _load_all() -> None:
    """Import every drafter module once so their @register_drafter decorators run."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base" and not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
