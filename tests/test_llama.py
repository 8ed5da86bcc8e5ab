"""Native runtime vs transformers, KV cache semantics, tree masks, ragged batches (tiny random models)."""

import pytest
import torch
from conftest import assert_close_to_scale

from specdec.models.llama import load_native

MODEL_TYPES = ("llama", "qwen2", "qwen3")


def _full_forward(target, ids):
    cache = target.new_cache(1, 128)
    tokens = torch.tensor([ids])
    logits, _ = target.forward(tokens, torch.arange(len(ids))[None], cache)
    return logits[0]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_native_logits_match_transformers(tiny_dirs, model_type):
    hf_dir, hf_model = tiny_dirs[model_type]
    target = load_native(hf_dir)
    ids = torch.randint(0, target.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(ids, output_hidden_states=True)
    cache = target.new_cache(2, 64)
    logits, hiddens = target.forward(ids, torch.arange(11).expand(2, -1), cache, hidden_layers=(0, 2, target.num_layers))
    assert_close_to_scale(logits, ref.logits, what="logits")
    for layer, hidden in hiddens.items():
        assert_close_to_scale(hidden, ref.hidden_states[layer], what=f"hidden {layer}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_incremental_decoding_equals_full_recompute(tiny_dirs, model_type):
    target = load_native(tiny_dirs[model_type][0])
    ids = list(range(3, 19))
    full = _full_forward(target, ids)
    cache = target.new_cache(1, 64)
    target.forward(torch.tensor([ids[:5]]), torch.arange(5)[None], cache)
    rows = []
    for pos in range(5, len(ids)):  # one token at a time, then a block of 3
        logits, _ = target.forward(torch.tensor([[ids[pos]]]), torch.tensor([[pos]]), cache)
        rows.append(logits[0, -1])
    assert_close_to_scale(torch.stack(rows), full[5:])
    assert int(cache.lengths[0]) == len(ids)


def test_truncate_and_keep_continue_like_fresh(tiny_target):
    target = tiny_target
    prefix = [5, 9, 17, 3, 22]
    cache = target.new_cache(1, 64)
    target.forward(torch.tensor([prefix]), torch.arange(5)[None], cache)
    # write 4 junk tokens, roll back, continue: must equal a fresh run on prefix + [40]
    target.forward(torch.tensor([[60, 61, 62, 63]]), torch.arange(5, 9)[None], cache)
    cache.truncate(5)
    logits, _ = target.forward(torch.tensor([[40]]), torch.tensor([[5]]), cache)
    fresh = _full_forward(target, prefix + [40])
    assert_close_to_scale(logits[0, -1], fresh[-1])
    # keep: a block [a, b, c, d] written as a tree where only a and c (offsets 0, 2) survive
    cache.truncate(5)
    block = torch.tensor([[40, 41, 42, 43]])
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]], dtype=torch.bool)
    target.forward(block, torch.tensor([[5, 6, 6, 6]]), cache, attn_mask=tree)
    cache.keep(0, 5, [0, 2])
    logits, _ = target.forward(torch.tensor([[50]]), torch.tensor([[7]]), cache)
    fresh = _full_forward(target, prefix + [40, 42, 50])
    assert_close_to_scale(logits[0, -1], fresh[-1])


def test_tree_mask_matches_sequential_paths(tiny_target):
    target = tiny_target
    prefix = [7, 8, 9, 10]
    # root r=11, children a=20, b=21; a has children c=30, d=31; b has child e=32
    nodes = [11, 20, 21, 30, 31, 32]
    parents = [-1, 0, 0, 1, 1, 2]
    depth = [0, 1, 1, 2, 2, 2]
    n = len(nodes)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    cache = target.new_cache(1, 64)
    target.forward(torch.tensor([prefix]), torch.arange(4)[None], cache)
    positions = torch.tensor([[4 + d for d in depth]])
    logits, _ = target.forward(torch.tensor([nodes]), positions, cache, attn_mask=mask[None])
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.insert(0, nodes[j])
            j = parents[j]
        expect = _full_forward(target, prefix + path)[-1]
        assert_close_to_scale(logits[0, i], expect, what=f"node {i}")


def test_ragged_batch_equals_each_alone(tiny_target):
    target = tiny_target
    prompts = [[3, 4, 5], [10, 11, 12, 13, 14, 15, 16], [40, 41, 42, 43, 44]]
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    padded = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    cache = target.new_cache(3, 64)
    logits, _ = target.forward(padded, torch.arange(width).expand(3, -1), cache)
    cache.truncate(torch.tensor(lengths))
    nxt = torch.tensor([[60], [61], [62]])
    step, _ = target.forward(nxt, torch.tensor(lengths)[:, None], cache)
    for row, prompt in enumerate(prompts):
        alone = _full_forward(target, prompt + [60 + row])
        assert_close_to_scale(logits[row, lengths[row] - 1], alone[-2], what=f"prompt row {row}")
        assert_close_to_scale(step[row, 0], alone[-1], what=f"step row {row}")


def test_skipping_padding_rows_changes_nothing_real(tiny_target):
    """token_valid: the real tokens' logits, hiddens and cache entries equal the padded forward's."""
    target = tiny_target
    prompts = [[3, 4, 5], [10, 11, 12, 13, 14, 15, 16], [40, 41, 42, 43, 44]]
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    padded = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts])
    valid = torch.arange(width)[None, :] < lengths[:, None]  # [3, T]
    results = []
    for token_valid in (None, valid):
        cache = target.new_cache(3, 64)
        logits, hiddens = target.forward(padded, torch.arange(width).expand(3, -1), cache, hidden_layers=(1,),
                                         token_valid=token_valid)
        results.append((logits, hiddens[1], cache))
    (full_logits, full_hidden, full_cache), (packed_logits, packed_hidden, packed_cache) = results
    assert_close_to_scale(packed_logits[valid], full_logits[valid], what="logits")
    assert_close_to_scale(packed_hidden[valid], full_hidden[valid], what="hidden")
    assert (packed_logits[~valid] == 0).all()  # padding was not computed
    for row, length in enumerate(lengths.tolist()):
        assert_close_to_scale(packed_cache.keys[0][row, :, :length], full_cache.keys[0][row, :, :length], what=f"keys row {row}")


def test_cache_overflow_is_a_clear_error(tiny_target):
    cache = tiny_target.new_cache(1, 4)
    with pytest.raises(ValueError, match="KV cache overflow"):
        tiny_target.forward(torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(5)[None], cache)


def test_bf16_runs_and_is_close(tiny_dirs):
    fp32 = load_native(tiny_dirs["llama"][0])
    bf16 = load_native(tiny_dirs["llama"][0], dtype="bfloat16")
    ids = [4, 8, 15, 16, 23, 42]
    a, b = _full_forward(fp32, ids), _full_forward(bf16, ids)
    assert b.dtype == torch.float32
    assert (a.softmax(-1) - b.softmax(-1)).abs().max() < 0.05


def test_inference_rms_norm_and_swiglu_give_the_training_paths_bits():
    """rms_norm and SiLU x up take in-place shortcuts in fp32 inference; they compute the same
    torch ops, so the same bits as the autograd path (which keeps the original expressions)."""
    import torch.nn.functional as F

    from specdec.models.llama import rms_norm

    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(2, 8, 1536, generator=generator) * 4, torch.rand(1536, generator=generator) + 0.5
    with torch.inference_mode():
        fast = rms_norm(x, weight, 1e-6)
    with torch.enable_grad():
        reference = rms_norm(x, weight.clone().requires_grad_(True), 1e-6)
    assert torch.equal(fast, reference.detach())

    gate, up = torch.randn(2, 8, 8960, generator=generator), torch.randn(2, 8, 8960, generator=generator)
    assert torch.equal(F.silu(gate).mul_(up), F.silu(gate) * up)
