"""HFTarget (transformers fallback backend) against plain full recomputation.

Tiny random models only (no download): the llama / qwen2 dirs come from conftest's
`tiny_dirs`; a tiny Gemma3 text model exercises per-layer-type (sliding window) masks.
"""

import pytest
import torch
from conftest import assert_close_to_scale

from specdec.models.hf import HFTarget, parse_dtype


def full_logits(model, token_ids):
    """Reference: one forward over the whole sequence, no cache. [T, V]"""
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0].float()


def step(target, cache, token_ids, first_position, attn_mask=None, positions=None, hidden_layers=()):
    tokens = torch.tensor([token_ids])
    if positions is None:
        positions = torch.arange(first_position, first_position + len(token_ids))[None]
    return target.forward(tokens, positions, cache, attn_mask=attn_mask, hidden_layers=hidden_layers)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_target(request, tiny_dirs):
    model_dir, reference = tiny_dirs[request.param]
    return HFTarget.from_dir(model_dir, name=f"tiny-{request.param}"), reference


@pytest.fixture(scope="module")
def gemma_target():
    """Tiny Gemma3 text model with a 4-token sliding window on alternate layers."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(3)
    config = Gemma3TextConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=4, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.3)
    model.config._attn_implementation = "sdpa"
    return HFTarget(model, tokenizer=None, name="tiny-gemma3"), model


def test_contract_attributes(hf_target):
    target, reference = hf_target
    assert target.vocab_size == reference.config.vocab_size
    assert target.num_layers == reference.config.num_hidden_layers
    assert target.hidden_size == reference.config.hidden_size
    assert target.dtype == torch.float32
    assert target.tokenizer is not None and target.tokenizer.eos_token_id in target.eos_token_ids


def test_incremental_decoding_equals_full_recompute(hf_target):
    target, reference = hf_target
    sequence = [5, 17, 3, 44, 9, 60, 2, 31, 8, 12]
    expected = full_logits(reference, sequence)  # [T, V]
    cache = target.new_cache(batch_size=1, max_len=64)
    prefill, _ = step(target, cache, sequence[:4], 0)
    got = [prefill[0]]
    for position in range(4, len(sequence)):
        logits, _ = step(target, cache, [sequence[position]], position)
        got.append(logits[0])
    assert int(cache.lengths[0]) == len(sequence)
    assert_close_to_scale(torch.cat(got), expected)
    assert got[0].dtype == torch.float32


def test_truncate_then_continue_equals_fresh(hf_target):
    target, reference = hf_target
    prefix, rejected, continuation = [7, 1, 22, 40], [11, 12, 13], [50, 51]
    cache = target.new_cache()
    step(target, cache, prefix + rejected, 0)
    cache.truncate(len(prefix))
    assert cache.lengths.tolist() == [len(prefix)]
    logits, _ = step(target, cache, continuation, len(prefix))
    expected = full_logits(reference, prefix + continuation)[len(prefix):]
    assert_close_to_scale(logits[0], expected)
    cache.truncate(torch.tensor([2]))  # LongTensor[B] form
    assert cache.lengths.tolist() == [2]


def tree_inputs(prefix_len):
    """A 5-node tree under the last committed token: 0 -> {1, 2}, 1 -> {3}, 2 -> {4}.

    Returns (node tokens, parents, bool mask [1, N, N], positions [1, N])."""
    tokens = [30, 31, 32, 33, 34]
    parents = [-1, 0, 0, 1, 2]
    size = len(tokens)
    mask = torch.zeros(size, size, dtype=torch.bool)
    depth = []
    for node, parent in enumerate(parents):
        mask[node, node] = True
        if parent >= 0:
            mask[node] |= mask[parent]
        depth.append(0 if parent < 0 else depth[parent] + 1)
    positions = torch.tensor(depth)[None] + prefix_len
    return tokens, parents, mask[None], positions


def ancestors_path(node, parents):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def check_tree_and_keep(target, reference):
    prefix = [4, 8, 15, 16, 23, 42, 9]
    tokens, parents, mask, positions = tree_inputs(len(prefix))
    cache = target.new_cache()
    step(target, cache, prefix, 0)
    tree_logits, _ = step(target, cache, tokens, len(prefix), attn_mask=mask, positions=positions)
    # every node's logits = a plain sequential run over prefix + its root-to-node path
    for node in range(len(tokens)):
        path_tokens = [tokens[i] for i in ancestors_path(node, parents)]
        expected = full_logits(reference, prefix + path_tokens)[-1]
        assert_close_to_scale(tree_logits[0, node], expected, what=f"node {node}")
    # accept path 0 -> 2 -> 4, compact it, continue: same as a fresh run over the kept tokens
    accepted = [0, 2, 4]
    cache.keep(0, len(prefix), accepted)
    assert cache.lengths.tolist() == [len(prefix) + len(accepted)]
    kept_tokens = prefix + [tokens[i] for i in accepted]
    logits, _ = step(target, cache, [55, 56], len(kept_tokens))
    expected = full_logits(reference, kept_tokens + [55, 56])[-2:]
    assert_close_to_scale(logits[0], expected)


def test_tree_mask_and_keep_compaction(hf_target):
    check_tree_and_keep(*hf_target)


def test_tree_mask_with_sliding_window_layers(gemma_target):
    # prefix 7 + tree depth 3 > window 4: the sliding layers must use the positions, not slots
    check_tree_and_keep(*gemma_target)


def test_hidden_layers_follow_output_hidden_states(hf_target):
    target, reference = hf_target
    sequence = [3, 1, 4, 1, 5, 9]
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor([sequence]), output_hidden_states=True)
    cache = target.new_cache()
    layers = (0, 1, target.num_layers)
    _, hidden = step(target, cache, sequence, 0, hidden_layers=layers)
    assert set(hidden) == set(layers)
    for layer in layers:
        assert hidden[layer].shape == (1, len(sequence), target.hidden_size)
        assert_close_to_scale(hidden[layer], ref.hidden_states[layer])
    with torch.no_grad():
        final = reference.model(input_ids=torch.tensor([sequence])).last_hidden_state
    assert_close_to_scale(hidden[target.num_layers], final)  # after the final norm


def test_batched_rows_and_unequal_truncate(hf_target):
    target, reference = hf_target
    rows = [[5, 6, 7, 8], [9, 10, 11, 12]]
    cache = target.new_cache(batch_size=2)
    logits, _ = target.forward(torch.tensor(rows), torch.arange(4).expand(2, 4), cache)
    for row, sequence in enumerate(rows):
        assert_close_to_scale(logits[row], full_logits(reference, sequence))
    assert cache.lengths.tolist() == [4, 4]
    with pytest.raises(NotImplementedError, match="same length"):
        cache.truncate(torch.tensor([2, 3]))
    with pytest.raises(NotImplementedError, match="batch_size 1"):
        cache.keep(1, 2, [0])


def test_bad_inputs_raise_clear_errors(hf_target):
    target, _ = hf_target
    cache = target.new_cache(max_len=8)
    with pytest.raises(ValueError, match="bool tensor"):
        step(target, cache, [1, 2], 0, attn_mask=torch.ones(1, 2, 2))
    with pytest.raises(ValueError, match="out of range"):
        step(target, cache, [1, 2], 0, hidden_layers=(target.num_layers + 1,))
    with pytest.raises(ValueError, match="overflow"):
        step(target, cache, list(range(1, 10)), 0)
    step(target, cache, [1, 2, 3], 0)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(5)
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.keep(0, 0, [2, 1])
    with pytest.raises(ValueError, match="out of range"):
        cache.keep(0, 1, [0, 5])
    with pytest.raises(ValueError, match="unsupported dtype"):
        parse_dtype("int8")
