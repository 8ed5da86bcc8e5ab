"""What the benchmark runs: methods (specdec's and peers'), the peer runtimes, and the registry of
methods by name (see the package docstring for how to add one)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..sampling import SamplingParams
from ..stats import SpecStats
from .report import BASELINE


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
class PeerSource:
    """What a peer runtime may use of the benchmark's own target, which is freed before the peers load."""

    name: str  # registry name, HF dir or .gguf path the target was loaded from
    model_dir: Path | None  # its HF-format directory (the converted cache entry for GGUF models)
    tokenizer: object  # specdec's tokenizer: peers see the very prompt ids specdec's methods see
    vocab_size: int
    eos_token_ids: list[int]  # what ends a generation, for every method alike


class PeerRuntime(ABC):
    """Another library's copy of the target, shared by that library's peers (loaded once per run)."""

    name: str = ""  # "transformers", "llama.cpp" (shown in the report)
    # False: each method holds a whole engine of its own (vLLM: one LLM(...) per method), so the
    # runner runs this runtime's methods one after another, the reference first, each freed before
    # the next is built (several engines of a large target at once do not fit in memory)
    methods_at_once: bool = True
    # True: its copy of the target is held beside the bench's own (llama.cpp maps the GGUF file), so its
    # methods run interleaved with specdec's, question by question in the same rounds: the ratios between
    # them do not carry the machine's swings between the two phases of a run
    beside_target: bool = False

    def missing(self) -> str | None:
        """Why this runtime cannot run here at all (a package not installed: how to get it), else None.
        Checked before anything is loaded, so the user reads it at once and the other methods still run."""
        return None

    def reuses(self, target) -> bool:
        """True when the benchmark's own target already is this runtime's kind of model."""
        return False

    @abstractmethod
    def load(self, source: PeerSource, config):
        """The runtime's target (has encode_prompt / decode); raises MethodUnavailable."""


@dataclass(frozen=True)
class MethodEntry:
    # build(target, options {key: raw string}, config) -> BenchMethod; raises MethodUnavailable
    build: Callable[..., BenchMethod]
    runtime: PeerRuntime | None = None  # None: a specdec method; else a peer, run on this runtime's target
    help: str = ""
    reference: str = BASELINE  # the method whose greedy output this one is compared with, token for token

    @property
    def peer(self) -> bool:
        return self.runtime is not None


METHODS: dict[str, MethodEntry] = {}


def register_method_factory(name: str, build: Callable[..., BenchMethod], runtime: PeerRuntime | None = None,
                            help: str = "", reference: str = BASELINE) -> None:
    """Register `build(target, options, config) -> BenchMethod` under `name` (a peer: with its `runtime`).

    `reference`: the method whose greedy output this one's is compared with (plain decoding, or a
    peer's own plain decoding); the runner adds it to a run that lacks it."""
    if not name or ":" in name or "," in name:
        raise ValueError(f"method name must be non-empty without ':' or ',', got {name!r}")
    existing = METHODS.get(name)
    if existing is not None and existing.build is not build:
        raise ValueError(f"a bench method named {name!r} is already registered")
    METHODS[name] = MethodEntry(build, runtime, help, reference)


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
        register_method_factory(name, build, help=help)
        return function

    return decorate(fn) if fn is not None else decorate
