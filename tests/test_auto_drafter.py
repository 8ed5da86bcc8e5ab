"""`--drafter auto`: the method is picked per step from earlier steps' measured earnings; greedy
equals plain on SmolLM2 (alone and batched), sampling keeps the target's distribution, and the
stats say which method drafted what."""

import pytest
from test_hybrid import markov_pair  # noqa: F401  (the fixture)
from test_model_drafters import PROMPTS, _drafted_pair_pvalue
from test_ngram_drafters import copy_prompts
from test_sampled_tree import FIRST, LEAD_IN

from specdec import generate, generate_batch, make_drafter
from specdec.drafters import drafter_options
from specdec.drafters.auto import AutoDrafter, Earnings, drafts_free
from specdec.stats import SpecStats

MAX_NEW = 24


def test_choice_follows_the_measured_rates_and_explores_the_stalest_arm():
    auto = AutoDrafter(None, methods="pld,suffix", warmup=2, explore_every=4)
    assert [arm.name for arm in auto.arms] == ["pld", "suffix", "plain"]
    picks = []
    for step in range(6):  # warm-up: each arm `warmup` steps; plain none (free arms: see below)
        auto.step = step
        picks.append(auto.choose().name)
    assert picks == ["pld", "pld", "suffix", "suffix", "pld", "pld"]
    rates = {"plain": (10.0, 100.0), "pld": (30.0, 110.0), "suffix": (12.0, 100.0)}  # (tokens, ms)
    for step, arm in enumerate(auto.arms):
        arm.earned = Earnings(*rates[arm.name], 1.0)
        arm.last_run = 5 - step
    auto.step = 7
    assert auto.choose().name == "pld"  # 0.27 tokens/ms beats 0.12 and 0.1
    auto.step = 8  # an exploring step: the arm run longest ago
    assert auto.choose().name == "plain"




def test_plain_runs_only_where_no_arm_drafts_free(tiny_target):
    """Retrieval drafts nothing where it finds nothing (a plain step) and the budget policy sizes the
    rest, so plain is chosen only over arms that pay to draft, and warms up only where no arm is free."""
    auto = AutoDrafter(tiny_target, methods="random,pld", warmup=1)
    paid, pld, plain = auto.arms
    assert [arm.free for arm in auto.arms] == [False, True, False]
    assert [auto.choose().name for auto.step in range(3)] == ["random", "pld", "random"]  # plain's slot skipped
    for arm, (tokens, ms) in ((paid, (10, 100)), (pld, (11, 100)), (plain, (30, 100))):
        arm.earned = Earnings(tokens, ms, 1.0)
    auto.step = 5
    assert auto.choose() is pld  # plain earns most, but pld drafts free
    alone = AutoDrafter(tiny_target, methods="random", warmup=1)
    paid, plain = alone.arms
    assert [alone.choose().name for alone.step in range(2)] == ["random", "plain"]
    paid.earned, plain.earned = Earnings(10, 100, 1.0), Earnings(30, 100, 1.0)
    alone.step = 5
    assert alone.choose() is plain
    assert drafts_free(AutoDrafter(None, methods="hybrid").arms[0].drafter)

def test_an_arm_run_to_warm_up_or_explore_offers_its_free_nodes_only(tiny_target):
    """The budget policy repays a paid part's catch-up (a hybrid's draft model reading the prompt)
    over the tokens still to come, so only the best arm, which keeps running, may offer paid nodes:
    the hybrid warming up or explored for a step offers its retrieval nodes alone."""
    from specdec.drafters.base import DraftContext
    from specdec.sampling import SamplingParams

    auto = AutoDrafter(tiny_target, methods="pld,hybrid", model="random", warmup=1, explore_every=4).for_sequence()
    pld, hybrid, plain = auto.arms
    auto.begin([5, 6, 7], tiny_target)
    ctx = DraftContext(tokens=[5, 6, 7], num_prompt_tokens=3, sampling=SamplingParams())  # no n-gram to match

    def model_slots_offered(step: int) -> bool:
        auto.step = step
        offer = auto.offered_paths(ctx, 4)
        assert all(price == 0.0 for _, price in offer)  # the random drafter's price is 0: the slots count
        assert hybrid.drafter.model_slots == bool(offer)  # what the next proposal holds
        return bool(offer)

    assert auto.choose() is pld and [auto.choose() for auto.step in (1,)] == [hybrid]
    assert not model_slots_offered(1)  # warming up
    for arm, (tokens, ms, last_run) in ((pld, (10, 100, 6)), (hybrid, (30, 100, 5)), (plain, (10, 100, 7))):
        arm.earned, arm.last_run = Earnings(tokens, ms, 1.0), last_run
    assert model_slots_offered(6) and auto.choose() is hybrid  # the best arm: its model's slots too
    hybrid.earned = Earnings(5, 100, 1.0)  # pld is best now; the hybrid is the stalest arm
    auto.step = 8
    assert auto.choose() is hybrid and not model_slots_offered(8)  # explored: free nodes only


def test_an_empty_draft_is_a_plain_step_that_measures_plain():
    """A step whose arm drafted nothing (no match) earns for plain too, so plain's warm-up is skipped
    once such steps measured it; a step that drafted earns for its arm alone."""
    from specdec.drafters.base import DraftContext
    from specdec.sampling import SamplingParams
    from specdec.verify import VerifyResult

    auto = AutoDrafter(None, methods="pld", warmup=2).for_sequence()
    auto.begin([1, 2, 3], None)
    pld, plain = auto.arms
    assert [arm.name for arm in auto.warming] == ["pld", "plain"]
    # pld's warm-up (no match twice; its first step is not timed), then plain's slots, then a match
    for step, tokens in enumerate(([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 1, 2])):
        ctx = DraftContext(tokens=tokens, num_prompt_tokens=3, sampling=SamplingParams())
        draft = auto.propose(ctx, 3)
        # step 2 is plain's warm-up slot, skipped: the timed empty step 1 measured plain already
        assert auto.running[0] is pld and len(draft) == (3 if step == 2 else 0)
        auto.on_verified(VerifyResult(tokens=[0] * (len(draft) + 1), num_accepted=len(draft), path=list(range(len(draft)))), ctx)
        if step == 1:
            assert plain.runs == 0 and plain.earned.steps == 1 and plain.earned.tokens == 1 and plain.population.steps == 1
    # its first step is not timed; decayed sums: the older step weighs `decay`
    assert pld.runs == 3 and pld.earned.tokens == pytest.approx(auto.decay * 1 + 4) and pld.earned.steps == pytest.approx(auto.decay + 1)
    assert plain.earned.steps == 1  # the step that drafted earned for pld alone

def test_every_drafter_exists_once_per_request_and_the_hybrid_drives_its_parts():
    """The hybrid arm drafts from the very suffix / pld objects the single-method arms are, in the
    template and in every request's copy; auto drives only the drafters nothing else is built of."""
    auto = AutoDrafter(None, methods="suffix,pld,hybrid")
    for drafter in (auto, auto.for_sequence()):
        arms = {arm.name: arm.drafter for arm in drafter.arms}
        assert arms["hybrid"].retrieval == [arms["suffix"], arms["pld"]]
        assert drafter.parts() == [arms["hybrid"]]
    first, second = auto.for_sequence(), auto.for_sequence()
    assert first.arms[0].drafter is not second.arms[0].drafter  # each request its own trie
    alone = AutoDrafter(None, methods="pld,hybrid")  # suffix is no arm: the hybrid builds its own
    pld, hybrid = alone.arms[0].drafter, alone.arms[1].drafter
    assert alone.parts() == [hybrid] and hybrid.retrieval[1] is pld and hybrid.retrieval[0].name == "suffix"


def test_a_new_request_starts_from_the_population_the_copies_share():
    """Earnings any copy records feed the one population of its drafter (not another drafter's); a
    request begun later warms up only the arms the population has not measured and starts from
    the population's rates."""
    auto, other = AutoDrafter(None, methods="pld,suffix", warmup=2), AutoDrafter(None, methods="pld,suffix")
    first, second = auto.for_sequence(), auto.for_sequence()  # a batch of two
    for seq in (first, second):
        seq.begin([1, 2, 3, 1, 2], None)
        assert [arm.name for arm in seq.warming] == ["pld", "suffix", "plain"]  # nothing measured yet
    pld, _, plain = first.arms
    plain.population.add(1, 10.0, auto.population_decay)  # 0.1 tokens / ms
    second.arms[0].population.add(6, 20.0, auto.population_decay)  # 0.3 tokens / ms
    for index, arm in enumerate(auto.arms):
        assert arm.population is first.arms[index].population is second.arms[index].population
        assert arm.population is not other.arms[index].population and other.arms[index].population.steps == 0
    assert pld.population.rate() == pytest.approx(0.3) and pld.earned.steps == 0  # the request's own stay its own
    later = auto.for_sequence()
    later.begin([1, 2, 3, 1, 2], None)
    assert [arm.name for arm in later.warming] == ["suffix"]  # only the unmeasured arm warms up
    later.arms[1].earned = Earnings(1.0, 10.0, 1.0)  # as its warm-up measured it
    assert [later.choose().name for later.step in range(3)] == ["suffix", "suffix", "pld"]
    assert later.arms[0].rate() == pytest.approx(0.3) and later.arms[0].earned.steps == 1.0  # weighted as one step
    suffix = later.arms[1]
    suffix.population.add(2, 10.0, auto.population_decay)
    fresh_start = auto.for_sequence()
    fresh_start.begin([1, 2, 3, 1, 2], None)
    assert fresh_start.warming == [] and fresh_start.choose().name == "pld"  # no warm-up: the best arm at once


def test_options_and_bad_input():
    options = drafter_options("auto", ["methods=suffix+hybrid", "model=small-model", "model-options=gamma=3", "warmup=1",
                                       "population-decay=0.5"])
    assert options == {"methods": "suffix+hybrid", "model": "small-model", "model_options": "gamma=3", "warmup": 1,
                       "population_decay": 0.5}
    for bad, message in (({"methods": "pld,pld"}, "distinct"), ({"methods": "auto"}, "not auto"), ({"methods": "plain"}, "not auto"),
                         ({"model_options": "gamma=2"}, "without a model"), ({"decay": 0.0}, "decay"),
                         ({"population_decay": 1.5}, "population_decay"),
                         ({"explore_every": 1}, "explore_every"), ({"methods": "nope"}, "unknown drafter")):
        with pytest.raises(ValueError, match=message):
            make_drafter("auto", None, **bad)


@pytest.fixture(scope="module")
def smollm2_bf16():
    from specdec import load_target

    return load_target("smollm2-135m", dtype="bfloat16", progress=False)


@pytest.mark.slow
def test_greedy_equals_plain_and_the_stats_name_the_methods(smollm2, smollm2_bf16):
    prompts = [*PROMPTS, *copy_prompts()[:2]]
    plain = [generate(smollm2, prompt, None, max_new_tokens=MAX_NEW).tokens for prompt in prompts]
    drafter = make_drafter("auto", smollm2, model="small-model", model_options={"draft_target": smollm2_bf16, "gamma": 3},
                           warmup=1, explore_every=3)
    alone = [generate(smollm2, prompt, drafter, max_new_tokens=MAX_NEW) for prompt in prompts]
    assert [result.tokens for result in alone] == plain
    assert [result.tokens for result in generate_batch(smollm2, prompts, drafter, max_new_tokens=MAX_NEW)] == plain
    total = SpecStats.combine(result.stats for result in alone)
    assert sum(total.accepted_by_source.values()) == total.accepted_tokens
    methods = {name.split(":")[0] for name in total.drafted_by_source}
    assert len(methods) >= 2 and methods <= {"suffix", "pld", "hybrid"}  # the model drafts in the hybrid's tree
    assert [arm.name for arm in drafter.arms] == ["suffix", "pld", "hybrid", "plain"]


@pytest.mark.slow
def test_a_second_request_skips_the_warm_up_and_greedy_still_equals_plain(smollm2):
    """The first requests (a batch, then one alone) warm every arm up and feed the drafter's one
    population; a request begun after them warms nothing up and starts with the arm that earned most."""
    prompts = [PROMPTS[0], copy_prompts()[1]]
    plain = [generate(smollm2, prompt, None, max_new_tokens=48).tokens for prompt in prompts]
    drafter = make_drafter("auto", smollm2, methods="pld,suffix", warmup=2)
    untouched = make_drafter("auto", smollm2, methods="pld,suffix", warmup=2)
    assert [result.tokens for result in generate_batch(smollm2, prompts, drafter, max_new_tokens=48)] == plain
    assert all(arm.population.steps > 0 for arm in drafter.arms)  # both sequences' steps, in one record per arm
    assert all(arm.population.steps == 0 for arm in untouched.arms)
    assert generate(smollm2, prompts[1], drafter, max_new_tokens=48).tokens == plain[1]
    best = max(drafter.arms, key=lambda arm: arm.population.rate()).name
    later = drafter.for_sequence()
    later.begin(plain[1], smollm2)
    assert later.warming == [] and later.choose().name == best
    assert generate(smollm2, prompts[0], drafter, max_new_tokens=48).tokens == plain[0]


def test_sampling_keeps_the_target_distribution(markov_pair):  # noqa: F811
    """The hybrid arm drafts first (a deterministic pld node beside a sampled model node), then
    the model alone: tokens 2 and 3 follow the target's exact joint."""
    target, draft = markov_pair
    prompt = [FIRST + 0, FIRST + 1, *LEAD_IN[0]]
    drafter = AutoDrafter(target, methods="hybrid,small-model,plain", model="small-model",
                          model_options={"draft_target": draft}, warmup=1, explore_every=2)
    assert [arm.name for arm in drafter.arms] == ["hybrid", "small-model", "plain"]
    assert _drafted_pair_pvalue(target, drafter, prompt, runs=1500) > 1e-3


def test_the_server_drafts_with_auto_unless_told_none(capsys, tmp_path, monkeypatch):
    """`specdec serve` without --drafter takes auto's options (refused before any model loads);
    --drafter none is plain decoding, which takes none."""
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # a load would create the model's cache entry here
    assert main(["serve", "--drafter-arg", "warmup=zero", "--port", "0"]) == 2
    assert "warmup of auto must be int" in capsys.readouterr().err
    assert main(["serve", "--drafter", "none", "--drafter-arg", "gamma=2", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == "specdec: error: --drafter-arg needs a drafter (--drafter none is plain decoding)"
    assert list(tmp_path.iterdir()) == []
