"""The `hybrid` drafter: retrieval candidates and a model drafter merged into one tree.

Greedy equals plain on SmolLM2 (alone and batched) with every source's nodes accepted somewhere;
at temperature 1 the mixed tree (a deterministic pld node beside a sampled draft-model node) keeps
the target's distribution through the real loop, and a planted wrong merge (a sampled node merged
into the retrieval node of the same token, losing its q) fails the same test."""

import pytest
import torch
from test_model_drafters import PROMPTS, _drafted_pair_pvalue
from test_ngram_drafters import copy_prompts
from test_sampled_tree import DRAFT_PROBS, FIRST, LEAD_IN, TARGET_PROBS, make_markov_llama

from specdec import SamplingParams, generate, generate_batch, make_drafter
from specdec.draft import Draft
from specdec.drafters import drafter_option_names, drafter_options
from specdec.drafters.hybrid import CandidateTrie, HybridDrafter, sub_drafter_options
from specdec.stats import SpecStats

MAX_NEW = 24


# ---------------------------------------------------------------------------- the merge
def test_deterministic_drafts_merge_on_shared_prefixes_and_sampled_nodes_stay_apart():
    trie = CandidateTrie()
    first = trie.add(Draft.chain([5, 6, 7]), 0, [0.9, 0.8, 0.7])
    second = trie.add(Draft([5, 6, 9, 2], [-1, 0, 1, -1]), 1, [0.95, 0.5, 0.4])
    assert second[:2] == first[:2] and len(trie.nodes) == 5  # 5 -> 6 shared, 9 and 2 new
    assert trie.nodes[first[0]].sources == [0, 1] and trie.nodes[first[0]].score == 0.95
    q = torch.tensor([[0.1, 0.2, 0.3, 0.1, 0.1, 0.2, 0.0, 0.0, 0.0, 0.0]])  # [1, V]: token 5 drawn from q
    sampled = trie.add(Draft.chain([5], q), 2, [0.99])
    assert sampled[0] == 5 and torch.equal(trie.nodes[5].row, q[0])  # not merged into the deterministic 5
    draft, order = trie.to_draft({*first, *second, *sampled}, ["pld", "suffix", "small-model"])
    assert draft.tokens.tolist() == [5, 2, 6, 7, 9, 5] and draft.parents.tolist() == [-1, -1, 0, 2, 2, -1]
    assert draft.sources == ("pld", "suffix", "pld", "pld", "suffix", "small-model")
    assert order == [0, 4, 1, 2, 3, 5]
    # a mixed tree: deterministic nodes carry one-hot rows, the sampled node its q
    assert torch.equal(draft.draft_probs[:5], torch.nn.functional.one_hot(draft.tokens[:5], 10).float())
    assert torch.equal(draft.draft_probs[5], q[0])
    assert draft.prefix(2).sources == ("pld", "suffix")


def test_per_source_stats_count_merge_and_serialise():
    stats = SpecStats()
    stats.record_sources(("pld", "suffix", "pld"), [0, 2])
    other = SpecStats()
    other.record_sources(("small-model",), [])
    stats.merge(other)
    assert stats.drafted_by_source == {"pld": 2, "suffix": 1, "small-model": 1}
    assert stats.accepted_by_source == {"pld": 2}
    assert SpecStats.from_dict(stats.to_dict()).drafted_by_source == stats.drafted_by_source
    assert "pld 2/2, small-model 0/1, suffix 0/1" in stats.summary_table()


# ---------------------------------------------------------------------------- options
def test_options_are_introspectable_and_parsed_like_drafter_args():
    names = drafter_option_names(HybridDrafter)
    assert {"sources", "model", "model_options", "rest_options", "model_per_token", "gamma"} <= set(names)
    options = drafter_options("hybrid", ["sources=suffix,pld", "model=small-model",
                                         "model-options=draft_model=smollm2-135m,gamma=3,tree=true", "model-per-token=0.2"])
    assert options == {"sources": "suffix,pld", "model": "small-model", "model_per_token": 0.2,
                       "model_options": "draft_model=smollm2-135m,gamma=3,tree=true"}
    assert sub_drafter_options("small-model", options["model_options"]) == {"draft_model": "smollm2-135m", "gamma": 3,
                                                                            "tree": True}
    assert sub_drafter_options("suffix", "max_depth=3;tree=false") == {"max_depth": 3, "tree": False}  # a bench method's form
    assert make_drafter("hybrid", None, sources="pld+suffix").source_names == ["pld", "suffix"]
    with pytest.raises(ValueError, match="small-model takes KEY=VALUE"):
        sub_drafter_options("small-model", "no_such_option=1")


@pytest.mark.parametrize("options, message", [
    ({"sources": "suffix,lookahead"}, "sources must be distinct names among bigram, pld, rest, suffix"),
    ({"sources": "pld,pld"}, "sources must be distinct"),
    ({"sources": "", "model": ""}, "at least one source or a model"),
    ({"model": "pld"}, "model must be a model drafter"),
    ({"model": "hybrid"}, "model must be a model drafter"),
    ({"model": "auto"}, "model must be a model drafter"),
    ({"sources": "pld", "suffix_options": "max_depth=3"}, "suffix_options given but suffix is not among"),
    ({"model_options": "gamma=3"}, "model_options given without a model"),
    ({"pld_options": "min_ngram=9"}, "min_ngram"),
    ({"model_per_token": -1.0}, "model_per_token must be a number >= 0"),
])
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        make_drafter("hybrid", None, **options)


# ---------------------------------------------------------------------------- greedy exactness
@pytest.fixture(scope="module")
def smollm2_bf16():
    from specdec import load_target

    return load_target("smollm2-135m", dtype="bfloat16", progress=False)


@pytest.mark.slow
def test_greedy_equals_plain_and_every_source_is_credited(smollm2, smollm2_bf16):
    prompts = [*PROMPTS, *copy_prompts()[:2]]  # the copy prompts: retrieval finds the drafts
    plain = [generate(smollm2, prompt, None, max_new_tokens=MAX_NEW).tokens for prompt in prompts]
    drafter = make_drafter("hybrid", smollm2, sources="suffix,pld", model="small-model",
                           model_options={"draft_target": smollm2_bf16, "gamma": 3}, model_per_token=0.0)
    alone = [generate(smollm2, prompt, drafter, max_new_tokens=MAX_NEW) for prompt in prompts]
    assert [result.tokens for result in alone] == plain
    batched = generate_batch(smollm2, prompts, drafter, max_new_tokens=MAX_NEW)
    assert [result.tokens for result in batched] == plain
    # batched under --gamma auto: each sequence's offer is priced after the others' rows
    from specdec.budget import AutoBudget
    from specdec.cost import CostTable
    from specdec.loop import run

    cheap = CostTable({}, [1, 2, 4, 8, 13, 256], [100.0, 101.0, 103.0, 107.0, 112.0, 1400.0])
    prompt_ids = [smollm2.encode_prompt(prompt) for prompt in prompts]
    auto = run(smollm2, prompt_ids, drafter, MAX_NEW, SamplingParams(), (), AutoBudget(cheap, max_budget=8)).finish()
    assert [result.tokens for result in auto] == plain
    assert sum(result.stats.accepted_by_source.get("suffix", 0) for result in auto) > 0
    total = SpecStats.combine(result.stats for result in alone)
    assert sum(total.accepted_by_source.values()) == total.accepted_tokens
    assert sum(total.drafted_by_source.values()) == total.drafted_tokens
    assert total.accepted_by_source.get("small-model", 0) > 0 and total.accepted_by_source.get("suffix", 0) > 0
    # retrieval alone (no model) is exact too
    retrieval = make_drafter("hybrid", smollm2, sources="pld,suffix")
    assert generate(smollm2, prompts[3], retrieval, max_new_tokens=MAX_NEW).tokens == plain[3]


@pytest.mark.slow
def test_a_request_starts_each_source_from_what_earlier_requests_saw(smollm2):
    """Every request's outcomes per source feed one population the drafter's copies share; a new
    request's trackers start from it (not from the default prior), so a source that is rarely right
    starts cautious."""
    drafter = make_drafter("hybrid", smollm2, sources="suffix,pld,bigram")
    assert [tracker.probs(1)[0] for tracker in drafter.population] == pytest.approx([0.6] * 3)
    first = generate(smollm2, copy_prompts()[1], drafter, max_new_tokens=MAX_NEW)
    assert sum(first.stats.drafted_by_source.values()) > 0
    seen = [tracker.probs(1)[0] for tracker in drafter.population]  # the template's: copies fed it
    assert any(estimate != pytest.approx(0.6) for estimate in seen)
    later = drafter.for_sequence()
    later.begin([5, 6, 7], smollm2)
    assert later.population is drafter.population
    assert [tracker.probs(1)[0] for tracker in later.trackers] == pytest.approx(seen)
    rarely_right = drafter.for_sequence()
    for _ in range(40):
        rarely_right.population[2].update(1, 0)  # bigram's drafts rejected, request after request
    rarely_right.begin([5, 6, 7], smollm2)
    assert rarely_right.trackers[2].probs(1)[0] < 0.2 < rarely_right.trackers[0].probs(1)[0]


# ---------------------------------------------------------------------------- sampling is lossless
@pytest.fixture(scope="module")
def markov_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_markov")
    return make_markov_llama(root / "target", TARGET_PROBS), make_markov_llama(root / "draft", DRAFT_PROBS)


def merge_sampled_nodes_too(monkeypatch) -> None:
    """WRONG on purpose: a sampled node whose token a retrieval node already proposed is merged
    into it (its q is dropped), the other sampled nodes keep their rows: whether a sampled
    candidate is tried now depends on its own value, so its row is no longer what it was drawn from."""
    add = CandidateTrie.add

    def merging_add(trie, draft, source, depth_scores):
        if draft.draft_probs is None:
            return add(trie, draft, source, depth_scores)
        placed = []
        for node, (token, parent) in enumerate(zip(draft.tokens.tolist(), draft.parents.tolist())):
            parent = -1 if parent < 0 else placed[parent]
            found = trie.index.get((parent, token))
            if found is None:
                one = Draft(draft.tokens[node : node + 1], [-1], draft.draft_probs[node : node + 1])
                found = add(trie, one, source, depth_scores)[0]
                trie.nodes[found].parent = parent
                trie.nodes[found].depth = 1 if parent < 0 else trie.nodes[parent].depth + 1
            placed.append(found)
        return placed

    monkeypatch.setattr(CandidateTrie, "add", merging_add)


def test_mixed_tree_keeps_the_target_distribution_and_a_wrong_merge_fails(markov_pair, monkeypatch):
    """The first draft after crafted token 0 (budget 2): pld's copy of crafted token 1 (q 0.6 but
    p 0.1: usually rejected) beside one node the draft model samples from q. Tokens 2 and 3 of the
    output are compared with the target's exact joint (test_model_drafters' chi-square test)."""
    target, draft = markov_pair
    prompt = [FIRST + 0, FIRST + 1, *LEAD_IN[0]]  # "0 1" earlier, then the lead-in to crafted 0: pld proposes 1
    drafter = HybridDrafter(target, sources="pld", pld_options="min_ngram=1,max_ngram=1,gamma=1", model="small-model",
                            model_options={"draft_target": draft}, model_per_token=0.0)
    first = generate(target, prompt, drafter, max_new_tokens=4, gamma=2, sampling=SamplingParams(temperature=1.0, seed=0))
    assert first.stats.drafted_by_source["pld"] >= 1 and first.stats.drafted_by_source["small-model"] >= 1
    assert _drafted_pair_pvalue(target, drafter, prompt, runs=1500) > 1e-3
    merge_sampled_nodes_too(monkeypatch)
    assert _drafted_pair_pvalue(target, drafter, prompt, runs=1500) < 1e-6


# ---------------------------------------------------------------------------- trained-head models
@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_a_head_drafter_as_the_model(tiny_target, kind):
    """EAGLE-3 (target hidden layers handed over by the verify forward) and DSpark (a block drafter
    with confidences) as the hybrid's model: greedy equals plain, sampling runs, nodes are credited."""
    from test_head_drafter import MODULES, RANKED, random_module

    from specdec.drafters import registered_drafters
    from specdec.heads import HEAD_TYPES

    name = HEAD_TYPES[kind].drafter
    options = {} if kind == "eagle3" else {"draft_vocab": 40}
    model = registered_drafters()[name].from_module(tiny_target, random_module(kind, tiny_target), draft_vocab_ids=RANKED,
                                                     **options)
    drafter = HybridDrafter(tiny_target, sources="suffix,pld", model=model, model_per_token=0.0)
    assert drafter.hidden_layers == model.hidden_layers and MODULES[kind]
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    plain = generate(tiny_target, prompt, None, max_new_tokens=16).tokens
    result = generate(tiny_target, prompt, drafter, max_new_tokens=16)
    assert result.tokens == plain and result.stats.drafted_by_source.get(name, 0) > 0
    sampled = generate(tiny_target, prompt, drafter, max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=2))
    assert sampled.stats.drafted_by_source.get(name, 0) > 0


# ---------------------------------------------------------------------------- the budget of a hybrid
def test_retrieval_matches_are_verified_while_the_model_does_not_pay(smollm2):
    """Under --gamma auto a hybrid whose model never pays (random tokens) and whose record therefore
    says drafting does not pay still has its free retrieval matches verified (Drafter.offered_paths:
    found matches at price 0, the model's slots at the model's price). Before, the policy planned budget 0 on nearly
    every step and suffix stopped drafting with the model (EAGLE-3 as the model on the dev subset)."""
    from specdec.budget import AutoBudget
    from specdec.cost import CostTable
    from specdec.loop import run

    table = CostTable({}, [1, 2, 4, 8, 13, 256], [100.0, 104.0, 110.0, 125.0, 140.0, 1400.0])
    prompt = smollm2.encode_prompt(copy_prompts()[0])
    plain = generate(smollm2, prompt, None, max_new_tokens=MAX_NEW).tokens
    outcomes = {}
    for offered in (True, False):
        policy = AutoBudget(table, max_budget=8)
        for _ in range(50):  # earlier requests drafted and failed: a new one starts at a prior near 0
            policy.population.update(1, 0)
        drafter = make_drafter("hybrid", smollm2, sources="suffix,pld", model="random", model_per_token=0.0)
        if not offered:  # the policy as it was: the hybrid's record alone
            drafter.offered_paths = lambda ctx, limit: None
        (result,) = run(smollm2, [prompt], drafter, MAX_NEW, SamplingParams(), (), policy).finish()
        assert result.tokens == plain
        outcomes[offered] = result.stats
    with_free, record_only = outcomes[True], outcomes[False]
    retrieval = [stats.accepted_by_source.get("suffix", 0) + stats.accepted_by_source.get("pld", 0)
                 for stats in (with_free, record_only)]
    # the record alone: one probe node at a time (8 accepted in 15 steps); the offered matches: 15 in 8
    assert retrieval[0] >= MAX_NEW // 2 and retrieval[0] > retrieval[1]
    assert 3 * with_free.steps <= 2 * record_only.steps


def test_a_model_slot_enters_only_when_it_pays_for_its_verify(smollm2):
    """Under --gamma auto a model slot is priced at its drafting and its share of the verify forward:
    with the model's held-out acceptance at 0.3 (its tracker's starting estimate) one extra row that
    costs half a step does not pay (1.3 tokens in 1.5 steps) and the model never drafts, where a row
    costing 1 % does; with no held-out figure the tracker starts at 0.6 and the dear row pays
    (1.6 in 1.5) until the random model's misses bring the estimate down. Output = plain each time."""
    from specdec.budget import AutoBudget
    from specdec.cost import CostTable
    from specdec.loop import run

    ks = [1, 2, 4, 8, 13, 256]
    dear = CostTable({}, ks, [100.0, 150.0, 250.0, 450.0, 700.0, 9000.0])
    cheap = CostTable({}, ks, [100.0, 101.0, 103.0, 107.0, 112.0, 1400.0])
    prompt = smollm2.encode_prompt(PROMPTS[0])
    plain = generate(smollm2, prompt, None, max_new_tokens=MAX_NEW).tokens
    drafted = {}
    for case, table, held_out in (("dear", dear, 0.3), ("cheap", cheap, 0.3), ("dear, unknown", dear, None)):
        drafter = make_drafter("hybrid", smollm2, sources="", model="random", model_per_token=0.0)
        drafter.model.held_out_acceptance = held_out
        (result,) = run(smollm2, [prompt], drafter, MAX_NEW, SamplingParams(), (), AutoBudget(table, max_budget=8)).finish()
        assert result.tokens == plain
        drafted[case] = result.stats.drafted_by_source.get("random", 0)
    assert drafted["dear"] == 0 and drafted["cheap"] >= MAX_NEW // 2 and 0 < drafted["dear, unknown"] < MAX_NEW // 2


def test_a_checkpoint_s_held_out_top1_is_the_model_s_starting_estimate(tiny_target):
    from test_head_drafter import RANKED, random_module

    from specdec.drafters.eagle import Eagle3Drafter

    module = random_module("eagle3", tiny_target)
    assert Eagle3Drafter.from_module(tiny_target, module, draft_vocab_ids=RANKED).held_out_acceptance is None
    model = Eagle3Drafter.from_module(tiny_target, module, rank_acc=[[0.42, 0.1], [0.3, 0.1]], draft_vocab_ids=RANKED)
    assert model.held_out_acceptance == pytest.approx(0.42)
    drafter = HybridDrafter(tiny_target, sources="suffix", model=model)
    drafter.begin([5, 6, 7], tiny_target)
    assert drafter.trackers[-1].probs(1)[0] == pytest.approx(0.42) and drafter.trackers[0].probs(1)[0] == pytest.approx(0.6)


def test_a_chained_head_feeds_its_rows_only_when_it_drafts(tiny_target):
    """EAGLE's runner holds the target rows while it does not draft (the hybrid ran its retrieval
    alone), the prompt's included, and feeds them in its next draft: a request it never drafts in
    runs no module forward at all."""
    from test_head_drafter import RANKED, random_module

    from specdec.drafters.eagle import Eagle3Drafter

    model = Eagle3Drafter.from_module(tiny_target, random_module("eagle3", tiny_target), draft_vocab_ids=RANKED)
    forwards = []
    step = model.heads.step
    model.heads.step = lambda *args, **kwargs: forwards.append(1) or step(*args, **kwargs)
    drafter = HybridDrafter(tiny_target, sources="suffix,pld", model=model, model_per_token=10.0)  # the model never pays
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    result = generate(tiny_target, prompt, drafter, max_new_tokens=12)
    assert result.tokens == generate(tiny_target, prompt, None, max_new_tokens=12).tokens
    assert not forwards and result.stats.drafted_by_source.get("eagle3", 0) == 0
    drafter.model_per_token = 0.0  # now it drafts: the held rows are fed first, and the output stays plain's
    result = generate(tiny_target, prompt, drafter, max_new_tokens=12)
    assert result.tokens == generate(tiny_target, prompt, None, max_new_tokens=12).tokens
    assert len(forwards) > 2 and result.stats.drafted_by_source.get("eagle3", 0) > 0


def test_the_model_s_prompt_feed_is_drafted_only_when_it_repays(tiny_target):
    """Under --gamma auto a step with model slots also pays the model's catch-up (an EAGLE head
    feeding the prompt's rows: one prefill-sized forward). The two cost tables agree on every verify
    size the steps use (1-9 tokens) and differ on the prompt-sized forward: where feeding the prompt
    costs more than the model's slots can save in the tokens left, the model never runs (no module
    forward at all) and the free matches still draft; where it is cheap, the model drafts. Output =
    plain each time."""
    from test_head_drafter import RANKED, random_module

    from specdec.budget import AutoBudget
    from specdec.cost import CostTable
    from specdec.drafters.eagle import Eagle3Drafter
    from specdec.loop import run

    ks = [1, 2, 4, 8, 16, 64]
    verify_ms = [100.0, 101.0, 103.0, 107.0]
    cheap_feed = CostTable({}, ks, verify_ms + [115.0, 170.0])
    dear_feed = CostTable({}, ks, verify_ms + [50_000.0, 200_000.0])
    lead_in = [20, 21] * 8
    prompt = lead_in + generate(tiny_target, lead_in, None, max_new_tokens=24).tokens  # it repeats short n-grams
    plain = generate(tiny_target, prompt, None, max_new_tokens=12).tokens
    drafted, forwards = {}, {}
    for case, table in (("dear", dear_feed), ("cheap", cheap_feed)):
        model = Eagle3Drafter.from_module(tiny_target, random_module("eagle3", tiny_target),
                                          rank_acc=[[0.9, 0.1], [0.9, 0.1]], draft_vocab_ids=RANKED)
        forwards[case] = []
        step = model.heads.step
        model.heads.step = lambda *args, _log=forwards[case], _step=step, **kwargs: _log.append(1) or _step(*args, **kwargs)
        drafter = HybridDrafter(tiny_target, sources="suffix,pld", model=model, model_per_token=0.05)
        (result,) = run(tiny_target, [prompt], drafter, 12, SamplingParams(), (), AutoBudget(table, max_budget=8)).finish()
        assert result.tokens == plain
        drafted[case] = result.stats.drafted_by_source
    assert drafted["dear"].get("eagle3", 0) == 0 and not forwards["dear"] and drafted["dear"].get("suffix", 0) > 0
    assert drafted["cheap"].get("eagle3", 0) > 0 and forwards["cheap"]


def test_the_model_s_slots_are_priced_at_its_measured_time(tiny_target):
    """Under --gamma auto the model's slots cost what its drafting measured inside the hybrid, in
    target steps of the cost table (DraftContext.step_ms), not what it states. The model is the
    oracle (always accepted, states it drafts for free, really runs the target per token): against
    a target whose steps the table says take 0.01 ms its measured node costs many steps and it
    drafts once, then the free matches alone; against one whose steps take 100 s it is nearly free
    and drafts every step. Output = plain each time."""
    from specdec.budget import AutoBudget
    from specdec.cost import CostTable
    from specdec.loop import run

    ks = [1, 2, 4, 8, 16, 64]
    step_ms = [100.0, 101.0, 103.0, 107.0, 115.0, 170.0]
    prompt = [20, 21] * 8
    plain = generate(tiny_target, prompt, None, max_new_tokens=16).tokens
    drafted, measured = {}, {}
    for case, scale in (("fast target", 1e-4), ("slow target", 1e3)):
        drafter = HybridDrafter(tiny_target, sources="suffix,pld", model=make_drafter("oracle", tiny_target, gamma=4))
        assert drafter.cost.per_token == 0.0  # the stated price: the prior
        sequences = []  # the request's own copy: it measures the model in this request
        for_sequence = drafter.for_sequence
        drafter.for_sequence = lambda: sequences.append(for_sequence()) or sequences[-1]
        table = CostTable({}, ks, [scale * ms for ms in step_ms])
        (result,) = run(tiny_target, [prompt], drafter, 16, SamplingParams(), (), AutoBudget(table, max_budget=8)).finish()
        assert result.tokens == plain
        drafted[case] = result.stats.drafted_by_source.get("oracle", 0)
        measured[case] = (sequences, table.t(1))
    assert 1 <= drafted["fast target"] <= 4  # one step of the model, then never again
    assert drafted["slow target"] >= 8
    prices = {case: sequence.model_timing.ms_per_node() / step for case, ((sequence,), step) in measured.items()}
    assert prices["fast target"] > 1.0 > 1e-3 > prices["slow target"]


def test_a_model_priced_out_is_tried_again_after_some_steps(tiny_target):
    """A model whose estimate fell below its price (here: random tokens, never accepted, priced at
    0.3 target steps) stops drafting; its tracker forgets a little on every step it sits out, so it
    is tried again some steps later instead of never for the rest of the request. Output = plain."""
    prompt = [5, 6, 7, 8]
    plain = generate(tiny_target, prompt, None, max_new_tokens=48).tokens
    drafter = HybridDrafter(tiny_target, sources="", model=make_drafter("random", tiny_target, gamma=4), model_per_token=0.3)
    result = generate(tiny_target, prompt, drafter, max_new_tokens=48)
    assert result.tokens == plain
    assert result.stats.accepted_by_source.get("random", 0) == 0
    # before the first drop: 2 + 1 + 1 nodes (estimates 0.6 / 0.4 / 0.304 at depth 1, then 0.247 < 0.3)
    assert result.stats.drafted_by_source["random"] > 4, result.stats.drafted_by_source
