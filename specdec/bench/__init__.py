"""Spec-Bench-style benchmark: methods x task kinds, specdec drafters and transformers peers side by side.

A *method* is anything that turns prompt ids into output ids on the benchmark's target. Methods
are looked up by name: first in the bench registry below (`plain`, the `hf-*` peers, anything a
test or plugin registers), then among the registered specdec drafters (`make_drafter(name, ...)`).

    from specdec.bench import register_method

    @register_method("my-method")
    def my_method(target, prompt_ids, max_new_tokens, sampling):
        ...
        return tokens, stats          # stats: a SpecStats or None

Run it with `specdec bench --methods plain,my-method` or `run_benchmark(BenchConfig(...))`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from ..sampling import SamplingParams
from ..stats import SpecStats


@dataclass
class MethodOutput:
    tokens: list[int]  # generated ids (EOS included when it ended the output)
    stats: SpecStats | None = None  # speculative statistics; None for methods without them (peers)
    target_forwards: int | None = None  # target forward calls, when counted (peers: tau = tokens / forwards)


class BenchMethod(ABC):
    """One benchmarked way of generating on a target."""

    exact: bool = True  # greedy output must equal plain decoding token for token (False: a mismatch is a warning)
    description: str = ""

    @abstractmethod
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> MethodOutput:
        """Generate for one prompt (token ids, chat template already applied)."""

    def close(self) -> None:
        """Release what the method holds (models, caches) before the next phase loads its own."""


class MethodUnavailable(Exception):
    """A method that cannot run in this setting (e.g. no draft model): reported as n/a, not a failure."""


@dataclass(frozen=True)
class MethodEntry:
    # build(target, options {key: raw string}, config) -> BenchMethod; raises MethodUnavailable
    build: Callable[..., BenchMethod]
    peer: bool = False  # True: runs after every specdec method, on a transformers copy of the target
    help: str = ""


METHODS: dict[str, MethodEntry] = {}


def register_method_factory(name: str, build: Callable[..., BenchMethod], peer: bool = False, help: str = "") -> None:
    """Register `build(target, options, config) -> BenchMethod` under `name`."""
    if not name or ":" in name or "," in name:
        raise ValueError(f"method name must be non-empty without ':' or ',', got {name!r}")
    existing = METHODS.get(name)
    if existing is not None and existing.build is not build:
        raise ValueError(f"a bench method named {name!r} is already registered")
    METHODS[name] = MethodEntry(build, peer, help)


def unregister_method(name: str) -> None:
    """Remove a registered bench method (tests register temporary ones)."""
    METHODS.pop(name, None)


class CallableMethod(BenchMethod):
    """Wraps `fn(target, prompt_ids, max_new_tokens, sampling) -> (tokens, stats | None)`."""

    def __init__(self, fn: Callable, target, exact: bool, description: str):
        self.fn, self.target, self.exact, self.description = fn, target, exact, description

    def generate(self, prompt_ids, max_new_tokens, sampling) -> MethodOutput:
        tokens, stats = self.fn(self.target, list(prompt_ids), max_new_tokens, sampling)
        return MethodOutput(list(tokens), stats)

    def close(self) -> None:
        self.target = None


def register_method(name: str, fn: Callable | None = None, exact: bool = True, help: str = ""):
    """Register a plain callable `(target, prompt_ids, max_new_tokens, sampling) -> (tokens, stats)`.

    exact=True: its greedy output must equal plain decoding (a mismatch fails the run).
    Usable directly (`register_method("x", fn)`) or as a decorator (`@register_method("x")`)."""

    def decorate(function: Callable) -> Callable:
        def build(target, options: dict, config) -> BenchMethod:
            if options:
                raise ValueError(f"method {name!r} takes no options, got {sorted(options)}")
            return CallableMethod(function, target, exact, help or function.__doc__ or "")

        build.wraps = function  # same function registered twice = the same method
        existing = METHODS.get(name)
        if existing is not None and getattr(existing.build, "wraps", None) is function:
            return function
        register_method_factory(name, build, peer=False, help=help)
        return function

    return decorate(fn) if fn is not None else decorate


# The runner imports the names above from this package, so it is imported last.
from .runner import BenchConfig, add_bench_arguments, run_bench, run_benchmark  # noqa: E402

__all__ = [
    "METHODS", "BenchConfig", "BenchMethod", "MethodEntry", "MethodOutput", "MethodUnavailable", "add_bench_arguments",
    "register_method", "register_method_factory", "run_bench", "run_benchmark", "unregister_method",
]
