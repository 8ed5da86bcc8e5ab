"""`auto`: per request, the drafting method that earns the most tokens per second here, learnt online.

Arms: plain decoding (an empty draft) and every method in `methods` (default: suffix, pld, and
hybrid = suffix + pld, plus the model drafter when `model=NAME` is given). A model drafts in the
hybrid's tree, not as an arm of its own unless `methods` names it (or has no hybrid): alone, it runs
while retrieval finds nothing, its rate a little above plain's, and skips the matches retrieval finds
later (on the dev subset auto with the 0.5B draft model as an arm lost most of auto's gain); in the
hybrid, retrieval's free nodes come first and the model's slots are priced by the budget policy.
Every drafter exists once per request: the hybrid drafts from the same suffix, pld and model objects
the single-method arms are, so one suffix trie and one draft-model cache follow the request, and
each gets one begin / on_verified per step. Each step ONE arm drafts, at
most its own block of the budget the budget policy gave (how many nodes a step drafts stays the
policy's decision, budget.py; auto only picks the method).

What an arm earns is measured, not modelled: after the verify, the arm that drafted records the
tokens the step emitted (its accepted draft tokens + the bonus) and the step's wall time, from the
start of its drafting to the drafter's `on_verified` (drafting + the verify forward + commit: the
step cost on this machine, at this batch size), both as exponentially decayed sums (`decay` per
step the arm runs); its rate is tokens / ms. An arm's first step in a request is not timed, nor a
step that began by feeding more than a block of catch-up (a draft model or EAGLE head feeding the
prompt, or the rows it held while other arms ran): one-off work, which the budget policy prices.
A step whose arm drafted nothing (retrieval found no match, or the
budget policy gave it no nodes) is a plain decoding step, so it is plain's measurement too: plain
earns it as well, and needs no steps of its own to be measured where the others often draft nothing.
The choice: every arm runs `warmup` steps in turn (plain last unless `methods` lists `plain`
elsewhere, and skipped if the steps before it already measured it), then the arm with the best rate
runs, except that every `explore_every`-th step the arm measured longest ago runs once, so a method
whose fortunes change (a repetitive stretch for retrieval) is found again. Plain decoding is chosen
only over arms that pay to draft (a model drafter): an arm whose drafting is free (retrieval: suffix,
pld, REST, a hybrid of them) drafts nothing where it finds nothing, which IS a plain step, and the
budget policy sizes what it drafts by its acceptance; choosing plain over it would only skip the
matches it finds (on math answers, where few steps match, plain's rate led after a failed draft or
two and auto stopped drafting: 1.00x where pld alone made 1.06x). Plain warms up only where no arm
is free.

Across requests (the way AutoBudget's population prior learns across sequences): every timed step
also feeds the arm's population earnings (decayed by `population_decay`), one object that the
drafter and all its for_sequence() copies share, so the sequences of a batch and the server's later
requests learn from each other; separate drafter objects share nothing. A request starts each arm
from its population rate, weighted as one step (its own steps soon outweigh it), and only arms
without a population estimate warm up: a fresh drafter's first requests warm up every arm as above,
later ones go straight to the arm that earned most, and exploration still re-measures the others.
A short request thus pays no warm-up it cannot earn back.

Exactness: each step's draft is one arm's own draft through the one verification, and which arm
drafts depends only on earlier steps' measurements (this request's, and the population's as the
request began), never on this step's tokens (non-anticipation, budget.py), so greedy equals
plain and sampling keeps the target's distribution. Wall-time measurements make the choices differ
from run to run, so a seeded sampled run need not repeat token for token (its distribution is
always exactly the target's).

What it chose: each node is credited (Draft.sources) to its arm, or "hybrid:SOURCE" for the hybrid's
nodes, so `--stats` and bench results show accepted / drafted per method; steps that drafted
nothing are plain steps.
"""

from __future__ import annotations

import copy
import math
import re
import time
from dataclasses import dataclass, field

from ..checks import check_int
from ..draft import Draft
from .base import DraftContext, DraftCost, Drafter, drafter_class, register_drafter
from .hybrid import DEFAULT_SOURCES, HybridDrafter, sub_drafter_options

PLAIN = "plain"


def _check_decay(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


@dataclass
class Earnings:
    """Decayed sums over an arm's timed steps: tokens emitted, wall ms, and the steps' weight."""

    tokens: float = 0.0
    ms: float = 0.0
    steps: float = 0.0

    def add(self, tokens: int, ms: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.ms = decay * self.ms + ms
        self.steps = decay * self.steps + 1.0

    def rate(self) -> float:
        """Tokens per ms; unmeasured earnings rank first (the arm must be tried)."""
        return self.tokens / self.ms if self.ms > 0 else math.inf

    def one_step(self) -> Earnings:
        """The same rate, weighted as one step (a new sequence's start, which its own steps outweigh soon)."""
        return Earnings(self.tokens / self.steps, self.ms / self.steps, 1.0) if self.steps else Earnings()


def drafts_free(drafter: Drafter) -> bool:
    """Whether `drafter` drafts at no cost beyond the verify (retrieval, or a hybrid of retrieval alone)."""
    return drafter.retrieval_source or (isinstance(drafter, HybridDrafter) and drafter.model is None)


@dataclass
class ArmRecord:
    """One method's measured earnings in this request, beside the population's: the decayed
    earnings of every sequence's steps, one object shared by all for_sequence() copies."""

    name: str
    drafter: Drafter | None  # None: plain decoding
    population: Earnings = field(default_factory=Earnings)  # shared: every sequence this drafter served
    earned: Earnings = field(default_factory=Earnings)  # this request's (begin() starts it from the population's)
    runs: int = 0  # steps it ran in this request (its first is not timed)
    last_run: int = -1  # the step it last ran

    def rate(self) -> float:
        return self.earned.rate()

    @property
    def free(self) -> bool:
        """Whether this arm drafts at no cost beyond the verify (drafts_free); plain drafts nothing."""
        return self.drafter is not None and drafts_free(self.drafter)


@register_drafter
class AutoDrafter(Drafter):
    """Picks, step by step, the drafting method (or plain decoding) that earns the most tokens per
    second in this request, from the measured step times and accepted tokens (module docstring).

    Options:
        methods: drafters to choose among, separated by `,` or `+` (hybrid = suffix + pld + the
            model), in warm-up order; plain decoding is always an arm (last unless listed).
        model: a model drafter (small-model, eagle3, dspark, ...) for the hybrid (an arm of its own
            where `methods` names it or has no hybrid); model_options: its options (KEY=VALUE,... or a dict).
        warmup: steps each arm without a population estimate runs in turn at the start.
            explore_every: every this many steps the arm measured longest ago runs once.
            decay: weight of an arm's older steps per step it runs in the request;
            population_decay: the same across every request this drafter (and its copies) served.
    """

    name = "auto"
    composite = True
    cost = DraftCost(block=8, trees=True)

    def __init__(self, target=None, methods: str = "suffix,pld,hybrid", model: str = "",
                 model_options: str | dict | None = None, warmup: int = 2, explore_every: int = 16, decay: float = 0.9,
                 population_decay: float = 0.99):
        names = [name.strip() for name in re.split("[,+]", methods) if name.strip()] if isinstance(methods, str) else []
        if not names or len(set(names)) != len(names) or "auto" in names or names == [PLAIN]:
            raise ValueError(f"methods must be distinct drafter names (not auto), got {methods!r}")
        names = names if PLAIN in names else [*names, PLAIN]  # plain decoding is always an arm (last by default)
        if model_options and not model:
            raise ValueError("model_options given without a model")
        self.warmup = check_int("warmup", warmup, 1, 1000)
        self.explore_every = check_int("explore_every", explore_every, 2, 100_000)
        self.decay = _check_decay("decay", decay)
        self.population_decay = _check_decay("population_decay", population_decay)
        # every drafter is built once: the hybrid arm drafts from the very objects the single-method
        # arms are (one suffix trie, one draft-model cache per request), and drives their lifecycle
        built: dict[str, Drafter] = {}
        if model:
            built[model] = drafter_class(model)(target=target, **sub_drafter_options(model, model_options))
        for name in names:
            if name not in (PLAIN, "hybrid", model):
                built[name] = drafter_class(name)(target=target)
        if "hybrid" in names:
            sources = [built.get(name) or drafter_class(name)(target=target) for name in DEFAULT_SOURCES]
            built["hybrid"] = HybridDrafter(target, sources=sources, model=built.get(model, ""))
        self.arms = [ArmRecord(name, built.get(name)) for name in names]
        if model and model not in names and "hybrid" not in names:  # else it drafts in the hybrid's tree (docstring)
            self.arms.append(ArmRecord(model, built[model]))
        parts = [arm.drafter for arm in self.arms if arm.drafter is not None]
        self.hidden_layers = tuple(sorted({layer for drafter in parts for layer in drafter.hidden_layers}))
        self.wants_node_logits = any(drafter.wants_node_logits for drafter in parts)
        self.cost = DraftCost(block=max(drafter.cost.block for drafter in parts),
                              per_token=min(drafter.cost.per_token for drafter in parts), trees=True)
        self._reset()

    def _reset(self) -> None:
        self.step = 0
        # the arms that warm up: those no earlier step of this drafter measured
        self.warming = [arm for arm in self.arms if not arm.population.steps]
        # the arm drafting this step, its start (perf_counter s), whether it drafted any node, whether the step is timed
        self.running: tuple[ArmRecord, float, bool, bool] | None = None

    @property
    def plain(self) -> ArmRecord:
        """The arm that drafts nothing (plain decoding)."""
        return next(arm for arm in self.arms if arm.drafter is None)

    def parts(self) -> list[Drafter]:
        """The arms' drafters no other arm's drafter is built of: the ones this drafter drives."""
        drafters = [arm.drafter for arm in self.arms if arm.drafter is not None]
        inner = {id(part) for drafter in drafters for part in drafter.parts()}
        return [drafter for drafter in drafters if id(drafter) not in inner]

    def for_sequence(self) -> AutoDrafter:
        fresh = copy.copy(self)
        copies: dict[int, Drafter] = {}  # id(this drafter's part) -> the sequence's copy of it
        for root in self.parts():
            copies[id(root)] = copied = root.for_sequence()
            copies.update((id(part), part_copy) for part, part_copy in zip(root.parts(), copied.parts()))
        # the population is shared, the request's earnings are its own
        fresh.arms = [ArmRecord(arm.name, None if arm.drafter is None else copies[id(arm.drafter)], arm.population)
                      for arm in self.arms]
        fresh._reset()
        return fresh

    def begin(self, prompt_ids: list[int], target) -> None:
        self._reset()
        for arm in self.arms:
            arm.earned = arm.population.one_step()
            arm.runs, arm.last_run = 0, -1
        for drafter in self.parts():
            drafter.begin(prompt_ids, target)

    def choose(self) -> ArmRecord:
        """This step's arm, from earlier steps' measurements only."""
        return self._choice()[0]

    def _choice(self) -> tuple[ArmRecord, bool]:
        """(this step's arm, whether it runs as the best arm). An arm warming up or explored runs for
        a step or two, and then the best arm again."""
        free = [arm for arm in self.arms if arm.free]
        if self.step < self.warmup * len(self.warming):
            arm = self.warming[self.step // self.warmup]
            if arm.drafter is not None or not (arm.earned.steps or free):  # plain: only where no arm is free
                return arm, False
        if self.step % self.explore_every == 0 and self.step:  # step 0 without warm-up: the best, as the population found
            return min(self.arms, key=lambda arm: arm.last_run), False
        best = max(self.arms, key=lambda arm: arm.rate())
        return (max(free, key=lambda arm: arm.rate()) if best.drafter is None and free else best), True

    def offered_paths(self, ctx: DraftContext, limit: int, paid: bool = True) -> list[tuple[float, float]] | None:
        """The offer of the arm this step will run (choose() reads earlier steps only); None for an arm
        that offers none (the policy plans it by its record). An arm that runs while warming up or
        explored offers its free nodes only: the budget policy repays a paid part's catch-up (a
        hybrid's draft model reading the prompt) over the tokens still to come, but this arm drafts
        one step and the best arm the next (on the dev subset's math question an explored hybrid fed
        the 0.5B draft model the prompt, ~9 target steps, for one drafted node)."""
        arm, best = self._choice()
        drafter = arm.drafter
        return None if drafter is None else drafter.offered_paths(ctx, min(limit, drafter.cost.block), paid and best)

    def _current(self) -> ArmRecord:
        """The arm of the step in flight (drafted, not yet verified), else the one the next step will run."""
        return self.running[0] if self.running is not None else self.choose()

    def catch_up_tokens(self, ctx: DraftContext) -> int:
        """The catch-up of the arm this step runs (a model arm's rows held while others ran)."""
        drafter = self._current().drafter
        return 0 if drafter is None else drafter.catch_up_tokens(ctx)

    def catch_up_price(self) -> float:
        """The price of that arm's catch-up tokens (its own `cost.per_token`, not the cheapest arm's)."""
        drafter = self._current().drafter
        return 0.0 if drafter is None else drafter.catch_up_price()

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        start = time.perf_counter()
        arm = self.choose()
        self.running = (arm, start, False, arm.runs > 0)
        arm.last_run, self.step = self.step, self.step + 1
        if arm.drafter is None or budget <= 0:
            return Draft.empty()
        pending = arm.drafter.catch_up_tokens(ctx)
        draft = arm.drafter.propose(ctx, min(budget, arm.drafter.cost.block))
        one_off = pending - arm.drafter.catch_up_tokens(ctx) > arm.drafter.cost.block + 1  # fed a catch-up
        self.running = (arm, start, len(draft) > 0, arm.runs > 0 and not one_off)
        if draft.sources is not None:
            credited = tuple(f"{arm.name}:{source}" for source in draft.sources)
        else:
            credited = (arm.name,) * len(draft)
        return Draft(draft.tokens, draft.parents, draft.draft_probs, draft.confidences, credited)

    def on_verified(self, result, ctx: DraftContext) -> None:
        if self.running is not None:
            arm, start, drafted, timed = self.running
            self.running = None
            if timed:
                ms = 1000.0 * (time.perf_counter() - start)
                # an empty draft was a plain decoding step: plain's measurement as well as the arm's
                for earner in (arm,) if drafted or arm.drafter is None else (arm, self.plain):
                    earner.earned.add(len(result.tokens), ms, self.decay)
                    earner.population.add(len(result.tokens), ms, self.population_decay)
            arm.runs += 1
        for drafter in self.parts():
            drafter.on_verified(result, ctx)

    def on_finished(self, result, ctx: DraftContext) -> None:
        for drafter in self.parts():
            drafter.on_finished(result, ctx)

    def chosen(self) -> dict[str, int]:
        """Steps each arm ran in this request."""
        return {arm.name: arm.runs for arm in self.arms}
