"""Validation of integer options (drafter options, settings, CLI numbers): one message format."""

from __future__ import annotations


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """`value` when it is an integer (not a bool) in [low, high] (no upper bound when high is None);
    otherwise a ValueError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return value


def check_positive_int(name: str, value) -> int:
    """`value` when it is an integer >= 1."""
    return check_int(name, value, 1)
