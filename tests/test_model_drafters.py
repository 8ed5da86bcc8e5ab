"""Model-based drafters (`small-model`, `layer-skip`): greedy exactness on SmolLM2, the sampled
path's output distribution on tiny models, draft-cache rollback, and bad input."""

import pytest
import torch
from conftest import _write_byte_tokenizer, make_tiny_hf_dir
from scipy.stats import chisquare

from specdec import SamplingParams, generate, generate_batch, make_drafter
from specdec.draft import Draft
from specdec.drafters.base import DraftContext
from specdec.drafters.layer_skip import LayerSkipDrafter
from specdec.drafters.small_model import SmallModelDrafter
from specdec.models.llama import load_native
from specdec.sampling import make_generator
from specdec.verify import VerifyResult

MAX_NEW = 24
PROMPTS = (
    "What is the capital of France? Answer in one word.",  # ends with EOS after ~8 tokens
    "Write a Python function that returns the sum of a list.",  # runs into max_new_tokens
)


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def smollm2_bf16():
    """SmolLM2 in bfloat16: same tokenizer as the fp32 target, different numerics (a real draft model)."""
    from specdec import load_target

    return load_target("smollm2-135m", dtype="bfloat16", progress=False)


@pytest.fixture(scope="module")
def plain_outputs(smollm2):
    outputs = [generate(smollm2, prompt, None, max_new_tokens=MAX_NEW).tokens for prompt in PROMPTS]
    assert len(outputs[0]) < MAX_NEW and len(outputs[1]) == MAX_NEW  # one EOS case, one length case
    return outputs


def _make_tiny_pair(root, vocab_size: int):
    """Tiny random target and draft llamas sharing a char tokenizer (different weights and depth)."""
    target_dir, _ = make_tiny_hf_dir(root / "target", "llama", seed=11, vocab_size=vocab_size)
    draft_dir, _ = make_tiny_hf_dir(root / "draft", "llama", seed=12, vocab_size=vocab_size, num_hidden_layers=2)
    return load_native(target_dir, name="tiny-target"), load_native(draft_dir, name="tiny-draft")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return _make_tiny_pair(tmp_path_factory.mktemp("model_drafters"), 16)


class CountingTarget:
    """A real Target wrapped to count draft forwards and the tokens fed to them."""

    def __init__(self, inner):
        self.inner = inner
        self.forwards = 0
        self.tokens_fed = 0
        self.calls: list[tuple[int, torch.Tensor | None]] = []  # (tokens fed, logits_at) per forward

    def __getattr__(self, attribute):
        return getattr(self.inner, attribute)

    def forward(self, tokens, positions, cache, attn_mask=None, hidden_layers=(), **options):
        self.forwards += 1
        self.tokens_fed += tokens.shape[1]
        self.calls.append((tokens.shape[1], options.get("logits_at")))
        return self.inner.forward(tokens, positions, cache, attn_mask=attn_mask, hidden_layers=hidden_layers, **options)


# ---------------------------------------------------------------------------- greedy exactness
def _greedy_results(target, drafter, tree: bool, max_new_tokens: int):
    """Chains run each prompt alone; trees run both prompts as one batch (which must equal each alone)."""
    if tree:
        return generate_batch(target, list(PROMPTS), drafter, max_new_tokens)
    return [generate(target, prompt, drafter, max_new_tokens=max_new_tokens) for prompt in PROMPTS]


@pytest.mark.parametrize("tree, context", [(False, 0), (True, 0), (False, 6)], ids=["chain", "tree-batch", "chain-context-6"])
def test_small_model_greedy_equals_plain(smollm2, smollm2_bf16, plain_outputs, tree, context):
    drafter = make_drafter("small-model", smollm2, draft_target=smollm2_bf16, tree=tree, tree_beam=2, context=context)
    results = _greedy_results(smollm2, drafter, tree, MAX_NEW)
    assert [result.tokens for result in results] == plain_outputs
    # a bf16 copy of the target agrees almost always: most drafts are accepted
    assert max(result.stats.tau for result in results) > 2.0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree-batch"])
def test_layer_skip_greedy_equals_plain(smollm2, plain_outputs, tree):
    # an untrained 4-block draft is rarely right, so keep it short: greedy of 16 tokens is a prefix of 24
    drafter = make_drafter("layer-skip", smollm2, num_layers=4, gamma=2, tree=tree, tree_nodes=4, tree_depth=2)
    results = _greedy_results(smollm2, drafter, tree, 16)
    assert [result.tokens for result in results] == [tokens[:16] for tokens in plain_outputs]


def test_padded_draft_head_is_sliced_to_the_shared_tokenizer(tmp_path, tiny_pair):
    """A draft whose embedding/head is padded past the tokenizer (24 rows, 16 tokens) still drafts exactly."""
    target, _ = tiny_pair
    draft_dir, _ = make_tiny_hf_dir(tmp_path / "padded", "llama", seed=13, vocab_size=24)
    _write_byte_tokenizer(draft_dir, 16)  # same 16-token tokenizer as the target
    padded = load_native(draft_dir)
    prompt = [0, 5, 9, 3, 7]
    expected = generate(target, prompt, None, max_new_tokens=12).tokens
    for tree in (False, True):
        drafter = make_drafter("small-model", target, draft_target=padded, tree=tree)
        assert generate(target, prompt, drafter, max_new_tokens=12).tokens == expected
    sampled = generate(target, prompt, make_drafter("small-model", target, draft_target=padded), max_new_tokens=12,
                       sampling=SamplingParams(temperature=1.0, seed=3))
    assert len(sampled.tokens) >= 1


# ---------------------------------------------------------------------------- sampling is lossless
def _exact_drafted_pair_distribution(target, prompt: list[int]) -> dict[tuple[int, int], float]:
    """Exact target distribution (temperature 1) of output tokens 2 and 3, with the first token
    summed out; an EOS ends the sequence (missing tokens are -1)."""
    vocab, eos_ids = target.vocab_size, target.eos_token_ids
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V*V, 2] (t1, t2)
    tokens = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], dim=1)  # [V*V, P+2]
    positions = torch.arange(tokens.shape[1]).expand(len(pairs), -1)
    logits, _ = target.forward(tokens, positions, target.new_cache(len(pairs), tokens.shape[1]))
    probs = torch.softmax(logits.double(), dim=-1).view(vocab, vocab, tokens.shape[1], vocab)  # [t1, t2, pos, V]
    first = probs[0, 0, len(prompt) - 1]  # [V] p(t1)
    second = probs[:, 0, len(prompt)]  # [t1, V] p(t2 | t1)
    third = probs[:, :, len(prompt) + 1]  # [t1, t2, V] p(t3 | t1, t2)
    live = torch.ones(vocab, dtype=torch.bool)
    live[eos_ids] = False  # t1 values after which generation continues
    exact = {(-1, -1): float(first[eos_ids].sum())}
    for t2 in range(vocab):
        if t2 in eos_ids:
            exact[(t2, -1)] = float((first[live] * second[live, t2]).sum())
            continue
        joint = (first[live, None] * second[live, t2, None] * third[live, t2]).sum(0)  # [V] over t3
        for t3 in range(vocab):
            exact[(t2, t3)] = float(joint[t3])
    return exact


def _drafted_pair_pvalue(target, drafter, prompt: list[int], runs: int) -> float:
    """Chi-square p-value of `runs` generations (temperature 1, one seed per row, gamma 2 so tokens
    2 and 3 are drafted and sampled) against the exact target distribution."""
    eos_ids = set(target.eos_token_ids)
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(runs)]
    results = generate_batch(target, [prompt] * runs, drafter, max_new_tokens=4, sampling=params, gamma=2)
    exact = _exact_drafted_pair_distribution(target, prompt)
    assert abs(sum(exact.values()) - 1.0) < 1e-9
    counts = dict.fromkeys(exact, 0)
    for result in results:
        out = result.tokens
        key = (-1, -1) if out[0] in eos_ids else (out[1], -1) if out[1] in eos_ids else (out[1], out[2])
        counts[key] += 1
    # cells expected below 5 are pooled, as the chi-square approximation needs
    big = [key for key in exact if exact[key] * runs >= 5]
    small = [key for key in exact if exact[key] * runs < 5]
    observed = [counts[key] for key in big] + [sum(counts[key] for key in small)]
    expected = [exact[key] * runs for key in big] + [sum(exact[key] for key in small) * runs]
    return float(chisquare(observed, expected).pvalue)


class MisreportsTemperatureDrafter(SmallModelDrafter):
    """WRONG on purpose: samples from q (temperature 1) but reports sqrt(q) renormalised, i.e. the
    draft distribution at temperature 2."""

    def propose(self, ctx, budget):
        draft = super().propose(ctx, budget)
        flattened = draft.draft_probs.sqrt()  # [N, V]
        return Draft(draft.tokens, draft.parents, flattened / flattened.sum(-1, keepdim=True))


class DropsUnlikelyTokensDrafter(SmallModelDrafter):
    """WRONG on purpose (non-anticipation): cuts the sampled chain before the first token whose own
    draft probability is below 0.3."""

    def propose(self, ctx, budget):
        draft = super().propose(ctx, budget)
        own = draft.draft_probs[torch.arange(len(draft)), draft.tokens]  # [N] q(x_i)
        keep = int((own >= 0.3).long().cumprod(0).sum())
        return Draft.chain(draft.tokens[:keep], draft.draft_probs[:keep])


def test_sampled_drafts_keep_the_target_distribution(tmp_path):
    # an 8-token vocabulary keeps the joint of two tokens small enough for a sharp chi-square test
    target, draft_model = _make_tiny_pair(tmp_path, 8)
    prompt = [0, 3, 4, 5]
    sampled_chain = SmallModelDrafter(target, draft_target=draft_model, gamma=2)
    assert _drafted_pair_pvalue(target, sampled_chain, prompt, runs=1500) > 1e-3
    top_k_tree = SmallModelDrafter(target, draft_target=draft_model, tree=True, tree_nodes=2, tree_depth=2)
    assert _drafted_pair_pvalue(target, top_k_tree, prompt, runs=600) > 1e-3
    # the same test catches lossy variants
    for wrong, runs in ((MisreportsTemperatureDrafter, 600), (DropsUnlikelyTokensDrafter, 1000)):
        assert _drafted_pair_pvalue(target, wrong(target, draft_target=draft_model, gamma=2), prompt, runs) < 1e-6


# ---------------------------------------------------------------------------- cache rollback
def _scripted_steps(drafter, target, prompt: list[int], sampling: SamplingParams, seed: int, check_fresh):
    """Drive propose/on_verified by hand with scripted rejections; after every step compare the
    next proposal with a fresh drafter's proposal for the same committed tokens."""
    ctx = DraftContext(list(prompt), len(prompt), sampling, make_generator(seed))
    drafter.begin(list(prompt), target)
    ctx.tokens.append(4)
    drafter.on_verified(VerifyResult([4], 0, []), ctx)
    for step in range(7):
        state = ctx.generator.get_state() if ctx.generator is not None else None
        draft = drafter.propose(ctx, 4)
        check_fresh(ctx, state, draft)
        path = draft.leaf_paths()[0]  # accept a prefix of the first root-to-leaf path
        num_accepted = step % (len(path) + 1)
        accepted = [int(draft.tokens[node]) for node in path[:num_accepted]]
        if num_accepted < len(path):  # a correction that differs from every candidate child
            rejected = {int(draft.tokens[c]) for c in draft.children(path[num_accepted - 1] if num_accepted else -1)}
            correction = next(t for t in range(2, target.vocab_size) if t not in rejected)
        else:
            correction = 6
        ctx.tokens.extend(accepted + [correction])
        drafter.on_verified(VerifyResult(accepted + [correction], num_accepted, path[:num_accepted]), ctx)
    return ctx


def _fresh_proposal(make, target, ctx: DraftContext, state):
    fresh = make().for_sequence()
    fresh.begin(ctx.tokens[: ctx.num_prompt_tokens], target)
    generator = None
    if state is not None:
        generator = torch.Generator()
        generator.set_state(state)
    fresh_ctx = DraftContext(list(ctx.tokens), ctx.num_prompt_tokens, ctx.sampling, generator)
    return fresh.propose(fresh_ctx, 4)


def _assert_same_draft(draft: Draft, fresh: Draft):
    assert draft.tokens.tolist() == fresh.tokens.tolist()
    assert draft.parents.tolist() == fresh.parents.tolist()
    assert (draft.draft_probs is None) == (fresh.draft_probs is None)
    if draft.draft_probs is not None:
        assert torch.allclose(draft.draft_probs, fresh.draft_probs, atol=1e-5)


@pytest.mark.parametrize("kind", ["small-model", "layer-skip"])
@pytest.mark.parametrize(
    "tree, beam, temperature",
    [(False, 1, 0.0), (False, 1, 1.0), (True, 1, 0.0), (True, 2, 0.0), (True, 2, 1.0)],
    ids=["chain", "sampled", "tree-beam1", "tree-beam2", "tree-beam2-t1"],
)
def test_draft_cache_rolls_back_like_a_fresh_drafter(tiny_pair, kind, tree, beam, temperature):
    # beam 1 keeps the drafted path in the cache (a chain), beam 2 writes sibling branches
    target, draft_model = tiny_pair
    options = dict(tree=tree, tree_nodes=6, tree_depth=3, tree_topk=2, tree_beam=beam)
    if kind == "small-model":
        make = lambda: SmallModelDrafter(target, draft_target=draft_model, **options)  # noqa: E731
    else:
        make = lambda: LayerSkipDrafter(target, num_layers=2, **options)  # noqa: E731

    def check_fresh(ctx, state, draft):
        _assert_same_draft(draft, _fresh_proposal(make, target, ctx, state))

    ctx = _scripted_steps(make().for_sequence(), target, [0, 5, 9, 3, 7], SamplingParams(temperature, seed=1), 5, check_fresh)
    assert len(ctx.tokens) > 12


@pytest.mark.parametrize("beam", [1, 2])
def test_tree_children_are_the_draft_models_top_k_given_their_path(tiny_pair, beam):
    """Every expanded node's children are the draft model's best tokens after that node's own path
    (checked against a fresh causal forward): the tree mask hides sibling branches."""
    target, draft_model = tiny_pair
    drafter = SmallModelDrafter(target, draft_target=draft_model, tree=True, tree_depth=4, tree_topk=3, tree_beam=beam)
    drafter = drafter.for_sequence()
    prompt = [0, 5, 9, 3, 7, 4]
    drafter.begin(prompt, target)
    ctx = DraftContext(list(prompt), len(prompt), SamplingParams())
    draft = drafter.propose(ctx, 12)
    assert len(draft) == 12 and int(draft.depths.max()) >= 3
    expanded = 0
    for node in range(-1, len(draft)):
        children = draft.children(node)
        if not children:
            continue
        path = [] if node < 0 else [int(draft.tokens[n]) for n in draft.path_to(node)]
        sequence = prompt + path
        logits, _ = draft_model.forward(torch.tensor([sequence]), torch.arange(len(sequence))[None],
                                        draft_model.new_cache(1, len(sequence)))
        best = torch.topk(logits[0, -1], len(children)).indices.tolist()
        assert [int(draft.tokens[child]) for child in children] == best
        expanded += 1
    assert expanded >= (4 if beam == 2 else 3)


def test_chain_drafting_feeds_each_token_once(tiny_pair):
    """One draft forward per drafted token; after a rejection only the correction is fed, after a
    full acceptance only the last draft token and the bonus (no re-feeding of cached tokens)."""
    target, draft_model = tiny_pair
    counting = CountingTarget(draft_model)
    drafter = SmallModelDrafter(target, draft_target=counting, gamma=4).for_sequence()
    prompt = [0, 5, 9, 3, 7]
    ctx = DraftContext(list(prompt), len(prompt), SamplingParams())
    drafter.begin(prompt, target)
    ctx.tokens.append(4)
    drafter.on_verified(VerifyResult([4], 0, []), ctx)
    draft = drafter.propose(ctx, 4)  # the first sync feeds the whole prompt + first token at once
    assert counting.forwards == 4 and counting.tokens_fed == len(ctx.tokens) + 3
    # ... and runs the LM head on its last row only (the logits drafting starts from)
    assert [(fed, at.tolist()) for fed, at in counting.calls] == [(len(ctx.tokens), [len(ctx.tokens) - 1])] + [(1, [0])] * 3
    for num_accepted in (0, 4, 2, 4, 1):
        accepted = draft.tokens[:num_accepted].tolist()
        # bonus after a full acceptance; else a correction that differs from the rejected token
        last = 6 if num_accepted == 4 else (int(draft.tokens[num_accepted]) + 1) % target.vocab_size
        ctx.tokens.extend(accepted + [last])
        drafter.on_verified(VerifyResult(accepted + [last], num_accepted, list(range(num_accepted))), ctx)
        forwards_before, fed_before = counting.forwards, counting.tokens_fed
        draft = drafter.propose(ctx, 4)
        assert counting.forwards - forwards_before == 4
        assert counting.tokens_fed - fed_before == (2 if num_accepted == 4 else 1) + 3


def test_a_context_window_bounds_what_the_draft_model_reads(tiny_pair):
    """With context=4 a 12-token prompt costs the draft model a 4-token prefill, and its drafts are
    what it drafts when the window is all it was ever shown; short catch-ups extend the window,
    a catch-up longer than it restarts at the last 4 tokens."""
    target, draft_model = tiny_pair
    counting = CountingTarget(draft_model)
    drafter = SmallModelDrafter(target, draft_target=counting, gamma=3, context=4).for_sequence()
    prompt = [0, 5, 9, 3, 7, 4, 1, 8, 2, 6, 5, 3]
    ctx = DraftContext(list(prompt), len(prompt), SamplingParams())
    drafter.begin(prompt, target)
    assert drafter.catch_up_tokens(ctx) == 4
    draft = drafter.propose(ctx, 3)
    assert counting.tokens_fed == 4 + 2  # the window, then one token per further draft position

    def window_only_draft(committed):
        alone = SmallModelDrafter(target, draft_target=draft_model, gamma=3).for_sequence()
        alone.begin(committed, target)
        return alone.propose(DraftContext(list(committed), len(committed), SamplingParams()), 3)

    assert draft.tokens.tolist() == window_only_draft(prompt[-4:]).tokens.tolist()
    accepted = draft.tokens[:2].tolist()
    ctx.tokens.extend(accepted + [(int(draft.tokens[2]) + 1) % target.vocab_size])
    drafter.on_verified(VerifyResult(ctx.tokens[-3:], 2, [0, 1]), ctx)
    assert drafter.catch_up_tokens(ctx) == 1  # the correction: the window grows with the sequence
    draft = drafter.propose(ctx, 3)
    assert draft.tokens.tolist() == window_only_draft(ctx.tokens[len(prompt) - 4:]).tokens.tolist()
    ctx.tokens.extend([1, 2, 3, 4, 5, 6])  # six tokens the drafter never saw (other drafters' steps)
    assert drafter.catch_up_tokens(ctx) == 4
    fed_before = counting.tokens_fed
    draft = drafter.propose(ctx, 3)
    assert counting.tokens_fed - fed_before == 4 + 2
    assert draft.tokens.tolist() == window_only_draft(ctx.tokens[-4:]).tokens.tolist()


# ---------------------------------------------------------------------------- bad input
def test_incompatible_tokenizer_is_a_clear_error(tmp_path, tiny_pair):
    target, _ = tiny_pair
    other_dir, _ = make_tiny_hf_dir(tmp_path / "other", "llama", seed=3, vocab_size=20)
    with pytest.raises(ValueError, match="tokenizer"):
        make_drafter("small-model", target, draft_target=load_native(other_dir))


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(layers=[0, 5]), "out of range"),
        (dict(layers=[1, 0]), "increasing"),
        (dict(layers=[1, 1]), "increasing"),
        (dict(layers=[]), "at least one"),
        (dict(num_layers=0), "num_layers"),
        (dict(num_layers=4), "num_layers"),
        (dict(num_layers=1, layers=[0]), "either"),
        (dict(gamma=0), "gamma"),
        (dict(tree=True, tree_topk=0), "tree_topk"),
        (dict(context=-1), "context"),
    ],
)
def test_invalid_layer_skip_options_are_clear_errors(tiny_pair, options, message):
    target, _ = tiny_pair  # 3 blocks
    with pytest.raises(ValueError, match=message):
        make_drafter("layer-skip", target, **options)


def test_layer_skip_needs_a_native_target(tiny_pair):
    target, _ = tiny_pair
    from specdec.models.hf import HFTarget

    hf_target = HFTarget.from_dir(target.model_dir)
    with pytest.raises(ValueError, match="layer_ids"):
        make_drafter("layer-skip", hf_target)
    # small-model only needs the Target contract: a transformers-backed draft model works
    drafter = make_drafter("small-model", target, draft_target=hf_target)
    prompt = [0, 5, 9, 3, 7]
    assert generate(target, prompt, drafter, max_new_tokens=8).tokens == generate(target, prompt, None, max_new_tokens=8).tokens
