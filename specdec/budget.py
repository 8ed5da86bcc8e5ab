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
    scores = estimated path-survival probabilities. 0 = plain decoding this step; after
    `probe_every` such steps one single-token draft is sent anyway so the estimates can recover.
    """

    def __init__(self, cost: CostTable, max_budget: int = 12, draft_ms_per_token: float = 0.0, probe_every: int = 8):
        if max_budget < 0:
            raise ValueError(f"max_budget must be >= 0, got {max_budget}")
        self.cost = cost
        self.limit = max_budget
        self.draft_ms_prior = draft_ms_per_token
        self.probe_every = probe_every
        self._trackers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sequence -> tracker
        self._idle_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._draft_ms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sequence -> ms per draft token
        self._last_draft_totals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _tracker(self, seq) -> AcceptanceTracker:
        return self._trackers.setdefault(seq, AcceptanceTracker())

    def _draft_ms_per_token(self, seq) -> float:
        """Running estimate of drafting cost per draft token (ms); the drafter's prior until measured."""
        measured = self._draft_ms.get(seq)
        if measured is not None:
            return measured
        return self.draft_ms_prior or seq.drafter.draft_cost_tokens() * self.cost.t(1)

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
        return allocate_batch_budget(scores, self.cost, draft_ms)

    def _single(self, seq, others: int) -> int:
        limit = self.max_budget_for(seq.drafter)
        tracker = self._tracker(seq)
        draft_ms = self._draft_ms_per_token(seq)
        if seq.drafter.makes_trees:
            chosen = choose_tree_budget(tracker.path_scores(limit), self.cost, 0.0, limit, others, draft_ms)
        else:
            chosen = choose_chain_length(tracker.probs(limit), self.cost, draft_ms, limit, others)
        if chosen == 0:
            idle = self._idle_steps.get(seq, 0) + 1
            self._idle_steps[seq] = idle
            if idle % self.probe_every == 0:
                return 1
        return chosen

    def observe(self, seq, drafted_depth: int, accepted: int) -> None:
        if drafted_depth > 0:  # an empty draft (no n-gram match, budget 0) says nothing about acceptance
            self._tracker(seq).update(drafted_depth, accepted)
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


def auto_budget_policy(target, drafter, max_budget: int = 12) -> AutoBudget:
    """The measured cost table of this target on this machine (measured once, then cached)."""
    from .cost import get_or_measure

    return AutoBudget(get_or_measure(target, ks=tuple(range(1, max_budget + 2))), max_budget)
