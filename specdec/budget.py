"""How many draft nodes each sequence gets per step: a fixed gamma, or the cost model's choice.

A policy has `budget(seq, num_active) -> int`, `observe(seq, drafted_depth, accepted)` and
`max_budget(seq) -> int` (sizes the KV cache). Non-anticipation (DESIGN.md): a budget is a
function of what was known before drafting — running acceptance estimates, measured costs,
how many sequences share the forward — never of the tokens about to be drafted.
"""

from __future__ import annotations

from .cost import AcceptanceTracker, CostTable, choose_chain_length, choose_tree_budget


class FixedBudget:
    """Draft exactly `gamma` nodes per step (the drafter's default when gamma is None)."""

    def __init__(self, gamma: int | None = None):
        if gamma is not None and gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        self.gamma = gamma

    def budget(self, seq, num_active: int) -> int:
        return seq.drafter.default_budget if self.gamma is None else self.gamma

    def max_budget(self, seq) -> int:
        return self.budget(seq, 1) if seq.drafter is not None else 0

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
        self._trackers: dict[int, AcceptanceTracker] = {}
        self._idle_steps: dict[int, int] = {}

    def _tracker(self, seq) -> AcceptanceTracker:
        return self._trackers.setdefault(id(seq), AcceptanceTracker())

    def _draft_ms_per_token(self, seq) -> float:
        # measured so far for this sequence, else the drafter's prior (in target-step units)
        if seq.stats.drafted_tokens >= 8:
            return 1000.0 * seq.stats.time_draft_s / seq.stats.drafted_tokens
        return self.draft_ms_prior or seq.drafter.draft_cost_tokens() * self.cost.t(1)

    def max_budget(self, seq) -> int:
        return self.limit if seq.drafter is not None else 0

    def budget(self, seq, num_active: int) -> int:
        if seq.drafter is None:
            return 0
        limit = min(self.limit, max(1, 2 * seq.drafter.default_budget))
        tracker, others = self._tracker(seq), num_active - 1
        draft_ms = self._draft_ms_per_token(seq)
        if seq.drafter.makes_trees:
            chosen = choose_tree_budget(tracker.path_scores(limit), self.cost, 0.0, limit, others, draft_ms)
        else:
            chosen = choose_chain_length(tracker.probs(limit), self.cost, draft_ms, limit, others)
        if chosen == 0:
            idle = self._idle_steps.get(id(seq), 0) + 1
            self._idle_steps[id(seq)] = idle
            if idle % self.probe_every == 0:
                return 1
        return chosen

    def observe(self, seq, drafted_depth: int, accepted: int) -> None:
        if drafted_depth > 0:  # an empty draft (no n-gram match, budget 0) says nothing about acceptance
            self._tracker(seq).update(drafted_depth, accepted)


def auto_budget_policy(target, drafter, max_budget: int = 12) -> AutoBudget:
    """The measured cost table of this target on this machine (measured once, then cached)."""
    from .cost import get_or_measure

    return AutoBudget(get_or_measure(target, ks=tuple(range(1, max_budget + 2))), max_budget)
