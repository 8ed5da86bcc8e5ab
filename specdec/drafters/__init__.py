"""Drafters: one file per method, each registered by name (see base.py)."""

from .base import (
    DRAFTERS, DraftContext, DraftCost, Drafter, drafter_class, drafter_option_names, drafter_options, listed_drafters,
    make_drafter, register_drafter, registered_drafters,
)

__all__ = [
    "DRAFTERS", "DraftContext", "DraftCost", "Drafter", "drafter_class", "drafter_option_names", "drafter_options", "listed_drafters",
    "make_drafter", "register_drafter", "registered_drafters",
]
