"""The small-model drafter over a reduced draft vocabulary (`draft_vocab=N`): the draft model's LM
head computes only the frequent tokens' rows, q is exactly the warped softmax over them (zero
elsewhere), greedy equals plain and sampling keeps the target's distribution."""

import pytest
import torch
from test_model_drafters import PROMPTS, _drafted_pair_pvalue, _make_tiny_pair
from test_quant_model import quantized_gguf  # noqa: F401  (the fixture: tiny quantized GGUFs)

from specdec import SamplingParams, generate, generate_batch, make_drafter
from specdec.drafters.base import DraftContext
from specdec.drafters.small_model import SmallModelDrafter, frequent_token_ids, reduced_lm_head
from specdec.sampling import make_generator


def test_frequent_tokens_are_the_lowest_ids_plus_the_end_of_text():
    assert frequent_token_ids(100, 5, [99, 2]).tolist() == [0, 1, 2, 3, 4, 99]
    assert frequent_token_ids(100, 100, [99]) is None  # the whole vocabulary: no reduction


def test_the_reduced_head_computes_the_full_heads_rows(tmp_path):
    target, _ = _make_tiny_pair(tmp_path, 16)
    ids = torch.tensor([0, 3, 7, 15])
    head = target.model.lm_head
    reduced = reduced_lm_head(head, ids)
    assert type(reduced) is type(head) and reduced.weight.shape == (4, head.in_features)
    hidden = torch.randn(3, head.in_features, generator=torch.Generator().manual_seed(0))  # [3, H]
    with torch.no_grad():
        full = head(hidden)  # [3, V]
        assert torch.allclose(reduced(hidden), full[:, ids], rtol=1e-5, atol=1e-6 * float(full.abs().max()))
    tokens = torch.tensor([[0, 5, 9, 3]])
    positions = torch.arange(4)[None]
    logits, _ = target.forward(tokens, positions, target.new_cache(1, 8))
    cut, _ = target.forward(tokens, positions, target.new_cache(1, 8), lm_head=reduced)
    assert cut.shape == (1, 4, 4) and torch.allclose(cut, logits[..., ids], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_drafts_come_from_the_draft_vocabulary_with_exact_rows(tmp_path, tree):
    target, draft_model = _make_tiny_pair(tmp_path, 16)
    drafter = SmallModelDrafter(target, draft_target=draft_model, draft_vocab=6, tree=tree, tree_nodes=6, tree_topk=2)
    allowed = drafter.token_ids.tolist()
    assert allowed == [0, 1, 2, 3, 4, 5] or set(range(6)) < set(allowed)  # + the end-of-text ids
    full = SmallModelDrafter(target, draft_target=draft_model)
    assert drafter.cost.per_token < full.cost.per_token  # fewer LM-head rows are read
    prompt = [0, 5, 9, 3, 7, 5, 9, 3, 7, 5, 9]
    plain = generate(target, prompt, None, max_new_tokens=16).tokens
    assert generate(target, prompt, drafter, max_new_tokens=16).tokens == plain
    seq = drafter.for_sequence()
    seq.begin(prompt, target)
    ctx = DraftContext(list(prompt), len(prompt), SamplingParams(temperature=1.0), make_generator(4))
    for _ in range(5):
        draft = seq.propose(ctx, 4)
        assert set(draft.tokens.tolist()) <= set(allowed)
        outside = torch.ones(16, dtype=torch.bool)
        outside[allowed] = False
        assert float(draft.draft_probs[:, outside].abs().sum()) == 0.0
        assert torch.allclose(draft.draft_probs.sum(-1), torch.ones(len(draft)), atol=1e-5)
        ctx.tokens.append(int(draft.tokens[0]))


def test_sampling_over_the_draft_vocabulary_keeps_the_target_distribution(tmp_path):
    target, draft_model = _make_tiny_pair(tmp_path, 8)
    drafter = SmallModelDrafter(target, draft_target=draft_model, gamma=2, draft_vocab=4)
    assert _drafted_pair_pvalue(target, drafter, [0, 3, 4, 5], runs=1500) > 1e-3


def test_bad_draft_vocab_is_a_clear_error(tmp_path):
    target, draft_model = _make_tiny_pair(tmp_path, 16)
    with pytest.raises(ValueError, match="draft_vocab"):
        SmallModelDrafter(target, draft_target=draft_model, draft_vocab=-1)


@pytest.fixture(scope="module")
def smollm2_bf16():
    from specdec import load_target

    return load_target("smollm2-135m", dtype="bfloat16", progress=False)


@pytest.mark.slow
def test_greedy_equals_plain_on_smollm2(smollm2, smollm2_bf16):
    plain = [generate(smollm2, prompt, None, max_new_tokens=24).tokens for prompt in PROMPTS]
    drafter = make_drafter("small-model", smollm2, draft_target=smollm2_bf16, draft_vocab=8192)
    results = generate_batch(smollm2, list(PROMPTS), drafter, max_new_tokens=24)
    assert [result.tokens for result in results] == plain
    assert max(result.stats.tau for result in results) > 1.5  # the frequent tokens still carry most drafts


def test_a_quantized_head_keeps_its_blocks_in_the_same_kernel(quantized_gguf):
    """A GGUF head (tied to the embedding's blocks for llama, its own for qwen2): the draft
    vocabulary's rows stay blocks of the same type, and their logits are the full head's columns."""
    from conftest import skip_without_kernel

    from specdec.kernels import GGUFLinear
    from specdec.models.llama import load_native

    skip_without_kernel()
    _, _, model_dir = quantized_gguf
    target = load_native(model_dir)
    head = target.model.lm_head
    ids = torch.tensor([0, 2, 3, 17, 40])
    reduced = reduced_lm_head(head, ids)
    assert isinstance(reduced, GGUFLinear) and reduced.ggml_type == head.ggml_type and reduced.weight.dtype == torch.uint8
    tokens, positions = torch.tensor([[5, 6, 7, 8]]), torch.arange(4)[None]
    logits, _ = target.forward(tokens, positions, target.new_cache(1, 8))
    cut, _ = target.forward(tokens, positions, target.new_cache(1, 8), lm_head=reduced)
    assert torch.allclose(cut, logits[..., ids], rtol=1e-5, atol=1e-5)


def test_the_draft_model_runs_in_the_targets_block_mode(quantized_gguf):
    """A gguf-a8 target drafts with a gguf-a8 draft model (the same kernel path), a dense target with
    the draft model as stored; `draft_weights` overrides; greedy still equals plain."""
    from conftest import skip_without_kernel

    from specdec.models.llama import load_native

    skip_without_kernel()
    _, _, model_dir = quantized_gguf
    a8, dense = load_native(model_dir, weights="gguf-a8"), load_native(model_dir, weights="fp32")
    drafter = SmallModelDrafter(a8, draft_model=str(model_dir), gamma=3)
    assert drafter.draft_target.weights == "gguf-a8"
    assert SmallModelDrafter(dense, draft_model=str(model_dir)).draft_target.weights == "gguf"
    assert SmallModelDrafter(a8, draft_model=str(model_dir), draft_weights="gguf").draft_target.weights == "gguf"
    with pytest.raises(ValueError, match="draft_weights goes with draft_model"):
        SmallModelDrafter(a8, draft_target=dense, draft_weights="gguf")
    prompt = [3, 5, 7, 9, 11, 13]
    plain = generate(a8, prompt, None, max_new_tokens=16).tokens
    result = generate(a8, prompt, drafter, max_new_tokens=16)
    assert result.tokens == plain and result.stats.drafted_tokens > 0
