"""The kernel's batch-invariant attention (sg_attention): each query row is computed alone over the
key slots it may see, in slot order, so a row's bits never depend on the other rows of the call.

Kernel level: it computes softmax(q k^T / sqrt(D)) v like torch's attention (scale-aware tolerance)
for GQA, masks and KV-cache views, on both ISA builds, with the same bits on both; a row alone ==
the same row among others, bitwise. Model level (SmolLM2, exact `gguf` and `gguf-a8` weights): the
logits of k tokens in one verify forward, of a tree's nodes, and of a ragged batch row equal, bit
for bit, those of decoding the same tokens one at a time. With torch's attention they do not (the
a8 mode then drifts by ~0.5 in the logits, enough to change greedy output on Qwen2.5-Coder-1.5B).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_scale, skip_without_kernel
from test_quant_a8 import backend, isa_backend  # noqa: F401  (backend: the kernel of each ISA build, a fixture)


def random_case(batch=2, heads=6, kv_heads=2, new=5, committed=11, head_dim=20, seed=0):
    """q [B, H, T, D], keys / values as views of a larger cache [B, H_kv, capacity, D], a mask [B, 1, T, S]."""
    generator = torch.Generator().manual_seed(seed)
    span = committed + new
    q = torch.randn(batch, heads, new, head_dim, generator=generator)
    store = torch.randn(2, batch, kv_heads, span + 7, head_dim, generator=generator) * 2  # spare slots: a view
    keys, values = store[0, :, :, :span], store[1, :, :, :span]
    mask = torch.ones(batch, 1, new, span, dtype=torch.bool)
    mask[..., committed:] = torch.ones(new, new, dtype=torch.bool).tril()  # causal among the new tokens
    mask[1, :, :, committed - 3 : committed] = False  # row 1 is shorter (a ragged batch)
    return q, keys, values, mask


def test_attention_matches_torch(backend):
    q, keys, values, mask = random_case()
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    assert_close_to_scale(backend.attention(q, keys, values, mask), expected, rel=1e-5, what="attention")
    unmasked = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    assert_close_to_scale(backend.attention(q, keys, values, None), unmasked, rel=1e-5, what="no mask")


def test_each_row_is_bitwise_the_row_alone(backend):
    q, keys, values, mask = random_case(new=7, head_dim=64)
    together = backend.attention(q, keys, values, mask)  # [B, H, T, D]
    for b in range(q.shape[0]):
        for t in range(q.shape[2]):
            alone = backend.attention(q[b : b + 1, :, t : t + 1], keys[b : b + 1], values[b : b + 1], mask[b : b + 1, :, t : t + 1])
            assert torch.equal(alone[0, :, 0], together[b, :, t]), (b, t)
    # a row sees the same slots with or without extra hidden slots after them: same bits
    visible = int(mask[0, 0, 0].sum())
    short = backend.attention(q[:1, :, :1], keys[:1, :, :visible], values[:1, :, :visible], None)
    assert torch.equal(short[0, :, 0], together[0, :, 0])
    # a fully hidden row (padding of a ragged batch) is zeros, not NaN
    hidden = torch.zeros_like(mask[:1, :, :1])
    assert torch.equal(backend.attention(q[:1, :, :1], keys[:1], values[:1], hidden), torch.zeros_like(q[:1, :, :1]))


def test_attention_bits_are_the_same_on_both_builds():
    q, keys, values, mask = random_case(head_dim=72, seed=3)  # 72 = 9 vectors of 8: no scalar tail
    avx512, avx2 = isa_backend("avx512"), isa_backend("avx2")
    assert torch.equal(avx512.attention(q, keys, values, mask), avx2.attention(q, keys, values, mask))


def test_hidden_slots_and_slot_blocks_change_no_bits(backend):
    """The kernel walks the slots in L1-sized blocks (parking the weighted sums in between); a row's
    bits depend only on the slots it sees, in order: hiding a long run of slots in front moves every
    block boundary relative to the visible slots, and the result stays bitwise the same."""
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, hidden, visible, new = 4, 2, 64, 300, 900, 3
    q = torch.randn(1, heads, new, head_dim, generator=generator)
    store = torch.randn(2, 1, kv_heads, hidden + visible, head_dim, generator=generator)
    mask = torch.ones(1, 1, new, hidden + visible, dtype=torch.bool)
    mask[..., :hidden] = False
    with_hidden = backend.attention(q, store[0], store[1], mask)
    alone = backend.attention(q, store[0, :, :, hidden:], store[1, :, :, hidden:], None)
    assert torch.equal(with_hidden, alone)
    expected = F.scaled_dot_product_attention(q, store[0, :, :, hidden:], store[1, :, :, hidden:], enable_gqa=True)
    assert_close_to_scale(alone, expected, rel=1e-5, what="long attention")


@pytest.mark.parametrize("head_dim", [64, 20])  # 20: a half of 10, a vector and a scalar tail
def test_rotary_kernel_is_bitwise_torch(backend, head_dim):
    """The fused rotary embedding (one pass, written in the attention layout) computes torch's
    `x * cos + rotate_half(x) * sin` element by element: the same bits, on both builds."""
    from specdec.kernels.backends import torch_rotary
    from specdec.models.llama import rotary_cos_sin

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3, head_dim, generator=generator) * 3  # [B, T, H, D]
    positions = torch.tensor([[7, 8, 9, 10, 11], [0, 1, 1, 2, 900]])  # [B, T] (a tree, a far position)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    cos, sin = rotary_cos_sin(positions, inv_freq, 1.0, torch.float32)  # [B, 1, T, D]
    expected = torch_rotary(x, cos, sin)  # [B, H, T, D]
    actual = backend.rotary(x, cos, sin)
    assert actual.shape == expected.shape and actual.is_contiguous()
    assert torch.equal(actual, expected)
    assert torch.equal(backend.rotary(x[:, 2:3], cos[:, :, 2:3], sin[:, :, 2:3]), expected[:, :, 2:3])  # a row alone


def test_autograd_and_other_dtypes_fall_back_to_torch(backend):
    q, keys, values, mask = random_case()
    q.requires_grad_(True)
    out = backend.attention(q, keys, values, mask)
    out.sum().backward()  # torch's attention ran: it has a backward
    assert q.grad is not None
    half = backend.attention(q.detach().bfloat16(), keys.bfloat16(), values.bfloat16(), mask)
    assert half.dtype == torch.bfloat16


def test_attention_step_is_the_ops_one_by_one(backend):
    """A layer's attention step in one call (rotary of q and k, the KV cache write, attention in the
    o projection's layout) gives the bits and the cache of rotary, KVCache.write and attention run one
    by one, for a ragged batch (rows at different lengths) under a mask, and for one row without one."""
    from specdec.kernels.backends import composed_attention_step
    from specdec.kv_cache import KVCache
    from specdec.models.llama import rotary_cos_sin

    generator = torch.Generator().manual_seed(7)
    batch, new, heads, kv_heads, head_dim = 2, 3, 6, 2, 20
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))

    def caches():
        made = []
        for _ in range(2):
            cache = KVCache(2, batch, kv_heads, head_dim, 64)
            cache.reserve(20)
            for layer in range(2):
                cache.keys[layer].copy_(torch.randn(cache.keys[layer].shape, generator=torch.Generator().manual_seed(layer)))
                cache.values[layer].copy_(torch.randn(cache.values[layer].shape, generator=torch.Generator().manual_seed(9 + layer)))
            cache.lengths.copy_(torch.tensor([11, 8]))  # ragged: row 1 is shorter
            made.append(cache)
        return made

    q = torch.randn(batch, new, heads, head_dim, generator=generator)
    k, v = (torch.randn(batch, new, kv_heads, head_dim, generator=generator) for _ in range(2))
    positions = torch.tensor([[11, 12, 12], [8, 9, 10]])  # row 0 a tree (two children of one node)
    cos, sin = rotary_cos_sin(positions, inv_freq, 1.0, torch.float32)  # [B, 1, T, D]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = caches()[0].attention_mask(new, torch.stack([tree, torch.ones(new, new, dtype=torch.bool).tril()]))  # [B, 1, T, 14]
    fused_cache, composed_cache = caches()
    fused = backend.attention_step(q, k, v, cos, sin, fused_cache, 1, mask)
    composed = composed_attention_step(backend, q, k, v, cos, sin, composed_cache, 1, mask)
    assert fused.shape == (batch, new, heads * head_dim) and torch.equal(fused, composed)
    for mine, theirs in zip(fused_cache.keys + fused_cache.values, composed_cache.keys + composed_cache.values):
        assert torch.equal(mine, theirs)
    reference = F.scaled_dot_product_attention(backend.rotary(q, cos, sin), fused_cache.keys[1][:, :, :14],
                                               fused_cache.values[1][:, :, :14], attn_mask=mask, enable_gqa=True)
    assert_close_to_scale(fused, reference.transpose(1, 2).reshape(batch, new, -1), rel=1e-5, what="attention step")
    # one row, one token, no mask (a decode step), on a row view of the cache
    one, other = caches()
    row_one, row_other = one.rows(1, 2), other.rows(1, 2)
    step = backend.attention_step(q[1:, :1], k[1:, :1], v[1:, :1], cos[1:, :, :1], sin[1:, :, :1], row_one, 0, None)
    assert torch.equal(step, composed_attention_step(backend, q[1:, :1], k[1:, :1], v[1:, :1], cos[1:, :, :1],
                                                     sin[1:, :, :1], row_other, 0, None))
    assert torch.equal(one.keys[0], other.keys[0]) and torch.equal(one.values[0], other.values[0])


def test_rms_norm_kernel_is_close_to_torch_and_batch_invariant(backend):
    """The kernel's RMSNorm (its own fixed order) is torch's to rounding, a row alone has the bits it
    has in a batch, the residual add before it is torch's add bit for bit, and bf16 / autograd go to torch."""
    from specdec.kernels.backends import rms_norm

    generator = torch.Generator().manual_seed(4)
    for hidden in (1536, 896, 20):  # 20: a 16-wide chunk and a scalar tail
        x = torch.randn(3, 5, hidden, generator=generator) * 4
        delta = torch.randn(3, 5, hidden, generator=generator)
        weight = torch.rand(hidden, generator=generator) + 0.5
        with torch.inference_mode():
            normed = backend.rms_norm(x, weight, 1e-6)
            assert_close_to_scale(normed, rms_norm(x, weight, 1e-6), rel=1e-6, what=f"rms_norm {hidden}")
            assert torch.equal(backend.rms_norm(x[1, 2:3], weight, 1e-6), normed[1, 2:3])
            summed, added_normed = backend.add_rms_norm(x, delta, weight, 1e-6)
            assert torch.equal(summed, x + delta) and torch.equal(added_normed, backend.rms_norm(x + delta, weight, 1e-6))
    half = backend.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6)
    assert half.dtype == torch.bfloat16
    trained = weight.clone().requires_grad_(True)
    backend.rms_norm(x, trained, 1e-6).sum().backward()  # torch's ops ran: they have a backward
    assert trained.grad is not None


def test_rms_norm_bits_are_the_same_on_both_builds():
    x, weight = torch.randn(4, 1000) * 3, torch.rand(1000) + 0.5  # 1000: a tail after 62 chunks of 16
    avx512, avx2 = isa_backend("avx512"), isa_backend("avx2")
    with torch.inference_mode():
        assert torch.equal(avx512.rms_norm(x, weight, 1e-5), avx2.rms_norm(x, weight, 1e-5))


# ----------------------------------------------------------------------------- whole model
PROMPT = "The quick brown fox jumps over the lazy dog because it wants to see what is on the other side"


@pytest.fixture(scope="module", params=["gguf", "gguf-a8"])
def smollm2(request):
    from specdec.api import load_target

    skip_without_kernel()  # the batch-invariance contract (and GGUF blocks) need the kernel
    return load_target("smollm2-135m", progress=False, weights=request.param)


def _prefilled(target, ids, length, batch=1):
    cache = target.new_cache(batch, 256)
    target.forward(ids[:, :length].expand(batch, -1), torch.arange(length)[None].expand(batch, -1), cache)
    return cache


def _decode_one_by_one(target, ids, start, stop):
    """Logits [stop - start, V] of ids[start:stop] decoded one token per forward after a prefill."""
    cache = _prefilled(target, ids, start)
    return torch.stack([target.forward(ids[:, i : i + 1], torch.tensor([[i]]), cache)[0][0, 0] for i in range(start, stop)])


@pytest.mark.slow
def test_verify_rows_are_bitwise_decode_rows(smollm2):
    ids = smollm2.tokenizer(PROMPT, return_tensors="pt").input_ids  # [1, P]
    start, stop = ids.shape[1] - 6, ids.shape[1]
    decoded = _decode_one_by_one(smollm2, ids, start, stop)
    cache = _prefilled(smollm2, ids, start)
    verified = smollm2.forward(ids[:, start:stop], torch.arange(start, stop)[None], cache)[0][0]
    for j in range(stop - start):
        assert torch.equal(verified[j], decoded[j]), f"row {j}: max diff {float((verified[j] - decoded[j]).abs().max())}"


@pytest.mark.slow
def test_tree_and_ragged_batch_rows_are_bitwise_decode_rows(smollm2):
    ids = smollm2.tokenizer(PROMPT, return_tensors="pt").input_ids
    start = ids.shape[1] - 3
    decoded = _decode_one_by_one(smollm2, ids, start, start + 3)  # the path a, b, c
    # tree: node 0 = a; node 1 = a sibling of b (an other token), node 2 = b, node 3 = c (child of b)
    tokens = torch.tensor([[int(ids[0, start]), 42, int(ids[0, start + 1]), int(ids[0, start + 2])]])
    parents = [-1, 0, 0, 2]
    tree_mask = torch.zeros(4, 4, dtype=torch.bool)
    for node, parent in enumerate(parents):
        tree_mask[node, node] = True
        while parent >= 0:
            tree_mask[node, parent] = True
            parent = parents[parent]
    positions = torch.tensor([[start, start + 1, start + 1, start + 2]])
    cache = _prefilled(smollm2, ids, start)
    tree_logits = smollm2.forward(tokens, positions, cache, tree_mask[None])[0][0]
    for node, j in [(0, 0), (2, 1), (3, 2)]:
        assert torch.equal(tree_logits[node], decoded[j]), f"tree node {node}"
    # ragged batch: row 0 is the sequence above, row 1 a shorter one (2 tokens fewer committed)
    cache = _prefilled(smollm2, ids, start, batch=2)
    cache.truncate(torch.tensor([start, start - 2]))
    rows = torch.stack([ids[0, start : start + 3], ids[0, start - 2 : start + 1]])  # [2, 3]
    positions = torch.stack([torch.arange(start, start + 3), torch.arange(start - 2, start + 1)])
    batch_logits = smollm2.forward(rows, positions, cache)[0]
    for j in range(3):
        assert torch.equal(batch_logits[0, j], decoded[j]), f"batch row 0, token {j}"
