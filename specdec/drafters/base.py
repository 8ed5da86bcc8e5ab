"""The one drafter interface and the name -> class registry.

The loop drives a drafter per sequence, in this order:

    drafter.begin(prompt_ids, target)                 # once, before the prefill
    drafter.on_verified(prefill_result, ctx)          # the prefill's first token
    loop:
        draft = drafter.propose(ctx, budget)          # Draft rooted at ctx.tokens[-1]
        ... one target forward, verify ...
        drafter.on_verified(result, ctx)              # accepted path + bonus/correction
    drafter.on_finished(result, ctx)                  # instead, on the step that ends the sequence

`ctx.tokens` is every committed token (prompt + output); its last token is the "root": it is
committed but not yet in the target's KV cache, and `parents == -1` nodes are its children.
A drafter that needs target hidden states lists their layer indices in `hidden_layers`; the
loop asks the target for them in the same verify forward and hands the rows that entered
the cache (the root plus the accepted path; the prompt after prefill) in `ctx.new_hidden`.

Batching: the loop calls `for_sequence()` once per sequence, so per-sequence state (caches,
tries, indices) never leaks across a batch; heavy shared parts (weights) are shared.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import pkgutil
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..draft import Draft
from ..sampling import SamplingParams
from ..verify import VerifyResult


@dataclass
class DraftContext:
    tokens: list[int]  # committed tokens of this sequence: prompt + output; tokens[-1] is the root
    num_prompt_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None = None  # the sequence's seeded generator (draft sampling)
    new_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n_new, H] rows just cached
    # target logits [N + 1, V] of the last verify forward (root + every draft node, accepted or not;
    # after the prefill: the prompt rows [P, V]); only filled for drafters with
    # `wants_node_logits = True` (Lookahead harvests n-grams from them, training data records labels)
    all_node_logits: torch.Tensor | None = None
    # one target decode step's ms on this machine (the budget policy's measured T(1)), set when a cost
    # model plans the step: what a drafter that times its own work divides by to state a price in
    # target steps (a hybrid's model slots); None: no cost model
    step_ms: float | None = None

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass(frozen=True)
class DraftCost:
    """What one step of a drafter's drafting is and costs: all the budget policy knows of a drafter
    besides `catch_up_tokens` (specdec.budget). A value: drafters set theirs once, when built."""

    block: int = 5  # draft nodes per step when no cost model decides (a scored drafter: its whole block)
    per_token: float = 0.0  # cost of one drafted token in target decode steps (a prior: the auto policy measures)
    # drafts carry Draft.confidences (P(position accepted | previous accepted), computed before the
    # position's token is drawn): under the auto policy the drafter drafts its whole block (one
    # forward, priced per step) and the scheduler verifies the prefix specdec.schedule.admit picks
    scored: bool = False
    trees: bool = False  # drafts are trees (else chains); shown by `specdec drafters`

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 0:
            raise ValueError(f"a drafter's block must be an integer >= 0, got {self.block!r}")
        if not self.per_token >= 0.0:  # NaN fails too
            raise ValueError(f"a drafter's per-token cost must be >= 0 target steps, got {self.per_token!r}")


class Drafter(ABC):
    """Proposes draft tokens (a chain or a tree) for the target to verify."""

    name: ClassVar[str] = ""
    hidden_layers: tuple[int, ...] = ()  # target hidden layers needed (see specdec.models.base)
    wants_node_logits: bool = False  # ask the loop for ctx.all_node_logits after each verify
    cost: DraftCost = DraftCost()  # shape and price of a step's drafting (set per instance when options change it)
    # proposals are a deterministic function of the committed context and nearly free (suffix, pld,
    # rest): a hybrid's retrieval sources
    retrieval_source: ClassVar[bool] = False
    composite: ClassVar[bool] = False  # built of other drafters (hybrid, auto): never another one's part
    # P(a depth-1 draft is accepted) measured before use (a trained checkpoint's held-out top-1 on the
    # target's greedy path): the starting estimate of a composite's tracker for it; None: unknown
    held_out_acceptance: float | None = None

    def for_sequence(self) -> Drafter:
        """A fresh per-sequence drafter sharing heavy resources; default: a shallow copy."""
        return copy.copy(self)

    def begin(self, prompt_ids: list[int], target) -> None:
        """Start a new sequence (reset per-sequence state)."""

    @abstractmethod
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        """Return at most `budget` draft nodes rooted at `ctx.tokens[-1]` (Draft.empty() = none)."""

    def on_verified(self, result: VerifyResult, ctx: DraftContext) -> None:
        """Learn from the verification: accepted path, correction/bonus token, new hidden rows."""

    def on_finished(self, result: VerifyResult, ctx: DraftContext) -> None:
        """The sequence ended with this step (no further proposal): `ctx.new_hidden` /
        `ctx.all_node_logits` hold its last rows. Default: nothing to do."""

    def parts(self) -> list[Drafter]:
        """The drafters this one is built of and drives through begin / on_verified / on_finished
        (a composite's sources); none by default."""
        return []

    def offered_paths(self, ctx: DraftContext, limit: int, paid: bool = True) -> list[tuple[float, float]] | None:
        """The nodes this step's proposal would hold, best first (at most `limit`), known before
        drafting: (path score: estimated P(the node's whole path is accepted), drafting price of the
        node in target decode steps). The budget policy verifies the prefix that earns the most
        tokens per ms, each node priced at its drafting plus its share of the verify forward, and
        `propose(ctx, n)` then holds exactly the first n. A composite offers this (a hybrid: its
        retrieval matches, found and free, and its model's chain slots at the model's price), so a
        paid part that does not pay never switches the free part off. Scores must come from
        pre-draft information (docs/architecture.md). `paid=False`: the nodes that cost nothing to
        draft alone (the policy declines the paid part this step: its catch-up would not repay);
        the next `propose` holds the first n of the latest offer. Default: None (the policy plans
        the drafter by its record of earlier steps)."""
        return None

    def catch_up_tokens(self, ctx: DraftContext) -> int:
        """Committed tokens the next proposal must first feed through the drafter's own model
        (a draft model's prompt prefill, or tokens committed while drafting was off). Each costs
        about `cost.per_token` of a target token in a prefill-sized forward; the budget
        policy weighs this one-off cost against the expected saving. 0: no such cache."""
        return 0

    def catch_up_price(self) -> float:
        """A catch-up token's price in target steps of a forward that size: `cost.per_token` (a
        composite that delegates answers for the part that would run)."""
        return self.cost.per_token


DRAFTERS: dict[str, type[Drafter]] = {}  # every registered drafter by name: what make_drafter builds
LISTED: dict[str, type[Drafter]] = {}  # the ones offered to users (`specdec drafters`): all but the testing drafters


def register_drafter(cls: type[Drafter] | None = None, *, listed: bool = True):
    """Class decorator: make a drafter available to `make_drafter(cls.name, ...)` and the CLI.
    `@register_drafter(listed=False)`: buildable by name (tests, `--drafter NAME`) but not offered
    to users (the testing drafters: `specdec drafters` and the unknown-name error leave it out)."""

    def register(cls: type[Drafter]) -> type[Drafter]:
        if not cls.name:
            raise ValueError(f"{cls.__name__} needs a non-empty `name`")
        if cls.name in DRAFTERS and DRAFTERS[cls.name] is not cls:
            raise ValueError(f"two drafters are registered as {cls.name!r}")
        DRAFTERS[cls.name] = cls
        if listed:
            LISTED[cls.name] = cls
        return cls

    return register if cls is None else register(cls)


def registered_drafters() -> dict[str, type[Drafter]]:
    """Every drafter by name, the testing ones included; imports each drafter module once so its
    @register_drafter runs."""
    package = importlib.import_module(__package__)
    for module in pkgutil.iter_modules(package.__path__):
        if module.name != "base" and not module.name.startswith("_"):
            importlib.import_module(f"{__package__}.{module.name}")
    return DRAFTERS


def listed_drafters() -> dict[str, type[Drafter]]:
    """The drafters offered to users by name (registered_drafters without the testing ones)."""
    registered_drafters()
    return LISTED


def drafter_class(name: str) -> type[Drafter]:
    drafters = registered_drafters()
    if name not in drafters:
        raise ValueError(f"unknown drafter {name!r}; available: {', '.join(sorted(listed_drafters()))}")
    return drafters[name]


def retrieval_sources() -> list[str]:
    """The registered drafters a hybrid can take as retrieval sources."""
    return sorted(name for name, cls in registered_drafters().items() if cls.retrieval_source)


def make_drafter(name: str, target=None, **options) -> Drafter:
    """Build a registered drafter by name: `make_drafter("pld", target, max_ngram=3)`."""
    return drafter_class(name)(target=target, **options)


def drafter_option_names(cls: type[Drafter]) -> list[str]:
    """The options a drafter's constructor takes (everything but the target)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name not in ("self", "target") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def drafter_options(name: str, pairs: list[str]) -> dict:
    """KEY=VALUE strings (`--drafter-arg`, a bench method's options) -> constructor keyword
    arguments, each converted with the constructor's type annotation."""
    cls = drafter_class(name)
    hints = typing.get_type_hints(cls.__init__)
    allowed = drafter_option_names(cls)
    options = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.replace("-", "_")
        if not sep or key not in allowed:
            raise ValueError(f"--drafter-arg {pair!r}: {name} takes KEY=VALUE with KEY in {allowed}")
        try:
            options[key] = parse_option_value(raw, hints.get(key, str))
        except ValueError as error:
            kind = hints.get(key, str)
            raise ValueError(f"--drafter-arg {pair!r}: {key} of {name} must be {getattr(kind, '__name__', kind)}, "
                             f"got {raw!r} ({error})") from None
    return options


def parse_option_value(raw: str, annotation):
    """Convert one option string using its type annotation (bool, int, float, list[int], str)."""
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if bool in kinds:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got {raw!r}")
    for kind in (int, float):
        if kind in kinds:
            return kind(raw)
    if list in kinds or any(typing.get_origin(k) is list for k in kinds):
        return [int(v) for v in raw.split(",") if v]
    return raw
