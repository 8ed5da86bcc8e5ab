"""How many draft nodes each sequence gets per step: a fixed gamma, or the cost model's choice.

A policy has `plan(seqs) -> list[int]` (one budget per running sequence, decided together so
budgets can shrink as the batch grows), `observe(seq, drafted_depth, accepted)` and
`max_budget_for(drafter) -> int` (sizes the KV cache). Non-anticipation (DESIGN.md): a budget is a
function of what was known before drafting — running acceptance estimates, measured costs,
how many sequences share the forward — never of the tokens about to be drafted.
"""

from __future__ import annotations

import weakref

from .cost import AcceptanceTracker, CostTable, allocate_batch_budget, choose_chain_length, choose_tree_budget


# the cost table also times one prefill-sized forward, so one-off catch-up costs (a draft
# model prefilling a long prompt) are interpolated, not extrapolated from the k <= 13 points
PREFILL_PROBE_TOKENS = 256


class FixedBudget:
    """Draft exactly `gamma` nodes per step (the drafter's default when gamma is None)."""

    def __init__(self, gamma: int | None = None):
        if gamma is not None and gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        self.gamma = gamma

    def plan(self, seqs) -> list[int]:
        return [self.max_budget_for(seq.drafter) for seq in seqs]

    def max_budget_for(self, drafter) -> int:
        if drafter is None:
            return 0
        return drafter.default_budget if self.gamma is None else self.gamma

    def observe(self, seq, drafted_depth: int, accepted: int) -> None:
        pass


class AutoBudget:
    """Pick each step's budget to maximise expected tokens per second (specdec.cost).

    Chain drafters: E[tau](g) / (g * draft_ms + T(others + g + 1)) over g = 0..max_budget with
    the sequence's running per-depth acceptance estimates. Tree drafters: the same with node
    scores = estimated path-survival probabilities. 0 = plain decoding this step.

    Three things keep a drafter that does not pay from costing much:
    - one-off costs: a drafter with its own model must first feed the committed tokens it has
      not seen (`catch_up_tokens`, e.g. a draft model prefilling a long prompt). Drafting starts
      only when that cost is below the expected saving over `payback_fraction` of the tokens
      still allowed (max_new_tokens is an upper bound: answers often stop early);
    - probes: after `probe_every` plain steps one single-token draft is sent so estimates can
      recover; each probe that is not followed by drafting doubles the interval (up to
      `max_probe_every`), and no probe is sent when its catch-up would cost more than a step;
    - a population prior: every sequence's outcomes feed one slow tracker whose depth-1
      estimate is the prior of new sequences, so a drafter that failed on earlier requests
      under this policy (a server's lifetime, a bench method) starts cautious.
    """

    def __init__(self, cost: CostTable, max_budget: int = 12, draft_ms_per_token: float = 0.0, probe_every: int = 8,
                 max_probe_every: int = 64, payback_fraction: float = 0.5):
        if max_budget < 0:
            raise ValueError(f"max_budget must be >= 0, got {max_budget}")
        if not 1 <= probe_every <= max_probe_every:
            raise ValueError(f"need 1 <= probe_every <= max_probe_every, got {probe_every}, {max_probe_every}")
        if not 0.0 < payback_fraction <= 1.0:
            raise ValueError(f"payback_fraction must be in (0, 1], got {payback_fraction}")
        self.cost = cost
        self.limit = max_budget
        self.payback_fraction = payback_fraction
        self.draft_ms_prior = draft_ms_per_token
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.population = AcceptanceTracker(decay=0.99)  # outcomes of every sequence this policy served
        self._trackers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sequence -> tracker
        self._idle_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._probe_interval: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._draft_ms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sequence -> ms per draft token
        self._last_draft_totals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _tracker(self, seq) -> AcceptanceTracker:
        tracker = self._trackers.get(seq)
        if tracker is None:
            tracker = AcceptanceTracker(prior=self.population.probs(1)[0])
            self._trackers[seq] = tracker
        return tracker

    def _draft_ms_per_token(self, seq) -> float:
        """Running estimate of drafting cost per draft token (ms); the drafter's prior until measured."""
        measured = self._draft_ms.get(seq)
        if measured is not None:
            return measured
        return self.draft_ms_prior or seq.drafter.draft_cost_tokens() * self.cost.t(1)

    def catch_up_ms(self, seq) -> float:
        """One-off cost (ms) of the drafter feeding committed tokens it has not seen yet; the root
        token alone is part of the per-token draft cost."""
        pending = seq.drafter.catch_up_tokens(seq.ctx)
        if pending <= 1:
            return 0.0
        return seq.drafter.draft_cost_tokens() * self.cost.t(pending)

    def pays_back(self, seq, budget: int, others: int) -> bool:
        """Whether drafting `budget` nodes now, catch-up included, is expected to save time within
        `payback_fraction` of the tokens left to max_new_tokens (answers often end early at EOS:
        a Spec-Bench RAG answer stopped at 18 of 64 tokens, after a 741-token draft prefill)."""
        one_off_ms = self.catch_up_ms(seq)
        if one_off_ms == 0.0:
            return True
        scores = self._tracker(seq).path_scores(budget)
        spec_ms_per_token = (budget * self._draft_ms_per_token(seq) + self.cost.t(others + budget + 1)) / (1 + sum(scores))
        plain_ms_per_token = self.cost.t(others + 1)
        remaining = self.payback_fraction * (seq.max_new_tokens - seq.generated)
        return one_off_ms < remaining * (plain_ms_per_token - spec_ms_per_token)

    def max_budget_for(self, drafter) -> int:
        return 0 if drafter is None else min(self.limit, max(1, 2 * drafter.default_budget))

    def plan(self, seqs) -> list[int]:
        drafting = [seq for seq in seqs if seq.drafter is not None]
        if len(drafting) <= 1:
            return [self._single(seq, len(seqs) - 1) if seq.drafter is not None else 0 for seq in seqs]
        # several sequences share the forward: admit draft positions across all of them in order
        # of expected survival while expected tokens per second still rises (load-aware)
        scores = [self._tracker(seq).path_scores(self.max_budget_for(seq.drafter)) if seq.drafter else [] for seq in seqs]
        draft_ms = max(self._draft_ms_per_token(seq) for seq in drafting)
        budgets = allocate_batch_budget(scores, self.cost, draft_ms)
        total = len(seqs) + sum(budgets)
        return [
            budget if budget == 0 or self.pays_back(seq, budget, total - budget - 1) else 0
            for seq, budget in zip(seqs, budgets)
        ]

    def _single(self, seq, others: int) -> int:
        limit = self.max_budget_for(seq.drafter)
        tracker = self._tracker(seq)
        draft_ms = self._draft_ms_per_token(seq)
        if seq.drafter.makes_trees:
            chosen = choose_tree_budget(tracker.path_scores(limit), self.cost, 0.0, limit, others, draft_ms)
        else:
            chosen = choose_chain_length(tracker.probs(limit), self.cost, draft_ms, limit, others)
        if chosen > 0 and self.pays_back(seq, chosen, others):
            self._probe_interval[seq] = self.probe_every  # drafting pays: probe often if it stops paying
            self._idle_steps[seq] = 0
            return chosen
        idle = self._idle_steps.get(seq, 0) + 1
        interval = self._probe_interval.get(seq, self.probe_every)
        if idle >= interval and self.catch_up_ms(seq) <= self.cost.t(1):
            self._probe_interval[seq] = min(2 * interval, self.max_probe_every)
            idle = 0
            chosen = 1
        else:
            chosen = 0
        self._idle_steps[seq] = idle
        return chosen

    def observe(self, seq, drafted_depth: int, accepted: int) -> None:
        if drafted_depth > 0:  # an empty draft (no n-gram match, budget 0) says nothing about acceptance
            self._tracker(seq).update(drafted_depth, accepted)
            self.population.update(drafted_depth, accepted)
        self._update_draft_cost(seq)

    def _update_draft_cost(self, seq) -> None:
        """EMA of draft ms per drafted token over steps. The first drafting step is skipped: it
        includes one-off work (a draft model prefilling the whole prompt) that would otherwise
        make drafting look far more expensive per token than it is."""
        time_s, drafted = seq.stats.time_draft_s, seq.stats.drafted_tokens
        last_time_s, last_drafted, steps_seen = self._last_draft_totals.get(seq, (0.0, 0, 0))
        if drafted <= last_drafted:
            return
        self._last_draft_totals[seq] = (time_s, drafted, steps_seen + 1)
        if steps_seen == 0:
            return
        step_ms = 1000.0 * (time_s - last_time_s) / (drafted - last_drafted)
        previous = self._draft_ms.get(seq)
        self._draft_ms[seq] = step_ms if previous is None else 0.7 * previous + 0.3 * step_ms


def parse_gamma(raw) -> int | str | None:
    """A gamma as given on the command line or to the API: "auto" (the cost model picks each step's
    budget), None (the drafter's default) or an integer >= 0 (int or decimal string)."""
    if raw is None or raw == "auto":
        return raw
    try:
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ValueError
        gamma = int(raw)
    except ValueError:
        raise ValueError(f"gamma must be 'auto' or an integer >= 0, got {raw!r}") from None
    if gamma < 0:
        raise ValueError(f"gamma must be 'auto' or an integer >= 0, got {raw!r}")
    return gamma


def budget_policy_for(target, drafter, gamma):
    """The policy a gamma asks for: "auto" -> the measured cost model (AutoBudget; plain decoding
    needs none); an int -> FixedBudget(gamma); None -> FixedBudget with the drafter's default."""
    gamma = parse_gamma(gamma)
    if gamma == "auto":
        return auto_budget_policy(target, drafter) if drafter is not None else FixedBudget()
    return FixedBudget(gamma)


def auto_budget_policy(target, drafter, max_budget: int = 12) -> AutoBudget:
    """The measured cost table of this target on this machine (measured once, then cached)."""
    from .cost import get_or_measure

    ks = tuple(range(1, max_budget + 2)) + (PREFILL_PROBE_TOKENS,)
    return AutoBudget(get_or_measure(target, ks=ks), max_budget)
