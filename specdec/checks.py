"""Validation of user input with one message format each: integer options (drafter options,
settings, CLI numbers) and text (prompts and stop strings from the CLI, the API and the server)."""

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


def check_text(name: str, value: str) -> str:
    """`value` when it is valid Unicode; a ValueError naming `name` when it holds a lone surrogate,
    which no tokenizer can encode: JSON's "\\ud800", or bytes that are not UTF-8 in argv (Python
    decodes those to U+DC80..U+DCFF)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} is not valid Unicode: a lone surrogate (U+{ord(value[error.start]):04X}) "
                         f"at character {error.start}") from None
    return value
