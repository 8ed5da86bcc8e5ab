"""Lookahead decoding drafter: lossless greedy and sampled output, pool hits, both logits paths."""

import pytest
import torch
from scipy.stats import chisquare

from conftest import make_tiny_hf_dir
from specdec import SamplingParams, generate, generate_batch, make_drafter
from specdec.drafters.base import DraftContext
from specdec.drafters.lookahead import LookaheadDrafter
from specdec.models.llama import load_native
from specdec.sampling import warp_logits_to_probs
from specdec.verify import VerifyResult, verify_tree


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "options,message",
    [
        ({"window_size": 0}, "window_size"),
        ({"window_size": 2.5}, "window_size"),
        ({"window_size": True}, "window_size"),
        ({"ngram_size": 1}, "ngram_size"),
        ({"ngram_size": 17}, "ngram_size"),
        ({"guess_set_size": -1}, "guess_set_size"),
        ({"context_ngrams": "yes"}, "context_ngrams"),
        ({"init_seed": None}, "init_seed"),
        ({"window_size": 1, "ngram_size": 2, "guess_set_size": 0}, "no draft nodes"),
    ],
)
def test_bad_options_are_clear_errors(tiny_target, options, message):
    with pytest.raises(ValueError, match=message):
        make_drafter("lookahead", tiny_target, **options)


def test_default_budget_is_the_full_draft_size(tiny_target):
    drafter = make_drafter("lookahead", tiny_target, window_size=4, ngram_size=3, guess_set_size=2)
    assert drafter.cost.block == (4 + 2) * (3 - 1) - 1 == drafter.max_draft_nodes
    assert drafter.cost.trees and drafter.wants_node_logits


# ---------------------------------------------------------------------------- draft structure
def test_window_columns_sit_at_their_depths_and_budget_is_respected(tiny_target):
    prompt = [5, 6, 7, 5, 6, 8, 5, 6, 9, 4, 5]
    drafter = LookaheadDrafter(tiny_target, window_size=3, ngram_size=4, guess_set_size=2)
    drafter.begin(prompt, tiny_target)
    ctx = DraftContext(list(prompt), len(prompt), SamplingParams())
    draft = drafter.propose(ctx, drafter.max_draft_nodes)
    assert len(draft) <= drafter.max_draft_nodes
    tokens, depths = draft.tokens.tolist(), draft.depths.tolist()
    # the verification branch comes first: the pool's newest continuation of the root 5 is (6, 9, 4)
    assert tokens[:3] == [6, 9, 4] and draft.parents.tolist()[:3] == [-1, 0, 1]
    # column i of the window ends at depth i + N - 2 and its root path spells level0[1..i], level1..[i]
    for column, node in enumerate(drafter.proposal.column_output_nodes):
        assert node is not None and depths[node] == column + drafter.ngram_size - 2
        path_tokens = [tokens[n] for n in draft.path_to(node)]
        assert path_tokens == drafter.levels[0][1 : column + 1] + [drafter.levels[j][column] for j in (1, 2)]
    small = drafter.propose(ctx, 2)
    assert small.tokens.tolist() == [6, 9]  # the best guess, cut to the budget


# ---------------------------------------------------------------------------- both logits paths
def _drive_greedy(target, prompt, drafter, steps, supply_node_logits):
    """A minimal single-sequence loop (one target forward per step) that can hand the drafter
    the verify forward's logits for every node, like a loop with the node-logits extension."""
    cache = target.new_cache(1, len(prompt) + steps * (drafter.max_draft_nodes + 2) + 2)
    logits, _ = target.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
    ctx = DraftContext(list(prompt), len(prompt), SamplingParams())
    first = int(logits[0, -1].argmax())
    ctx.tokens.append(first)
    drafter.begin(list(prompt), target)
    drafter.on_verified(VerifyResult([first], 0, []), ctx)  # the prefill's token
    proposals = []
    for _ in range(steps):
        draft = drafter.propose(ctx, drafter.max_draft_nodes)
        proposals.append((draft.tokens.tolist(), draft.parents.tolist()))
        start = int(cache.lengths[0])
        tokens = torch.tensor([[ctx.tokens[-1]] + draft.tokens.tolist()])  # [1, n + 1]
        node_logits, _ = target.forward(
            tokens, draft.positions(start)[None], cache, attn_mask=draft.tree_attention_mask()[None]
        )
        result = verify_tree(draft, warp_logits_to_probs(node_logits[0], ctx.sampling), None)
        cache.keep(0, start, [0] + [1 + node for node in result.path])
        ctx.tokens.extend(result.tokens)
        if supply_node_logits:
            ctx.all_node_logits = node_logits[0]  # [n + 1, V]
        drafter.on_verified(result, ctx)
    return ctx.output_tokens, proposals


def test_node_logits_from_the_verify_forward_drive_the_window(tiny_target):
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]
    steps = 12
    supplied = LookaheadDrafter(tiny_target, window_size=3, ngram_size=3, guess_set_size=2)
    out_supplied, proposals_supplied = _drive_greedy(tiny_target, prompt, supplied, steps, True)
    assert len({tuple(tokens) for tokens, _ in proposals_supplied}) > 1  # the window moves
    plain = generate(tiny_target, prompt, max_new_tokens=len(out_supplied)).tokens
    assert out_supplied == plain
    # a loop that does not hand over the node logits is a clear error, not a silent extra forward
    with pytest.raises(RuntimeError, match="all_node_logits"):
        _drive_greedy(tiny_target, prompt, LookaheadDrafter(tiny_target, window_size=3, ngram_size=3, guess_set_size=2), 2, False)


# ---------------------------------------------------------------------------- real model, greedy
@pytest.fixture(scope="module")
def plain_runs(smollm2):
    """prompt -> plain greedy Generation (computed once for the module)."""
    return {prompt: generate(smollm2, prompt, max_new_tokens=limit) for prompt, limit in SMOLLM_PROMPTS}


SMOLLM_PROMPTS = [
    ("Reply with just the word yes.", 40),  # ends with EOS before the limit
    ("Write the numbers from 1 to 30 separated by commas.", 32),  # repetitive; hits max_new_tokens
    ("Explain what a binary search tree is.", 24),
]


@pytest.mark.slow
def test_greedy_identical_to_plain_on_smollm2(smollm2, plain_runs):
    assert plain_runs[SMOLLM_PROMPTS[0][0]].finish_reason == "stop"
    assert plain_runs[SMOLLM_PROMPTS[1][0]].finish_reason == "length"
    for prompt, limit in SMOLLM_PROMPTS:
        spec = generate(smollm2, prompt, make_drafter("lookahead", smollm2), max_new_tokens=limit)
        plain = plain_runs[prompt]
        assert spec.tokens == plain.tokens, prompt
        assert spec.finish_reason == plain.finish_reason


@pytest.mark.slow
def test_batch_of_two_equals_each_alone(smollm2, plain_runs):
    prompts = [SMOLLM_PROMPTS[1][0], SMOLLM_PROMPTS[2][0]]
    drafter = make_drafter("lookahead", smollm2, window_size=4, ngram_size=3, guess_set_size=2)
    batch = generate_batch(smollm2, prompts, drafter, max_new_tokens=24)
    for prompt, spec in zip(prompts, batch):
        assert spec.tokens == plain_runs[prompt].tokens[:24], prompt


@pytest.mark.slow
def test_jacobi_pool_gets_hits_on_a_repetitive_prompt(smollm2, plain_runs):
    prompt, limit = SMOLLM_PROMPTS[1]
    # context_ngrams=False: every accepted token comes from n-grams the Jacobi window produced
    spec = generate(smollm2, prompt, make_drafter("lookahead", smollm2, context_ngrams=False), max_new_tokens=limit)
    assert spec.tokens == plain_runs[prompt].tokens
    assert spec.stats.accepted_tokens > 0
    assert spec.stats.steps < plain_runs[prompt].stats.steps


# ---------------------------------------------------------------------------- sampling: exact distribution
def _exact_first_three(target, prompt, eos_ids):
    """Exact probability of every possible output prefix of up to 3 tokens at temperature 1
    (a prefix ends early at EOS), from the tiny model's logits."""
    vocab = target.vocab_size
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V*V, 2]
    inputs = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], dim=1)  # [V*V, P + 2]
    cache = target.new_cache(len(pairs), inputs.shape[1])
    logits, _ = target.forward(inputs, torch.arange(inputs.shape[1]).expand(len(pairs), -1), cache)
    probs = torch.softmax(logits.double(), dim=-1)  # [V*V, P + 2, V]
    first = probs[0, len(prompt) - 1]  # [V]
    outcomes = {}
    for a in range(vocab):
        if a in eos_ids:
            outcomes[(a,)] = float(first[a])
            continue
        second = probs[a * vocab, len(prompt)]  # [V] after prompt + a
        for b in range(vocab):
            if b in eos_ids:
                outcomes[(a, b)] = float(first[a] * second[b])
                continue
            third = probs[a * vocab + b, len(prompt) + 1]  # [V] after prompt + a + b
            for c in range(vocab):
                outcomes[(a, b, c)] = float(first[a] * second[b] * third[c])
    return outcomes


def test_sampled_output_has_the_exact_target_distribution(tmp_path):
    hf_dir, _ = make_tiny_hf_dir(tmp_path / "tiny16", "llama", seed=3, vocab_size=16)
    target = load_native(hf_dir, name="tiny16")
    assert target.decode(target.encode_prompt("#$%")) == "#$%"  # the char tokenizer works at V = 16
    eos_ids = set(target.eos_token_ids)
    # a prompt made of the model's own continuation, so the pool and the window get hits
    prompt = [0, 5, 0, 14, 12, 9, 5, 0, 14, 12, 9, 5, 0]
    exact = _exact_first_three(target, prompt, eos_ids)
    assert abs(sum(exact.values()) - 1.0) < 1e-6
    runs = 3000
    drafter = make_drafter("lookahead", target, window_size=2, ngram_size=3, guess_set_size=2)
    # max_new_tokens leaves room for full drafts; only the first 3 tokens are compared
    results = generate_batch(
        target, [prompt] * runs, drafter, max_new_tokens=10,
        sampling=[SamplingParams(temperature=1.0, seed=seed) for seed in range(runs)],
    )
    assert sum(r.stats.accepted_tokens for r in results) > runs // 4  # drafts really got accepted
    counts = {}
    for result in results:
        key = tuple(result.tokens[:3])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= {k for k, p in exact.items() if p > 0}
    # chi-square over outcomes expected >= 5 times; the rest pooled into one cell
    big = [k for k, p in exact.items() if p * runs >= 5]
    observed = [counts.get(k, 0) for k in big]
    expected = [exact[k] * runs for k in big]
    observed.append(runs - sum(observed))
    expected.append(runs - sum(expected))
    assert len(big) >= 20
    assert chisquare(observed, expected).pvalue > 1e-3
