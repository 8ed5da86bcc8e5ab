"""Copy / retrieval drafters: pld, suffix, rest (+ the suffix-array datastore).

Unit tests check the matching on crafted and random token sequences against brute force; the
end-to-end tests check on SmolLM2 that greedy output equals plain greedy decoding token for
token (chain and tree), that a batch of 2 equals each prompt alone, that seeded sampling is
reproducible, and that copy-heavy prompts really get drafts accepted.
"""

import argparse
import json
import random

import numpy as np
import pytest

import specdec
from specdec.datastore import (
    SEPARATOR,
    Datastore,
    DatastoreError,
    add_datastore_arguments,
    build_datastore,
    build_suffix_array,
    run_datastore,
    write_datastore,
)
from specdec.drafters.base import DraftContext
from specdec.drafters.pld import PromptLookupDrafter
from specdec.drafters.suffix import NgramTrie, SuffixDrafter
from specdec.sampling import SamplingParams

GREEDY = SamplingParams()

# ----------------------------------------------------------------------------- helpers


def ctx_of(tokens, num_prompt_tokens=None):
    return DraftContext(list(tokens), len(tokens) if num_prompt_tokens is None else num_prompt_tokens, GREEDY)


def propose_for(drafter, tokens, budget):
    """Start a sequence whose prompt is `tokens` and draft once."""
    drafter.begin(list(tokens), None)
    return drafter.propose(ctx_of(tokens), budget)


def brute_force_pld(tokens, max_ngram, min_ngram, budget):
    """Reference: longest suffix n-gram first, its most recent earlier occurrence, overlapping copy."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # end = index right after the occurrence
            if tokens[end - n : end] == suffix:
                out = []
                for i in range(budget):
                    out.append(tokens[end + i] if end + i < len(tokens) else out[i - (len(tokens) - end)])
                return out
    return []


# ----------------------------------------------------------------------------- pld


def test_pld_prefers_longest_then_most_recent_match():
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    # "1 2 3" occurs at the start (followed by 40 41); "2 3" alone occurs later (followed by 50 51)
    tokens = [1, 2, 3, 40, 41, 9, 2, 3, 50, 51, 8, 1, 2, 3]
    assert propose_for(drafter, tokens, 2).tokens.tolist() == [40, 41]
    # two occurrences of the same 3-gram: the most recent one wins
    tokens = [1, 2, 3, 40, 41, 9, 1, 2, 3, 60, 61, 8, 1, 2, 3]
    assert propose_for(drafter, tokens, 2).tokens.tolist() == [60, 61]
    # a match running into the present keeps copying periodically (a repetition loop)
    tokens = [7, 1, 2, 3, 1, 2, 3]
    assert propose_for(drafter, tokens, 7).tokens.tolist() == [1, 2, 3, 1, 2, 3, 1]
    # nothing recurs -> empty draft
    assert len(propose_for(drafter, [1, 2, 3, 4], 4)) == 0


def test_pld_min_ngram_excludes_short_matches():
    tokens = [5, 6, 7, 9, 6]  # only the 1-gram "6" recurs
    assert propose_for(PromptLookupDrafter(min_ngram=1), tokens, 2).tokens.tolist() == [7, 9]
    assert len(propose_for(PromptLookupDrafter(min_ngram=2), tokens, 2)) == 0


def test_bigram_proposes_what_followed_the_roots_latest_occurrence():
    from specdec.drafters.pld import BigramDrafter

    drafter = BigramDrafter()
    tokens = [5, 6, 7, 9, 6, 8, 3, 6]  # "6" was followed by 7, then (most recently) by 8
    assert drafter.cost.block == 1 and drafter.retrieval_source  # one node a step unless a policy asks more
    assert propose_for(drafter, tokens, 1).tokens.tolist() == [8]
    assert propose_for(drafter, tokens, 3).tokens.tolist() == [8, 3, 6]  # the copy runs on
    assert len(propose_for(drafter, [5, 6, 7, 9], 1)) == 0  # "9" never occurred before
    assert BigramDrafter(gamma=3).cost.block == 3
    with pytest.raises(ValueError, match="gamma"):
        BigramDrafter(gamma=0)


def test_pld_incremental_index_matches_brute_force():
    rng = random.Random(0)
    for trial in range(20):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 60))]
        drafter = PromptLookupDrafter(max_ngram=4, min_ngram=1 + trial % 2)
        prompt_len = max(1, len(tokens) // 3)
        drafter.begin(tokens[:prompt_len], None)
        ctx = ctx_of(tokens[:prompt_len])
        for token in tokens[prompt_len:]:  # commit tokens one step at a time, as the loop does
            ctx.tokens.append(token)
            drafter.on_verified(None, ctx)
            expected = brute_force_pld(ctx.tokens, 4, drafter.min_ngram, 5)
            assert drafter.propose(ctx, 5).tokens.tolist() == expected, ctx.tokens


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(min_ngram=0), "min_ngram"),
        (dict(max_ngram=17), "max_ngram"),
        (dict(min_ngram=3, max_ngram=2), "min_ngram"),
        (dict(max_ngram=2.5), "max_ngram"),
        (dict(gamma=0), "gamma"),
    ],
)
def test_pld_rejects_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        specdec.make_drafter("pld", **options)


# ----------------------------------------------------------------------------- suffix


def test_ngram_trie_counts_match_brute_force():
    rng = random.Random(1)
    tokens = [rng.randrange(3) for _ in range(300)]
    trie = NgramTrie(depth=5)
    active = trie.extend([], tokens[:100])
    trie.extend(active, tokens[100:])  # incremental extension == one pass
    for _ in range(50):
        n = rng.randrange(1, 6)
        gram = [rng.randrange(3) for _ in range(n)]
        expected = sum(tokens[i : i + n] == gram for i in range(len(tokens) - n + 1))
        node = trie.find(gram)
        assert (node.count if node else 0) == expected, gram
    assert trie.find([0, 1, 2, 0, 1, 2]) is None  # longer than the trie depth


def test_suffix_tree_ranks_continuations_by_frequency():
    # after "1 2 3": 4 three times, 5 once, 6 twice
    tokens = [1, 2, 3, 4, 0, 1, 2, 3, 6, 0, 1, 2, 3, 4, 0, 1, 2, 3, 5, 0, 1, 2, 3, 6, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    drafter = SuffixDrafter(max_match=3, min_match=1, max_depth=3, max_children=3, min_prob=0.0)
    draft = propose_for(drafter, tokens, 20)
    root_children = [int(draft.tokens[i]) for i in draft.children(-1)]
    assert root_children == [4, 6, 5]  # most frequent first: the order the verifier tries them
    assert max(draft.depths.tolist()) <= 3
    # best-first: the first node is the most probable, and "4 0" (prob 3/6) precedes "5" (1/6)
    paths = {tuple(int(draft.tokens[i]) for i in draft.path_to(node)): node for node in range(len(draft))}
    assert paths[(4,)] == 0 and paths[(4, 0)] < paths[(5,)]
    # budget, branching limit and a chain
    assert len(propose_for(drafter, tokens, 4)) == 4
    narrow = propose_for(SuffixDrafter(max_match=3, min_match=1, max_children=1, min_prob=0.0), tokens, 20)
    assert narrow.is_chain and narrow.tokens.tolist()[:3] == [4, 0, 1]
    chain = propose_for(SuffixDrafter(max_match=3, min_match=1, tree=False, max_depth=4), tokens, 8)
    assert chain.is_chain and chain.tokens.tolist() == [4, 0, 1, 2]
    # min_prob prunes unlikely branches: 5 (1/6) and 6 (2/6) fall below 0.4, 4 (3/6) stays
    pruned = propose_for(SuffixDrafter(max_match=3, min_match=1, min_prob=0.4), tokens, 20)
    assert [int(pruned.tokens[i]) for i in pruned.children(-1)] == [4]


def test_suffix_prefers_longest_match():
    # "2 3" -> 7 twice, but the longer context "9 2 3" -> 8 (once) is more specific
    tokens = [2, 3, 7, 2, 3, 7, 9, 2, 3, 8, 1, 9, 2, 3]
    draft = propose_for(SuffixDrafter(min_match=1, tree=False, min_prob=0.0), tokens, 2)
    assert draft.tokens.tolist() == [8, 1]


def run_sequence(drafter, prompt, output):
    """Drive one per-sequence copy of `drafter` through a prompt and committed output tokens."""
    sequence = drafter.for_sequence()
    sequence.begin(list(prompt), None)
    ctx = ctx_of(prompt)
    for token in output:
        ctx.tokens.append(token)
        sequence.on_verified(None, ctx)


def test_suffix_global_tree_is_shared_across_requests():
    shared = SuffixDrafter(min_match=2, tree=False)
    run_sequence(shared, [100, 101], [11, 12, 13, 14, 15])  # an earlier request's output
    assert propose_for(shared.for_sequence(), [200, 11, 12], 3).tokens.tolist() == [13, 14, 15]
    private = SuffixDrafter(min_match=2, tree=False, share_across_requests=False)
    run_sequence(private, [100, 101], [11, 12, 13, 14, 15])
    assert len(propose_for(private.for_sequence(), [200, 11, 12], 3)) == 0
    # prompts stay private even when sharing: only outputs enter the global trie
    prompts_only = SuffixDrafter(min_match=2, tree=False)
    run_sequence(prompts_only, [11, 12, 13, 14, 15], [])
    assert len(propose_for(prompts_only.for_sequence(), [200, 11, 12], 3)) == 0


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(min_match=0), "min_match"),
        (dict(max_match=33), "max_match"),
        (dict(max_depth=0), "max_depth"),
        (dict(max_children=0), "max_children"),
        (dict(min_prob=1.5), "min_prob"),
        (dict(tree="yes"), "tree"),
    ],
)
def test_suffix_rejects_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        specdec.make_drafter("suffix", **options)


# ----------------------------------------------------------------------------- datastore


def test_suffix_array_search_matches_brute_force():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, size=3000).astype(np.int32)
    tokens[rng.integers(0, 3000, size=30)] = SEPARATOR  # document boundaries
    depth = 8
    suffix_array = build_suffix_array(tokens, sorted_depth=depth)
    assert sorted(suffix_array.tolist()) == list(range(len(tokens)))
    # sorted by the first `depth` tokens (past-the-end sorts first, like Python list order)
    prefixes = [tokens[s : s + depth].tolist() for s in suffix_array]
    assert all(a <= b for a, b in zip(prefixes, prefixes[1:]))
    store = Datastore(tokens, suffix_array, {"sorted_depth": depth})
    as_list = tokens.tolist()
    for _ in range(200):
        n = int(rng.integers(1, depth + 1))
        pattern = rng.integers(0, 4, size=n).tolist()
        expected = [i for i in range(len(as_list) - n + 1) if as_list[i : i + n] == pattern]
        assert store.occurrences(pattern).tolist() == expected, pattern
    with pytest.raises(ValueError, match="pattern length"):
        store.find([0] * (depth + 1))


def test_rest_tree_from_crafted_datastore(tmp_path):
    # continuations of "1 2 3": 4 three times, 5 and 7 once; the longer "9 1 2 3" -> only 7
    documents = [[1, 2, 3, 4, 6], [1, 2, 3, 4, 6], [8, 1, 2, 3, 5], [1, 2, 3, 4, 0], [9, 1, 2, 3, 7]]
    tokens = np.array(sum(([*doc, SEPARATOR] for doc in documents), [])[:-1], dtype=np.int32)
    manifest = {"format_version": 1, "num_tokens": len(tokens), "sorted_depth": 8, "tokenizer": {}}
    write_datastore(tmp_path / "ds", tokens, build_suffix_array(tokens, 8), manifest)
    rest = specdec.make_drafter("rest", None, datastore=str(tmp_path / "ds"), min_suffix=1, max_suffix=8, min_prob=0.0)
    draft = rest.propose(ctx_of([0, 1, 2, 3]), 10)
    assert [int(draft.tokens[i]) for i in draft.children(-1)] == [4, 5, 7]  # most frequent first
    paths = {tuple(int(draft.tokens[i]) for i in draft.path_to(node)) for node in range(len(draft))}
    assert paths == {(4,), (4, 6), (4, 0), (5,), (7,)}  # continuations stop at document ends
    assert rest.propose(ctx_of([9, 1, 2, 3]), 10).tokens.tolist() == [7]  # the longest match wins
    assert len(rest.propose(ctx_of([42, 43]), 10)) == 0  # no match at all


AMAZON = (
    "The Amazon rainforest covers much of the Amazon basin of South America. It is home to millions of species of "
    "insects, plants, birds and other forms of life, and it plays a vital role in regulating the global climate."
)


CORPUS = """\
Here is the list, exactly as you wrote it: apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew, kiwis, lemons.
Sure! Here is the list: apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew, kiwis, lemons.
""" + AMAZON + "\n"


def copy_prompts():
    """Copy-heavy prompts: a list to repeat (ends with EOS), a text to copy and continue (hits
    max_new_tokens), and a short reply (EOS well before max_new_tokens)."""
    return [
        "Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew, kiwis, lemons.",
        "Copy the following text exactly, then continue it with three more paragraphs: " + AMAZON,
        "Reply with just the word yes.",
    ]


@pytest.fixture(scope="module")
def target(request):
    try:
        return request.getfixturevalue("smollm2")  # the lead's session fixture, when present
    except pytest.FixtureLookupError:
        return specdec.load_target("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def datastore_dir(target, tmp_path_factory):
    import collections
    import textwrap

    root = tmp_path_factory.mktemp("datastore")
    (root / "corpus.txt").write_text(CORPUS * 3)
    docs = [{"text": module.__doc__} for module in (json, collections, textwrap, argparse) if module.__doc__]
    (root / "docs.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n\n")
    files = [root / "corpus.txt", root / "docs.jsonl"]
    build_datastore(files, root / "store", target.tokenizer, "smollm2-135m", progress=False)
    return root / "store"


def test_datastore_build_and_lookup(target, datastore_dir):
    store = Datastore.open(datastore_dir)
    manifest = json.loads((datastore_dir / "manifest.json").read_text())
    assert manifest["num_tokens"] == len(store) > 100 and manifest["num_documents"] == 1 + 4
    assert manifest["tokenizer"]["vocab_size"] == len(target.tokenizer.get_vocab())
    assert int((np.asarray(store.tokens) == SEPARATOR).sum()) == manifest["num_documents"] - 1
    phrase = target.tokenizer(" cherries, dates, elderberries", add_special_tokens=False)["input_ids"]
    assert store.count(phrase) == 3 * 2  # twice per copy of CORPUS, three copies
    drafter = specdec.make_drafter("rest", target, datastore=str(datastore_dir), min_prob=0.0)
    context = target.tokenizer("Here is the list: apples, bananas,", add_special_tokens=False)["input_ids"]
    draft = drafter.propose(ctx_of(context), 4)
    expected = target.tokenizer(" cherries, dates", add_special_tokens=False)["input_ids"][:4]
    assert draft.is_chain and draft.tokens.tolist()[: len(expected)] == expected  # every occurrence agrees


def test_datastore_cli_builds_with_the_model_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text(CORPUS)
    parser = argparse.ArgumentParser()
    add_datastore_arguments(parser.add_subparsers(dest="command"))
    command = ["datastore", "build", str(tmp_path / "a.txt"), "-o", str(tmp_path / "ds"), "--model", "smollm2-135m"]
    args = parser.parse_args(command)
    assert args.func(args) == 0
    assert Datastore.open(tmp_path / "ds").manifest["tokenizer"]["model"] == "smollm2-135m"
    assert run_datastore(parser.parse_args(["datastore", "info", str(tmp_path / "ds")])) == 0


def test_datastore_errors(target, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DatastoreError, match="empty"):
        build_datastore([tmp_path / "empty.txt"], tmp_path / "ds", target.tokenizer, "smollm2-135m", progress=False)
    with pytest.raises(DatastoreError, match="does not exist"):
        specdec.make_drafter("rest", target, datastore=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="datastore"):
        specdec.make_drafter("rest", target)
    # an empty datastore directory (e.g. written by another tool) is refused on load
    empty_dir = tmp_path / "empty_store"
    empty_dir.mkdir()
    np.save(empty_dir / "tokens.npy", np.zeros(0, dtype=np.int32))
    np.save(empty_dir / "suffix_array.npy", np.zeros(0, dtype=np.int32))
    (empty_dir / "manifest.json").write_text(json.dumps({"format_version": 1, "num_tokens": 0, "tokenizer": {}}))
    with pytest.raises(DatastoreError, match="empty"):
        specdec.make_drafter("rest", target, datastore=str(empty_dir))


def test_datastore_built_with_another_tokenizer_is_refused(target, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(c): c - 31 for c in range(32, 127)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    char_tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    (tmp_path / "a.txt").write_text(CORPUS)
    build_datastore([tmp_path / "a.txt"], tmp_path / "chars", char_tokenizer, "chars", progress=False)
    with pytest.raises(DatastoreError, match="tokenizer"):
        specdec.make_drafter("rest", target, datastore=str(tmp_path / "chars"))
    with pytest.raises(ValueError, match="max_suffix"):
        specdec.make_drafter("rest", None, datastore=str(tmp_path / "chars"), max_suffix=65)


# ----------------------------------------------------------------------------- end to end on SmolLM2

MAX_NEW = 32


@pytest.fixture(scope="module")
def plain(target):
    """Plain greedy outputs of the three prompts (list -> EOS, copy+continue -> max_new_tokens, short -> EOS)."""
    outputs = [specdec.generate(target, prompt, None, max_new_tokens=MAX_NEW) for prompt in copy_prompts()]
    assert outputs[0].finish_reason == "stop" and outputs[1].finish_reason == "length"
    assert outputs[2].finish_reason == "stop" and len(outputs[2].tokens) < MAX_NEW
    return outputs


DRAFTER_CONFIGS = {
    "pld": ("pld", {}),
    "bigram": ("bigram", {}),
    "suffix-tree": ("suffix", {}),
    "suffix-chain": ("suffix", {"tree": False}),
    "rest-tree": ("rest", {}),
    "rest-chain": ("rest", {"tree": False}),
}


def make(config, target, datastore_dir):
    name, options = DRAFTER_CONFIGS[config]
    if name == "rest":
        options = {**options, "datastore": str(datastore_dir)}
    return specdec.make_drafter(name, target, **options)


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(DRAFTER_CONFIGS))
def test_greedy_equals_plain(config, target, datastore_dir, plain):
    drafter = make(config, target, datastore_dir)
    assert drafter.cost.trees == config.endswith("tree")
    for prompt, expected in zip(copy_prompts(), plain):
        result = specdec.generate(target, prompt, drafter, max_new_tokens=MAX_NEW)
        assert result.tokens == expected.tokens, (config, prompt)
        assert result.finish_reason == expected.finish_reason
        if prompt.startswith("Repeat"):  # copying: the drafts must actually be accepted
            assert result.stats.accepted_tokens > 0, config


@pytest.mark.slow
@pytest.mark.parametrize("config", ["pld", "suffix-tree", "rest-tree"])
def test_batch_of_two_equals_each_alone(config, target, datastore_dir, plain):
    prompts = copy_prompts()[:2]
    results = specdec.generate_batch(target, prompts, make(config, target, datastore_dir), max_new_tokens=MAX_NEW)
    assert [r.tokens for r in results] == [p.tokens for p in plain[:2]]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["pld", "suffix-tree", "rest-chain"])
def test_sampling_is_seeded_and_reproducible(config, target, datastore_dir):
    prompt = copy_prompts()[0]
    sampling = SamplingParams(temperature=0.8, seed=1234)
    runs = [
        specdec.generate(target, prompt, make(config, target, datastore_dir), max_new_tokens=16, sampling=sampling)
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert 0 < len(runs[0].tokens) <= 16
    assert all(0 <= t < target.vocab_size for t in runs[0].tokens)
