"""How many draft nodes each sequence gets per step, and how many of them are verified: the one
place a request's draft length is decided (a fixed gamma, or the cost model's choice).

The loop makes one call per step before its verify forward, `policy.draft(seqs, propose)`: the
policy plans every running sequence's budget together (`plan`: budgets shrink as the batch grows),
has the loop draft through `propose(seq, budget)`, and cuts drafts that carry confidences to the
prefix worth verifying (`verify_prefixes`, specdec.schedule.admit). After verification it learns
each sequence's outcome (`observe`); `max_budget_for(drafter)` sizes the KV cache when a sequence
is added. What the policy remembers of a sequence is its `PlanState`, which lives on the sequence
(`RunningSequence.plan_state`); the policy itself holds only what all sequences share (the cost
table, AutoBudget's population prior). Non-anticipation (docs/architecture.md): a budget is a
function of what was known before drafting — running acceptance estimates, measured costs,
how many sequences share the forward — never of the tokens about to be drafted.

The choosers maximise expected tokens per ms of the coming step over the measured T(k)
(specdec.cost). A draft of n nodes whose paths survive with probabilities s_1 >= s_2 >= ...
(chain depths or tree nodes alike) is worth

    one sequence:  (1 + s_1 + ... + s_n) / (n * draft_ms_per_node + T(other + n + 1))
    a batch:       (R + S_n) / (n * draft_ms + T(R + n)),  S_n = the n best scores of all R sequences
    a block drafter's sequence in a batch of R (its forward costs the same for any n > 0):
                   (R + s_1 + ... + s_n) / (draft_ms_per_block + T(R + n))  vs  R / T(R)

(the batch walks positions best first and stops at the first that does not help: the
scheduler of specdec.schedule, shared with drafters that score their own drafted positions).

For SAMPLED proposals the scores must come from pre-draft information (AcceptanceTracker, the
cost table), never from the drafted tokens or their probabilities; scores computed from the
drafter's own outputs are only allowed for deterministic proposals (top-k trees, n-gram matches).
Earlier steps' drafts are pre-draft information for this one: the tracker of a confidence drafter
learns from the confidences of blocks already verified (or cut), never of the block being planned.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from .acceptance import AcceptanceTracker, chain_path_scores
from .checks import check_int
from .cost import CostTable
from .draft import Draft
from .schedule import admit, admit_survivals, check_probabilities, survivals


# the cost table also times one prefill-sized forward, so one-off catch-up costs (a draft
# model prefilling a long prompt) are interpolated, not extrapolated from the k <= 13 points
PREFILL_PROBE_TOKENS = 256


# ----------------------------------------------------------------------------- choosing budgets


def _check_descending(name: str, values: Sequence[float]) -> list[float]:
    values = check_probabilities(name, values)
    for index in range(1, len(values)):
        if values[index] > values[index - 1]:
            raise ValueError(
                f"{name} must be sorted descending (best candidate first); "
                f"index {index} ({values[index]}) > index {index - 1} ({values[index - 1]})"
            )
    return values


def tokens_per_ms(path_scores: Sequence[float], cost: CostTable, draft_ms_per_node: float | Sequence[float],
                  other_tokens: int = 0, draft_ms_per_step: float = 0.0, whole_forward: bool = False) -> list[float]:
    """rates[n] for n = 0..len(path_scores): expected tokens per ms of a step drafting the first n
    nodes, (1 + sum_{i<n} s_i) / (draft_ms_per_step + sum_{i<n} d_i + T(other_tokens + n + 1));
    rates[0] is plain decoding, 1 / T(other_tokens + 1). `draft_ms_per_node`: d_i, one price for
    every node or one per node (a hybrid's found retrieval matches cost nothing, its model's slots
    do); `other_tokens`: tokens of the other sequences in the forward; `draft_ms_per_step`: paid by
    any n > 0 (a block drafter's forward drafts its whole block however much of it is verified).
    `whole_forward`: the other tokens are the other sequences' roots and count too (numerators +
    other_tokens): the forward's throughput, which a draft slows for every sequence in it, instead
    of this sequence's alone."""
    node_ms = [draft_ms_per_node] * len(path_scores) if isinstance(draft_ms_per_node, (int, float)) else list(draft_ms_per_node)
    if len(node_ms) < len(path_scores):
        raise ValueError(f"need a draft price per node: {len(node_ms)} prices for {len(path_scores)} nodes")
    if not all(ms >= 0 for ms in node_ms) or not draft_ms_per_step >= 0:
        raise ValueError(f"draft time must be >= 0 ms, got {draft_ms_per_node} per node, {draft_ms_per_step} per step")
    if other_tokens < 0:
        raise ValueError(f"other_tokens must be >= 0, got {other_tokens}")
    expected_tokens = 1.0 + (other_tokens if whole_forward else 0)
    rates = [expected_tokens / cost.t(other_tokens + 1)]
    draft_ms = draft_ms_per_step
    for nodes, (score, ms) in enumerate(zip(path_scores, node_ms), start=1):
        expected_tokens += score
        draft_ms += ms
        rates.append(expected_tokens / (draft_ms + cost.t(other_tokens + nodes + 1)))
    return rates


def choose_budget(
    path_scores: Sequence[float],
    cost: CostTable,
    draft_ms_per_node: float | Sequence[float],
    max_budget: int,
    other_tokens: int = 0,
    draft_ms_per_step: float = 0.0,
    whole_forward: bool = False,
) -> int:
    """Draft nodes n in 0..min(max_budget, len(path_scores)) maximising `tokens_per_ms`.

    `path_scores` (sorted descending) estimate P(the node's whole path is accepted): a chain's
    `chain_path_scores`, or a tree's node scores (keeping the n best is a valid tree when every
    child scores <= its parent). Nodes without a score are not drafted. Returns 0 (plain decoding
    this step) unless some n > 0 is strictly better; ties go to the smaller draft.
    """
    check_int("max_budget", max_budget, 0)
    rates = tokens_per_ms(_check_descending("path_scores", path_scores)[:max_budget], cost, draft_ms_per_node, other_tokens,
                          draft_ms_per_step, whole_forward)
    best = 0
    for nodes, rate in enumerate(rates):
        if rate > rates[best]:
            best = nodes
    return best


def allocate_batch_budget(per_request_scores: Sequence[Sequence[float]], cost: CostTable, draft_ms: float) -> list[int]:
    """Split draft positions across the requests of one batched verify forward, before drafting.

    Each request's scores (sorted descending; e.g. ``chain_path_scores`` or tree path
    probabilities) are the chances its next candidate positions survive. This is the scheduler's
    walk (specdec.schedule.admit_survivals: positions in order of score across all requests, each
    request keeping a prefix, stopping at the first position that does not raise throughput) with
    the step rate of B tokens in total, n = B - R of them drafted at ``draft_ms`` each:

        steps per second = 1000 / (n * draft_ms + T(B))

    Returns the number of admitted positions per request (0 = plain decoding for it).
    """
    num_requests = len(per_request_scores)
    if draft_ms < 0:
        raise ValueError(f"draft time must be >= 0 ms, got {draft_ms}")

    def steps_per_second(tokens: int) -> float:
        return 1000.0 / ((tokens - num_requests) * draft_ms + cost.t(tokens))

    return admit_survivals(per_request_scores, steps_per_second)


# ----------------------------------------------------------------------------- policies


@dataclass(eq=False)
class PlanState:
    """What the budget policy remembers of one running sequence. It lives on the sequence
    (`RunningSequence.plan_state`, made with it) and leaves the batch with it; AutoBudget reads and
    writes it, FixedBudget needs none of it."""

    tracker: AcceptanceTracker | None = None  # per-depth estimates; made at first use, from the population prior
    idle_steps: int = 0  # plain steps since the last draft or probe
    probe_interval: int | None = None  # plain steps before a probe; None until the policy first plans this sequence
    draft_ms_per_token: float | None = None  # measured drafting cost (running average); None: not measured yet
    draft_totals: tuple[float, int, int] = (0.0, 0, 0)  # (draft s, drafted tokens, drafting steps) at the last measurement
    block: list[float] | None = None  # this step's block confidences, when the scheduler cut it (observe learns from them)
    cut_tokens: int = 0  # drafted, then cut off by the scheduler before verification (all steps so far)
    catch_up_tokens: int = 0  # committed tokens the drafter had not seen when this step's budget was planned
    # share of this sequence's steps whose offer (Drafter.offered_paths) is best with paid nodes in it
    # (running average); None until the policy first plans an offer
    paid_share: float | None = None


class BudgetPolicy(ABC):
    """How many draft nodes each sequence gets, and how many of them are verified. The loop makes
    one call per step before the verify forward, `draft(seqs, propose)`, and tells the policy each
    sequence's outcome after verification, `observe(seq, drafted_depth, accepted)`.
    `max_budget_for(drafter)` (the largest block a step may draft) sizes the KV cache when a
    sequence is added."""

    def draft(self, seqs, propose) -> list[Draft]:
        """This step's draft for every running sequence: `plan` the budgets (from what is known
        before drafting: never from the tokens about to be drafted), draft each through the loop's
        `propose(seq, budget) -> Draft` (at most `budget` nodes; 0: Draft.empty()), then cut the
        drafts that carry confidences to the prefixes worth verifying (`verify_prefixes`)."""
        budgets = self.plan(seqs)
        # never draft past max_new_tokens: the bonus token already fills the last slot
        drafts = [propose(seq, min(budget, seq.max_new_tokens - seq.generated - 1)) for seq, budget in zip(seqs, budgets)]
        return self.verify_prefixes(seqs, drafts)

    @abstractmethod
    def plan(self, seqs) -> list[int]:
        """One budget per running sequence, decided together (budgets can shrink as the batch grows)."""

    @abstractmethod
    def max_budget_for(self, drafter) -> int:
        """The most nodes this policy lets `drafter` draft in a step (0 for no drafter)."""

    def verify_prefixes(self, seqs, drafts: list[Draft]) -> list[Draft]:
        """The part of each draft to verify; by default all of it."""
        return drafts

    def observe(self, seq, drafted_depth: int, accepted: int) -> None:
        """One sequence's verification: `accepted` of its `drafted_depth` draft depths were kept."""


class FixedBudget(BudgetPolicy):
    """Draft exactly `gamma` nodes per step (the drafter's default when gamma is None), verified whole."""

    def __init__(self, gamma: int | None = None):
        self.gamma = None if gamma is None else check_int("gamma", gamma, 0)

    def plan(self, seqs) -> list[int]:
        return [self.max_budget_for(seq.drafter) for seq in seqs]

    def max_budget_for(self, drafter) -> int:
        if drafter is None:
            return 0
        return drafter.cost.block if self.gamma is None else self.gamma


class AutoBudget(BudgetPolicy):
    """Pick each step's budget to maximise expected tokens per second (choose_budget over specdec.cost's T(k)).

    `choose_budget` over the sequence's running path-survival estimates (per depth; a tree's
    nodes are scored by the same estimates). 0 = plain decoding this step.

    Three things keep a drafter that does not pay from costing much:
    - one-off costs: a drafter with its own model must first feed the committed tokens it has
      not seen (`catch_up_tokens`, e.g. a draft model prefilling a long prompt). Drafting starts
      only when that cost is below the expected saving over `payback_fraction` of the tokens
      still allowed (max_new_tokens is an upper bound: answers often stop early). It is priced at
      the drafter's prior until a catch-up has been timed, then at the measured price;
    - probes: after `probe_every` plain steps one single-token draft is sent so estimates can
      recover; each probe that is not followed by drafting doubles the interval (up to
      `max_probe_every`), and no probe is sent while its catch-up would cost more than one step
      per `probe_every` idle steps (the catch-up of a drafter that is not fed while idle grows with
      them; a fixed limit would never probe it again);
    - a population prior: every sequence's outcomes feed one slow tracker whose depth-1
      estimate is the prior of new sequences, so a drafter that failed on earlier requests
      under this policy (a server's lifetime, a bench method) starts cautious; likewise a new
      sequence starts at the probe interval the latest probe left (back to `probe_every` as soon as
      any sequence's drafting pays), so such a drafter is not probed afresh by every request.

    A drafter that scores its own positions (`cost.scored`, Draft.confidences) drafts its
    full block whenever drafting is expected to pay at all (the estimates, probes and catch-up rule
    above, with the block's forward priced per step: it costs the same however much of the block is
    verified), and `verify_prefixes` cuts every running sequence's chain to the prefix worth
    verifying (specdec.schedule.admit, one call across the batch). Its estimates learn from every
    drafted position: verified ones by their outcome, the rest (cut off by the scheduler, or past an
    accepted prefix) by their calibrated confidences, so a block the scheduler cuts to nothing still
    says that drafting did not pay. `use_confidences=False` plans such a drafter like any other.

    `draft_ms_per_token`: a fixed drafting cost per draft token (ms); None (default) measures it
    per sequence, starting from the drafter's `cost.per_token` prior.
    """

    def __init__(self, cost: CostTable, max_budget: int = 12, draft_ms_per_token: float | None = None, probe_every: int = 8,
                 max_probe_every: int = 64, payback_fraction: float = 0.5, use_confidences: bool = True):
        check_int("max_budget", max_budget, 0)
        if not 1 <= probe_every <= max_probe_every:
            raise ValueError(f"need 1 <= probe_every <= max_probe_every, got {probe_every}, {max_probe_every}")
        if not 0.0 < payback_fraction <= 1.0:
            raise ValueError(f"payback_fraction must be in (0, 1], got {payback_fraction}")
        self.cost = cost
        self.limit = max_budget
        self.use_confidences = use_confidences
        self.payback_fraction = payback_fraction
        if draft_ms_per_token is not None and draft_ms_per_token < 0:
            raise ValueError(f"draft_ms_per_token must be >= 0 ms, got {draft_ms_per_token}")
        self.draft_ms_fixed = draft_ms_per_token
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.population = AcceptanceTracker(decay=0.99)  # outcomes of every sequence this policy served
        self.population_probe_every = probe_every  # the probe interval a new sequence starts at
        # a catch-up token's measured price in target steps of a forward that size (running average
        # over every sequence's catch-ups); None: the drafter's prior `catch_up_price()`
        self.measured_catch_up_price: float | None = None
        self.population_paid_share = 1.0  # the paid share a new sequence starts from (every sequence's steps)

    def _tracker(self, seq) -> AcceptanceTracker:
        """The sequence's acceptance estimates; a new sequence starts from the population's."""
        state = seq.plan_state
        if state.tracker is None:
            state.tracker = AcceptanceTracker(prior=self.population.probs(1)[0])
        return state.tracker

    def _draft_ms_per_token(self, seq) -> float:
        """Drafting cost per draft token (ms): `draft_ms_per_token` when given, else the running
        measurement (the drafter's own prior until there is one)."""
        if self.draft_ms_fixed is not None:
            return self.draft_ms_fixed
        measured = seq.plan_state.draft_ms_per_token
        if measured is not None:
            return measured
        return seq.drafter.cost.per_token * self.cost.t(1)

    def catch_up_ms(self, seq) -> float:
        """One-off cost (ms) of the drafter feeding committed tokens it has not seen yet; the root
        token alone is part of the per-token draft cost."""
        pending = seq.drafter.catch_up_tokens(seq.ctx)
        if pending <= 1:
            return 0.0
        price = self.measured_catch_up_price
        return (seq.drafter.catch_up_price() if price is None else price) * self.cost.t(pending)

    def pays_back(self, seq, budget: int, others: int) -> bool:
        """Whether drafting `budget` nodes now, catch-up included, is expected to save time within
        `payback_fraction` of the tokens left to max_new_tokens (answers often end early at EOS,
        see docs/results.md)."""
        if self.catch_up_ms(seq) == 0.0:
            return True
        per_node, per_step = self._draft_prices(seq)
        rates = tokens_per_ms(self._tracker(seq).path_scores(budget), self.cost, per_node, others, per_step)
        return self._repays_catch_up(seq, rates[0], rates[budget])

    def _repays_catch_up(self, seq, rate_instead: float, rate_drafting: float, share: float = 1.0) -> bool:
        """Whether steps at `rate_drafting` (this sequence's tokens per ms) rather than `rate_instead`
        save more than the catch-up costs within `payback_fraction` of the tokens left, when `share` of
        the steps to come draft that way (the rest gain nothing from it)."""
        remaining = self.payback_fraction * (seq.max_new_tokens - seq.generated)
        return self.catch_up_ms(seq) < share * remaining * (1.0 / rate_instead - 1.0 / rate_drafting)  # ms saved per token

    def schedules(self, drafter) -> bool:
        """Whether this drafter's blocks are cut after drafting by their own confidences."""
        return self.use_confidences and drafter is not None and drafter.cost.scored

    def max_budget_for(self, drafter) -> int:
        if self.schedules(drafter):
            return drafter.cost.block  # its full block; verify_prefixes decides how much is verified
        return 0 if drafter is None else min(self.limit, max(1, 2 * drafter.cost.block))

    def verify_prefixes(self, seqs, drafts: list[Draft]) -> list[Draft]:
        """Cut each scheduled chain to the prefix `schedule.admit` admits, all sequences at once,
        at the measured rate 1000 / T(B) of a verify forward over B tokens in total. Drafting is
        done by now (its time is the same whatever B), so only the verify forward is priced.
        Drafts without confidences (trees, empty drafts, other drafters) are verified whole."""
        scheduled = [row for row, (seq, draft) in enumerate(zip(seqs, drafts))
                     if self.schedules(seq.drafter) and draft.confidences is not None and draft.is_chain and len(draft)]
        if not scheduled:
            return drafts
        fixed_tokens = sum(1 + len(draft) for row, draft in enumerate(drafts) if row not in scheduled)
        confidences = [drafts[row].confidences.tolist() for row in scheduled]
        admitted = admit(confidences, lambda tokens: 1000.0 / self.cost.t(tokens + fixed_tokens))
        drafts = list(drafts)
        for row, length, block in zip(scheduled, admitted, confidences):
            state = seqs[row].plan_state
            state.block = block  # observe() learns from the positions cut off too
            state.cut_tokens += len(block) - length
            drafts[row] = drafts[row].prefix(length)
        return drafts

    def plan(self, seqs) -> list[int]:
        budgets = self._plan(seqs)
        for seq, budget in zip(seqs, budgets):
            if budget:  # what this step's draft time will include besides drafting (_update_draft_cost)
                seq.plan_state.catch_up_tokens = seq.drafter.catch_up_tokens(seq.ctx)
        return budgets

    def _plan(self, seqs) -> list[int]:
        if any(self.schedules(seq.drafter) for seq in seqs):
            others = len(seqs) - 1
            return [self._block(seq, others) if self.schedules(seq.drafter) else self.max_budget_for(seq.drafter)
                    for seq in seqs]
        limits = [self.max_budget_for(seq.drafter) for seq in seqs]
        for seq in seqs:  # what a drafter timing its own work prices it against (DraftContext.step_ms)
            seq.ctx.step_ms = self.cost.t(1)
        offers = [None if seq.drafter is None else seq.drafter.offered_paths(seq.ctx, limit)
                  for seq, limit in zip(seqs, limits)]
        if sum(seq.drafter is not None for seq in seqs) <= 1:
            return [0 if seq.drafter is None else self._single(seq, len(seqs) - 1) if offer is None
                    else self._offered(seq, offer, limit, len(seqs) - 1) for seq, offer, limit in zip(seqs, offers, limits)]
        # several sequences share the forward: admit draft positions across all of them in order
        # of expected survival while expected tokens per second still rises (load-aware); the
        # sequences whose drafter offers its nodes (priced one by one) are planned after them
        scores = [self._tracker(seq).path_scores(limit) if seq.drafter is not None and offer is None else []
                  for seq, limit, offer in zip(seqs, limits, offers)]
        drafting = [seq for seq, offer in zip(seqs, offers) if seq.drafter is not None and offer is None]
        draft_ms = max((self._draft_ms_per_token(seq) for seq in drafting), default=0.0)
        budgets = allocate_batch_budget(scores, self.cost, draft_ms)
        total = len(seqs) + sum(budgets)
        budgets = [budget if budget == 0 or self.pays_back(seq, budget, total - budget - 1) else 0
                   for seq, budget in zip(seqs, budgets)]
        total = len(seqs) + sum(budgets)
        for row, offer in enumerate(offers):
            if offer is not None:
                budgets[row] = self._offered(seqs[row], offer, limits[row], total - 1)
                total += budgets[row]
        return budgets

    def _offered(self, seq, offer: list[tuple[float, float]], limit: int, others: int) -> int:
        """How much of a drafter's offer (Drafter.offered_paths: its nodes best first, with their
        drafting prices in target steps) to draft: the prefix that earns the most tokens per ms of
        the forward, every node priced at its drafting and its share of the verify. A prefix with
        paid nodes also runs the paid part's catch-up (a hybrid's model feeding the prompt): when
        that does not repay against the free nodes alone, the drafter is asked for those instead."""
        chosen, rate = self._best_prefix(offer, others)
        paid = any(price > 0 for _, price in offer[:chosen])
        share = self._paid_share(seq, paid)
        if not paid or self.catch_up_ms(seq) == 0.0:
            return chosen
        instead, rate_instead = self._best_prefix(seq.drafter.offered_paths(seq.ctx, limit, paid=False), others)
        if self._repays_catch_up(seq, rate_instead, rate, share):
            seq.drafter.offered_paths(seq.ctx, limit)  # the paid offer again: the proposal holds its prefix
            return chosen
        return instead

    def _paid_share(self, seq, paid: bool) -> float:
        """The share of steps whose best prefix holds paid nodes, this step's included (a running
        average per sequence, from the population's; the population's over every sequence's steps).
        A catch-up pays back only on such steps: a hybrid's model slots enter where retrieval offers
        little, which beside a source that nearly always offers a node (bigram) is a few steps in a
        request; priced as if every step used them, the 0.5B draft model read each prompt for 2-4
        nodes (docs/architecture.md)."""
        state = seq.plan_state
        previous = self.population_paid_share if state.paid_share is None else state.paid_share
        state.paid_share = 0.8 * previous + 0.2 * paid
        self.population_paid_share = 0.95 * self.population_paid_share + 0.05 * paid
        return state.paid_share

    def _best_prefix(self, offer: list[tuple[float, float]], others: int) -> tuple[int, float]:
        """(nodes, this sequence's tokens per ms) of the offer's prefix that earns the most tokens
        per ms of the forward (`choose_budget`, whole_forward), every node priced at its drafting."""
        scores = [score for score, _ in offer]
        node_ms = [price * self.cost.t(1) for _, price in offer]
        chosen = choose_budget(scores, self.cost, node_ms, len(offer), others, whole_forward=True)
        return chosen, tokens_per_ms(scores[:chosen], self.cost, node_ms[:chosen], others)[chosen]

    def _block(self, seq, others: int) -> int:
        """A drafter that scores its own positions drafts its whole block (verify_prefixes then cuts
        it) when drafting is expected to pay at all, by the same estimates, probes and catch-up rule
        as any other drafter (`_single`, with the block priced per step against the throughput of
        the whole forward); otherwise nothing this step, and its drafter does no work (the target's
        rows wait for the next block). The block forward costs its time however little of the block
        is verified, so a drafter that is rarely accepted must not draft every step (the cut alone
        only saves verify time)."""
        return self.max_budget_for(seq.drafter) if self._single(seq, others) > 0 else 0

    def _draft_prices(self, seq) -> tuple[float, float]:
        """(ms per drafted node, ms per drafting step): a block drafter's forward drafts the whole
        block whatever the scheduler then verifies, so its cost is per step; other drafters pay per node."""
        per_token = self._draft_ms_per_token(seq)
        if self.schedules(seq.drafter):
            return 0.0, per_token * self.max_budget_for(seq.drafter)
        return per_token, 0.0

    def _single(self, seq, others: int) -> int:
        limit = self.max_budget_for(seq.drafter)
        tracker = self._tracker(seq)
        per_node, per_step = self._draft_prices(seq)
        # the forward's throughput: a draft slows every sequence in it (the other rows: their roots)
        chosen = choose_budget(tracker.path_scores(limit), self.cost, per_node, limit, others, per_step, whole_forward=True)
        state = seq.plan_state
        if chosen > 0 and self.pays_back(seq, chosen, others):
            # drafting pays: probe often if it stops paying (this sequence, and the ones that come next)
            state.probe_interval = self.population_probe_every = self.probe_every
            state.idle_steps = 0
            return chosen
        idle = state.idle_steps + 1
        if state.probe_interval is None:
            state.probe_interval = self.population_probe_every
        interval = state.probe_interval
        # a probe's catch-up may cost ~one step per probe_every idle steps: a model drafter is not fed
        # while idle, so its catch-up grows with every plain step, and a fixed one-step limit would
        # shut it out for the rest of the sequence after ~10 idle steps
        allowed_ms = self.cost.t(1) * max(1.0, idle / self.probe_every)
        if idle >= interval and self.catch_up_ms(seq) <= allowed_ms:
            state.probe_interval = self.population_probe_every = min(2 * interval, self.max_probe_every)
            idle = 0
            chosen = 1
        else:
            chosen = 0
        state.idle_steps = idle
        return chosen

    def observe(self, seq, drafted_depth: int, accepted: int) -> None:
        state = seq.plan_state
        block, state.block = state.block, None  # the confidences of this step's whole block, when it was cut
        if block is not None:
            # verified positions by their outcome; past an accepted prefix, the calibrated confidences
            outcome = [1.0] * accepted
            tail = [0.0] if accepted < drafted_depth else survivals(block[accepted:])
            self._tracker(seq).update_expected(outcome + tail)
            self.population.update_expected(outcome + tail)
        elif drafted_depth > 0:  # an empty draft (no n-gram match, budget 0) says nothing about acceptance
            self._tracker(seq).update(drafted_depth, accepted)
            self.population.update(drafted_depth, accepted)
        self._update_draft_cost(seq)

    def _update_draft_cost(self, seq) -> None:
        """EMA of draft ms per drafted token (verified or cut off by the scheduler) over steps. Steps
        whose draft time includes one-off work are skipped: the first (a draft model prefilling the
        whole prompt) and any that first caught up on more committed tokens than one drafting step
        commits (a probe after plain steps feeds the drafter all of them). That work is priced
        apart (catch_up_ms); folded in, it made drafting look several times dearer per token than
        it is, and a drafter whose probes succeeded was still judged not to pay."""
        state = seq.plan_state
        time_s, drafted = seq.stats.time_draft_s, seq.stats.drafted_tokens + state.cut_tokens
        last_time_s, last_drafted, steps_seen = state.draft_totals
        if drafted <= last_drafted:
            return
        state.draft_totals = (time_s, drafted, steps_seen + 1)
        if state.catch_up_tokens > self.max_budget_for(seq.drafter) + 1:
            if seq.drafter.catch_up_tokens(seq.ctx) < state.catch_up_tokens:  # fed it (a hybrid may draft its free nodes alone)
                self._measure_catch_up(seq, 1000.0 * (time_s - last_time_s), drafted - last_drafted)
            return
        if steps_seen == 0:
            return
        step_ms = 1000.0 * (time_s - last_time_s) / (drafted - last_drafted)
        previous = state.draft_ms_per_token
        state.draft_ms_per_token = step_ms if previous is None else 0.7 * previous + 0.3 * step_ms

    def _measure_catch_up(self, seq, step_ms: float, drafted: int) -> None:
        """Learn a catch-up token's price from a step that began with one: the step's draft time less
        its drafting (at the drafting price the policy planned it with) over T(catch-up tokens). The
        prior (`catch_up_price()`, e.g. a draft model's weight bytes per token over the target's) is
        a decode step's ratio, but a catch-up is a prefill-sized forward whose LM head runs on one
        row: the 0.5B draft model's costs a third of the 1.5B's forward of that size where its decode
        step costs nearly half a step (docs/performance.md). Every sequence's catch-ups feed one
        running average: the policy plans one method (a server, a bench method), and later requests
        start from what earlier ones measured."""
        pending = seq.plan_state.catch_up_tokens
        catch_up_ms = step_ms - drafted * self._draft_ms_per_token(seq)
        if catch_up_ms <= 0.0:  # drafting took the step's time: nothing to learn of the catch-up
            return
        price = catch_up_ms / self.cost.t(pending)
        previous = self.measured_catch_up_price
        self.measured_catch_up_price = price if previous is None else 0.5 * previous + 0.5 * price


def parse_gamma(raw) -> int | str | None:
    """A gamma as given on the command line or to the API: "auto" (the cost model picks each step's
    budget; a drafter that scores its positions drafts its block and the scheduler cuts it), None
    (the drafter's default block, verified whole) or an integer >= 0 (int or decimal string; a
    fixed block, verified whole)."""
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
