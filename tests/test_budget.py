"""AutoBudget decisions around one-off catch-up costs, probes and the population prior.

The cost table is crafted (no timing), the sequences are real RunningSequence objects and the
drafters are stubs whose catch-up size and cost are set by the test; the loop test at the end
runs the real small-model drafter on the tiny target.
"""

import dataclasses
import random

import pytest

from specdec.acceptance import AcceptanceTracker
from specdec.budget import AutoBudget, choose_budget, tokens_per_ms
from specdec.cost import CostTable
from specdec.draft import Draft
from specdec.drafters.base import DraftContext, DraftCost, Drafter
from specdec.loop import RunningSequence, run
from specdec.sampling import SamplingParams
from specdec.stats import SpecStats

# a CPU-like target: T(k) grows slowly for small k, prefill-sized forwards cost ~linearly
TABLE = CostTable({}, [1, 2, 4, 8, 13, 256], [100.0, 104.0, 110.0, 125.0, 140.0, 1400.0])


class StubDrafter(Drafter):
    """A drafter that only reports costs (the policy never calls propose in these tests)."""

    name = "stub"

    scored = False

    def __init__(self, pending: int, cost_tokens: float, default_budget: int = 4):
        self.pending = pending
        self.cost = DraftCost(block=default_budget, per_token=cost_tokens, scored=self.scored)

    def propose(self, ctx, budget):  # pragma: no cover - not used by the policy
        return Draft.empty()

    def catch_up_tokens(self, ctx) -> int:
        return self.pending


def make_seq(drafter, prompt_len=10, max_new_tokens=64):
    ctx = DraftContext(list(range(prompt_len)) + [1], prompt_len, SamplingParams())
    return RunningSequence(ctx, drafter, SpecStats(), max_new_tokens, ())


def expected_saving_ms(policy, seq, budget):
    """The stated rule, written out: remaining tokens x (plain ms/token - speculative ms/token)."""
    accept = policy._tracker(seq).probs(budget)
    expected_tokens, survive = 1.0, 1.0
    for prob in accept:
        survive *= prob
        expected_tokens += survive
    spec = (budget * seq.drafter.cost.per_token * TABLE.t(1) + TABLE.t(budget + 1)) / expected_tokens
    return policy.payback_fraction * (seq.max_new_tokens - seq.generated) * (TABLE.t(1) - spec)


def test_catch_up_cost_decides_whether_to_start_drafting():
    policy = AutoBudget(TABLE, max_budget=8)
    short = make_seq(StubDrafter(pending=2, cost_tokens=0.3))
    assert policy.plan([short])[0] > 0  # cheap catch-up: the chain chooser's answer stands
    # find the catch-up length where the one-off cost crosses the expected saving
    for pending in range(2, 2000):
        seq = make_seq(StubDrafter(pending=pending, cost_tokens=0.3))
        budget_without_catch_up = AutoBudget(TABLE, max_budget=8).plan([make_seq(StubDrafter(0, 0.3))])[0]
        one_off = 0.3 * TABLE.t(pending)
        pays = one_off < expected_saving_ms(policy, seq, budget_without_catch_up)
        assert (AutoBudget(TABLE, max_budget=8).plan([seq])[0] > 0) == pays, pending
        if not pays:
            break
    else:
        pytest.fail("a 2000-token catch-up never stopped paying")
    assert 20 < pending < 2000  # the crossing is inside the range, not at its edges
    # fewer tokens left to generate -> less to gain -> a shorter catch-up already does not pay
    few_left = make_seq(StubDrafter(pending=pending // 4, cost_tokens=0.3), max_new_tokens=8)
    assert AutoBudget(TABLE, max_budget=8).plan([few_left])[0] == 0


def test_catch_up_price_is_learned_from_timed_catch_ups():
    """A catch-up is priced at the drafter's prior until one has been timed: the step that began
    with it minus its drafting (at the planned per-token price), over T(catch-up tokens). A later
    request whose catch-up the prior said would not repay then starts drafting when the measured
    price says it does, and one that measured dearer stops it."""
    prior = 0.3
    pending = next(n for n in range(2, 2000)
                   if AutoBudget(TABLE, max_budget=8).plan([make_seq(StubDrafter(n, prior))])[0] == 0)
    policy = AutoBudget(TABLE, max_budget=8)
    assert policy.catch_up_ms(make_seq(StubDrafter(pending, prior))) == pytest.approx(prior * TABLE.t(pending))

    def timed_catch_up(seconds_for_catch_up: float, tokens: int = 40):
        drafter = StubDrafter(pending=tokens, cost_tokens=prior, default_budget=2)
        seq = make_seq(drafter, max_new_tokens=10_000)
        budget = policy.plan([seq])[0]
        assert budget > 0 and seq.plan_state.catch_up_tokens == tokens
        seq.stats.drafted_tokens += budget
        drafting_s = budget * prior * TABLE.t(1) / 1000.0  # at the price the policy planned with
        seq.stats.time_draft_s += drafting_s + seconds_for_catch_up
        drafter.pending = 1 if seconds_for_catch_up else tokens + budget + 1  # fed it, or drafted without it
        policy.observe(seq, budget, budget)
        return seq

    cheap = 0.1 * TABLE.t(40) / 1000.0  # a third of the prior's price
    timed_catch_up(0.0)  # a step that drafted without feeding its catch-up (a hybrid's free nodes) times none
    assert policy.measured_catch_up_price is None
    seq = timed_catch_up(cheap)
    assert policy.measured_catch_up_price == pytest.approx(0.1)
    assert seq.plan_state.draft_ms_per_token is None  # the catch-up stays out of the drafting price
    assert policy.plan([make_seq(StubDrafter(pending, prior))])[0] > 0  # now it repays
    timed_catch_up(5 * cheap)  # 0.5: the running average moves to 0.3
    assert policy.measured_catch_up_price == pytest.approx(0.3)
    timed_catch_up(9 * cheap)  # 0.9 -> 0.6: dearer than the prior
    assert policy.catch_up_ms(make_seq(StubDrafter(pending, prior))) == pytest.approx(0.6 * TABLE.t(pending))
    repays_at_prior = make_seq(StubDrafter(pending - 1, prior))
    assert AutoBudget(TABLE, max_budget=8).plan([repays_at_prior])[0] > 0
    assert policy.plan([repays_at_prior])[0] == 0


class OfferingDrafter(StubDrafter):
    """A composite's offer (Drafter.offered_paths): a model slot at `model_score` (price 0.3 target
    steps) behind the free nodes `free_scores`; the paid slot is left out when asked for free nodes."""

    def __init__(self, pending: int, model_score: float, free_scores: tuple[float, ...] = ()):
        super().__init__(pending, cost_tokens=0.3)
        self.model_score, self.free_scores = model_score, free_scores

    def offered_paths(self, ctx, limit, paid=True):
        offer = [(score, 0.0) for score in self.free_scores] + ([(self.model_score, 0.3)] if paid else [])
        return sorted(offer, reverse=True)[:limit]


def test_a_catch_up_is_repaid_only_on_the_steps_that_use_the_paid_nodes():
    """An offer's catch-up pays back on the steps whose best prefix holds paid nodes; where most steps
    do without them (retrieval offers enough), the same catch-up is declined."""
    def paid_now(policy, pending):
        seq = make_seq(OfferingDrafter(pending, model_score=0.9))
        return policy.plan([seq])[0] > 0  # no free nodes: drafting at all means the model's slot
    pending = next(n for n in range(2, 2000) if not paid_now(AutoBudget(TABLE, max_budget=8), n)) - 1
    assert pending > 2 and paid_now(AutoBudget(TABLE, max_budget=8), pending)
    policy = AutoBudget(TABLE, max_budget=8)
    earlier = make_seq(OfferingDrafter(0, model_score=0.2, free_scores=(0.9,)), max_new_tokens=10_000)
    for _ in range(30):  # an earlier request: the free node was worth more than the paid slot every step
        assert policy.plan([earlier])[0] == 1
    assert earlier.plan_state.paid_share < 0.01 and policy.population_paid_share < 0.25
    assert not paid_now(policy, pending)  # a new request starts from what the earlier one saw
    assert paid_now(policy, 2)  # a small catch-up still pays on a share of the steps


def rejected_probe_steps(policy: AutoBudget, seq, steps: int) -> list[int]:
    """The steps at which `policy` drafts for `seq` when every draft is rejected."""
    probes = []
    for step in range(steps):
        budget = policy.plan([seq])[0]
        if budget:
            probes.append(step)
        policy.observe(seq, budget, 0)
    return probes


def test_probes_back_off_and_skip_expensive_catch_up():
    policy = AutoBudget(TABLE, max_budget=8, probe_every=4, max_probe_every=16)
    seq = make_seq(StubDrafter(pending=0, cost_tokens=0.5), max_new_tokens=10_000)
    probes = rejected_probe_steps(policy, seq, 120)
    assert probes[0] == 0  # the prior (0.6) says a single-token draft pays; one rejection says no
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == [4, 8] + [16] * (len(gaps) - 2) and len(gaps) >= 6
    # a probe that would first need an expensive catch-up waits until it costs at most a step per
    # probe_every idle steps
    idle = make_seq(StubDrafter(pending=500, cost_tokens=0.5), max_new_tokens=10_000)
    policy._tracker(idle).update(4, 0)
    for _ in range(10):
        policy._tracker(idle).update(1, 0)
    plans = [policy.plan([idle])[0] for _ in range(100)]
    first = plans.index(1)  # after first + 1 idle steps
    assert sum(plans) == 1 and first > 16
    assert TABLE.t(1) * first / policy.probe_every < policy.catch_up_ms(idle) <= TABLE.t(1) * (first + 1) / policy.probe_every


def test_probes_reach_a_drafter_whose_catch_up_grows_while_idle():
    """A model drafter is not fed while idle: its catch-up grows by a token per plain step. Probes
    keep coming (the allowed catch-up grows with the idle steps), each within about one step of
    catch-up per probe_every idle steps; with the limit fixed at one step they stopped for good."""
    policy = AutoBudget(TABLE, max_budget=8, probe_every=8, max_probe_every=64)
    drafter = StubDrafter(pending=0, cost_tokens=0.5)
    seq = make_seq(drafter, max_new_tokens=10_000)
    probes, idle = [], 0
    for step in range(400):
        drafter.pending = idle + 1  # the committed tokens it has not seen, its root included
        budget = policy.plan([seq])[0]
        if budget:
            probes.append((step, policy.catch_up_ms(seq), idle))
            idle = 0
        else:
            idle += 1
        policy.observe(seq, budget, 0)
    late = [(step, cost, waited) for step, cost, waited in probes if cost > TABLE.t(1)]
    assert len(probes) >= 6 and late, probes  # probes past the point a fixed one-step limit shuts them out
    for step, cost, waited in probes:
        assert cost <= TABLE.t(1) * max(1.0, waited / policy.probe_every), (step, cost, waited)


def test_draft_cost_leaves_out_a_catch_up_after_plain_steps():
    """The measured draft ms per token learns from drafting steps only: a step that first fed the
    drafter the tokens of earlier plain steps (its catch-up, priced apart) does not enter it."""
    policy = AutoBudget(TABLE, max_budget=8)
    drafter = StubDrafter(pending=1, cost_tokens=0.3, default_budget=2)
    seq = make_seq(drafter, max_new_tokens=10_000)

    def step(seconds_per_token, extra_seconds=0.0, pending=1):
        drafter.pending = pending
        budget = policy.plan([seq])[0]
        assert budget > 0
        seq.stats.drafted_tokens += budget
        seq.stats.time_draft_s += budget * seconds_per_token + extra_seconds
        policy.observe(seq, budget, budget)  # every draft accepted: drafting keeps paying

    step(0.03, extra_seconds=2.0)  # the first step (a draft model prefilling the prompt): left out
    for _ in range(5):
        step(0.03)
    assert seq.plan_state.draft_ms_per_token == pytest.approx(30.0)
    step(0.03, extra_seconds=1.0, pending=40)  # first fed 40 committed tokens: left out
    assert seq.plan_state.draft_ms_per_token == pytest.approx(30.0)
    step(0.06, pending=3)  # a drafting step's own catch-up (its accepted tokens + the bonus) counts
    assert seq.plan_state.draft_ms_per_token == pytest.approx(0.7 * 30.0 + 0.3 * 60.0)


def test_new_sequences_start_at_the_probe_interval_the_population_reached():
    """A drafter that never pays is not probed afresh by every new request: a new sequence starts at
    the interval the latest probe left; once any sequence's drafting pays, new ones probe early again."""
    policy = AutoBudget(TABLE, max_budget=8, probe_every=4, max_probe_every=16)
    first = make_seq(StubDrafter(pending=0, cost_tokens=0.5), max_new_tokens=10_000)
    for _ in range(60):
        policy.observe(first, policy.plan([first])[0], 0)  # every draft rejected
    assert policy.population_probe_every == 16
    second = make_seq(StubDrafter(pending=0, cost_tokens=0.5), max_new_tokens=10_000)
    probes = rejected_probe_steps(policy, second, 40)
    assert probes[:2] == [15, 31], probes  # not at step 0 or after 4 idle steps, as the first sequence was
    accepted = make_seq(StubDrafter(pending=0, cost_tokens=0.5), max_new_tokens=10_000)
    for _ in range(20):
        policy._tracker(accepted).update(4, 4)
    assert policy.plan([accepted])[0] > 0 and policy.population_probe_every == 4
    third = make_seq(StubDrafter(pending=0, cost_tokens=0.5), max_new_tokens=10_000)
    plans = []
    for _ in range(8):
        plans.append(policy.plan([third])[0])
        policy.observe(third, plans[-1], 0)
    assert [step for step, budget in enumerate(plans) if budget][0] <= 4, plans


def test_population_prior_makes_new_sequences_cautious():
    fresh = AutoBudget(TABLE, max_budget=8)
    assert fresh.plan([make_seq(StubDrafter(0, 0.2))])[0] > 0  # default prior 0.6: drafting pays
    taught = AutoBudget(TABLE, max_budget=8)
    for _ in range(5):  # earlier requests under this policy: nothing was ever accepted
        old = make_seq(StubDrafter(0, 0.2))
        for _ in range(20):
            taught.observe(old, 3, 0)
    assert taught.population.probs(1)[0] < 0.2
    assert taught.plan([make_seq(StubDrafter(0, 0.2))])[0] == 0
    with pytest.raises(ValueError, match="probe_every"):
        AutoBudget(TABLE, probe_every=10, max_probe_every=5)
    with pytest.raises(ValueError, match="payback_fraction"):
        AutoBudget(TABLE, payback_fraction=0.0)


def test_small_model_skips_prefill_of_a_long_prompt_and_stays_lossless(tiny_target):
    """Real loop, real draft model: with a costly draft model and few tokens to go, the draft
    model never prefills the long prompt; with a short prompt it drafts. Output = plain."""
    from specdec.drafters import make_drafter

    long_prompt = [(7 * i) % 50 + 3 for i in range(300)]
    outputs = {}
    for name, prompt in (("long", long_prompt), ("short", long_prompt[:4])):
        drafter = make_drafter("small-model", tiny_target, draft_target=tiny_target)
        drafter.cost = dataclasses.replace(drafter.cost, per_token=0.1)  # a draft model a tenth of the target's cost per token
        table = CostTable({}, [1, 2, 4, 8, 16, 256], [10.0, 10.5, 11.0, 12.0, 14.0, 1000.0])
        outputs[name] = run(tiny_target, [prompt], drafter, 12, budget_policy=AutoBudget(table, max_budget=6)).finish()[0]
        plain = run(tiny_target, [prompt], None, 12).finish()
        assert plain[0].tokens == outputs[name].tokens
    assert outputs["long"].stats.drafted_tokens == 0
    assert outputs["short"].stats.drafted_tokens > 0


class ScoringStub(StubDrafter):
    """A stub whose drafts carry confidences (the policy then plans full blocks)."""

    name = "scoring-stub"
    scored = True


def test_confidence_drafts_get_full_blocks_then_one_scheduler_call_cuts_them():
    from specdec.budget import FixedBudget
    from specdec.schedule import admit

    policy = AutoBudget(TABLE, max_budget=8)
    seqs = [make_seq(ScoringStub(0, 0.01, default_budget=4)) for _ in range(4)]
    assert policy.plan(seqs) == [4, 4, 4, 4] and policy.max_budget_for(seqs[0].drafter) == 4
    confidences = [[0.95, 0.9, 0.9, 0.3], [0.5, 0.9, 0.9, 0.9], [0.99, 0.99, 0.99, 0.99]]
    drafts = [Draft.chain([5, 6, 7, 8], confidences=c) for c in confidences] + [Draft.chain([9, 9])]  # the last is unscored
    cut = policy.verify_prefixes(seqs, drafts)
    # the unscored draft is verified whole, and its 3 tokens (root + 2) share the forward
    expected = admit(confidences, lambda tokens: 1000.0 / TABLE.t(tokens + 3))
    assert [len(d) for d in cut] == expected + [2]
    assert len(set(expected)) > 1 and 0 < sum(expected) < 12
    for draft, whole in zip(cut, drafts):
        assert draft.tokens.tolist() == whole.tokens[: len(draft)].tolist()
    # the policy switched off, or a fixed block: planned from estimates / verified whole
    off = AutoBudget(TABLE, max_budget=8, use_confidences=False)
    assert off.verify_prefixes(seqs, drafts) == drafts and off.max_budget_for(seqs[0].drafter) == 8
    assert FixedBudget(4).verify_prefixes(seqs, drafts) == drafts


def test_a_block_that_pays_for_one_sequence_does_not_pay_in_a_batch():
    """The block forward slows every sequence that shares the step: at the same estimates a block
    that pays for a lone sequence (1.3 expected extra tokens for 40 + 14 ms, against 100 ms a token)
    does not pay in a batch of four (the same for 40 + 15 ms against 27.5 ms a token)."""
    assert AutoBudget(TABLE, max_budget=8).plan([make_seq(ScoringStub(0, 0.1, default_budget=4))]) == [4]
    batch = [make_seq(ScoringStub(0, 0.1, default_budget=4)) for _ in range(4)]
    assert AutoBudget(TABLE, max_budget=8).plan(batch) == [0, 0, 0, 0]
    cheap = [make_seq(ScoringStub(0, 0.01, default_budget=4)) for _ in range(4)]  # a 4 ms block pays again
    assert AutoBudget(TABLE, max_budget=8).plan(cheap) == [4, 4, 4, 4]


def test_a_confidence_drafter_that_is_never_accepted_stops_drafting_and_probes():
    """The block forward costs the same however much of it is verified, so drafting its block must
    pay by itself: after rejected blocks the policy plans plain steps, then probes with a block."""
    policy = AutoBudget(TABLE, max_budget=8, draft_ms_per_token=20.0, probe_every=4, max_probe_every=16)
    seq = make_seq(ScoringStub(0, 0.1, default_budget=4))
    assert policy.plan([seq]) == [4]  # the prior says drafting may pay: the whole block
    for _ in range(12):
        policy.observe(seq, 4, 0)  # every verified block rejected at its first token
    plans = [policy.plan([seq])[0] for _ in range(12)]
    assert set(plans) == {0, 4}, plans  # plain steps and whole-block probes, nothing in between
    assert plans[:3] == [0, 0, 0] and plans.count(4) <= 3
    # the same drafter, accepted: drafting pays again
    for _ in range(30):
        policy.observe(seq, 4, 4)
    assert policy.plan([seq]) == [4]
    with pytest.raises(ValueError, match="draft_ms_per_token"):
        AutoBudget(TABLE, draft_ms_per_token=-1.0)


def test_expected_outcomes_update_the_tracker_like_counted_ones():
    """update_expected with 0 / 1 survivals is update(); with probabilities, each depth's estimate
    moves toward the expected acceptance given its parent survived."""
    rng = random.Random(0)
    counted, expected = AcceptanceTracker(), AcceptanceTracker()
    for _ in range(200):
        drafted = rng.randrange(0, 6)
        accepted = rng.randrange(0, drafted + 1)
        counted.update(drafted, accepted)
        expected.update_expected([1.0] * accepted + [0.0] * (accepted < drafted))
        assert expected.probs(6) == pytest.approx(counted.probs(6), rel=1e-12)
    learned = AcceptanceTracker(prior=0.6, prior_weight=2.0, decay=0.9)
    for _ in range(400):
        learned.update_expected([0.3, 0.3 * 0.5, 0.3 * 0.5 * 0.8])
    # settled decayed sums: x / (1 - decay) = 10 x per depth, reached with the parent's survival,
    # shrunk toward the prior by its 2 pseudo-observations; depth 4 is never reached: the prior
    reached, accepted = [10.0, 3.0, 1.5], [3.0, 1.5, 1.2]
    settled = [(0.6 * 2.0 + a) / (2.0 + r) for a, r in zip(accepted, reached)] + [0.6]
    assert learned.probs(4) == pytest.approx(settled, rel=1e-9)
    assert settled[0] < 0.6 and settled[2] > 0.6  # each depth moves toward its own acceptance (0.3, 0.5, 0.8)
    with pytest.raises(ValueError, match="increase"):
        learned.update_expected([0.3, 0.5])
    with pytest.raises(ValueError, match="probabilit"):
        learned.update_expected([1.5])


def test_blocks_the_scheduler_cuts_to_nothing_stop_the_drafting():
    """Blocks whose confidences admit nothing are never verified, yet they say drafting does not pay:
    the policy learns it from the confidences and plans plain steps (with back-off probes) instead of
    paying the block forward every step."""
    policy = AutoBudget(TABLE, max_budget=8, draft_ms_per_token=10.0, probe_every=4, max_probe_every=16)
    seq = make_seq(ScoringStub(0, 0.1, default_budget=4), max_new_tokens=10_000)
    plans = []
    for _ in range(60):
        plans.append(policy.plan([seq])[0])
        if plans[-1]:
            cut = policy.verify_prefixes([seq], [Draft.chain([5, 6, 7, 8], confidences=[0.02, 0.5, 0.5, 0.5])])
            assert len(cut[0]) == 0  # only the root is verified
        policy.observe(seq, 0, 0)
    assert plans[0] == 4 and set(plans) == {0, 4}
    first_plain = plans.index(0)
    assert first_plain <= 4 and plans[first_plain:].count(4) <= 5, plans
    assert policy._tracker(seq).probs(1)[0] < 0.2 and policy.population.probs(1)[0] < 0.5
    # confident blocks, verified and accepted: drafting pays again
    for _ in range(30):
        cut = policy.verify_prefixes([seq], [Draft.chain([5, 6, 7, 8], confidences=[0.95, 0.9, 0.9, 0.9])])
        policy.observe(seq, len(cut[0]), len(cut[0]))
    assert policy.plan([seq]) == [4]


def test_draft_plans_caps_at_max_new_tokens_and_cuts_in_one_call():
    """The loop's one call before the forward: `draft` plans the budgets, drafts through the loop's
    propose (never past max_new_tokens: the bonus token fills the last slot), then makes the one
    scheduler call; what the policy learns from the cut lands on each sequence's own PlanState."""
    from specdec.schedule import admit

    policy = AutoBudget(TABLE, max_budget=8)
    seqs = [make_seq(ScoringStub(0, 0.01, default_budget=4), max_new_tokens=limit) for limit in (64, 64, 3)]
    block = [0.95, 0.9, 0.2, 0.9]
    asked = []

    def propose(seq, budget):
        asked.append(budget)
        return Draft.chain([5, 6, 7, 8][:budget], confidences=block[:budget])

    cut = policy.draft(seqs, propose)
    assert asked == [4, 4, 1]  # the third has generated 1 of 3 tokens: one draft node, then the bonus token
    expected = admit([block, block, block[:1]], lambda tokens: 1000.0 / TABLE.t(tokens))
    assert [len(draft) for draft in cut] == expected and sum(expected) < 9
    for seq, drafted in zip(seqs, (block, block, block[:1])):
        assert seq.plan_state.block == pytest.approx(drafted)  # float32 confidences
    assert [seq.plan_state.cut_tokens for seq in seqs] == [4 - expected[0], 4 - expected[1], 1 - expected[2]]
    for seq, draft in zip(seqs, cut):  # observe consumes the block (the next step's cut is its own)
        policy.observe(seq, len(draft), len(draft))
        assert seq.plan_state.block is None and seq.plan_state.tracker is policy._tracker(seq)


def test_nodes_priced_one_by_one():
    """A hybrid's offer: a found retrieval match costs only its verify row, a model slot its drafting
    too; the second node pays when free and does not at 50 ms."""
    table = CostTable({}, [1, 2, 3], [100.0, 110.0, 120.0])
    assert tokens_per_ms([0.9, 0.5], table, [0.0, 50.0]) == pytest.approx([1 / 100, 1.9 / 110, 2.4 / 170])
    assert choose_budget([0.9, 0.5], table, [0.0, 50.0], 2) == 1
    assert choose_budget([0.9, 0.5], table, 0.0, 2) == 2
    with pytest.raises(ValueError, match="a draft price per node"):
        tokens_per_ms([0.9, 0.5], table, [0.0])
    with pytest.raises(ValueError, match=">= 0 ms"):
        tokens_per_ms([0.9, 0.5], table, [0.0, -1.0])
