"""A layer's GGUF linears in fewer kernel calls (csrc/layer.cpp): q / k / v of one input in one call,
the MLP's silu(gate(x)) * up(x) in one call, and a whole block of few rows in one call (sg_layer),
bitwise the block op by op on a real model. The linears are bitwise the separate calls on every
route (exact, a8 on the raw blocks, a8 on the interleaved copy); the SiLU product is torch's to
rounding, the same bits on both builds and row by row; anything the kernel does not run (bf16,
autograd, other modules) goes through the separate calls."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_scale
from test_quant_a8 import isa_backend
from test_quant_kernel import random_blocks

from specdec.kernels.backends import separate_gate_up_silu
from specdec.kernels.gguf_linear import KERNEL_TYPES, GGUFLinear


@pytest.fixture(scope="module", params=["avx512", "avx2-vnni", "avx2"])
def backend(request):
    return isa_backend(request.param)


def layers(backend, activations, names, out_features, in_features=896, seed=0):
    made = []
    for i, (name, n) in enumerate(zip(names, out_features)):
        bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + i)) if i != 1 else None
        made.append(GGUFLinear(random_blocks(name, n, in_features, seed=seed + i), KERNEL_TYPES[name], in_features, bias,
                               backend, activations))
    return made


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_three_linears_in_one_call_are_the_separate_calls(backend, activations):
    q, k, v = layers(backend, activations, ("Q5_0", "Q8_0", "Q4_0"), (96, 32, 45))
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 2, 3, 9):  # the interleaved copy's thresholds fall between these
            x = torch.randn(1, rows, 896, generator=generator) * 2
            together = backend.linears(x, (q, k, v))
            assert [tuple(y.shape) for y in together] == [(1, rows, 96), (1, rows, 32), (1, rows, 45)]
            for mine, layer in zip(together, (q, k, v)):
                assert torch.equal(mine, layer(x)), (rows, layer)
    # a K-quant among them (K a multiple of 256), and routes that differ per layer
    q, k, v = layers(backend, activations, ("Q4_K", "Q6_K", "Q8_0"), (64, 17, 40), in_features=512, seed=5)
    x = torch.randn(4, 512, generator=generator)
    with torch.inference_mode():
        assert all(torch.equal(mine, layer(x)) for mine, layer in zip(backend.linears(x, (q, k, v)), (q, k, v)))


def test_gate_up_silu_is_torch_to_rounding_and_the_same_bits_on_every_build(backend):
    gate, up = layers(backend, "int8", ("Q5_0", "Q5_0"), (203, 203), seed=3)  # 203: a tail after 25 vectors of 8
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, 896, generator=generator) * 3
    with torch.inference_mode():
        fused = backend.gate_up_silu(x, gate, up)
        g, u = gate(x), up(x)
        assert_close_to_scale(fused, F.silu(g) * u, rel=2e-6, what="silu(gate) * up")
        assert torch.equal(backend.gate_up_silu(x[3:4], gate, up), fused[3:4])  # a row alone
        other = isa_backend("avx2")
        gate2, up2 = layers(other, "int8", ("Q5_0", "Q5_0"), (203, 203), seed=3)
        assert torch.equal(other.gate_up_silu(x, gate2, up2), fused)  # the a8 linears and SiLU: same bits on AVX2
        # SiLU's range: large gates pass through, very negative ones go to -0, no overflow or NaN
        gate_values, fused_values = _silu_at(backend, [-200.0, -90.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 90.0, 200.0])
        assert torch.isfinite(fused_values).all()
        assert_close_to_scale(fused_values, F.silu(gate_values), rel=1e-6, what="silu over its range")
    # bf16 and autograd go through torch's ops
    half = backend.gate_up_silu(x.bfloat16(), gate, up)
    assert half.dtype == torch.bfloat16 and torch.equal(half, separate_gate_up_silu(x.bfloat16(), gate, up))
    trained = x.clone().requires_grad_(True)
    with torch.enable_grad():
        backend.gate_up_silu(trained, gate, up).sum().backward()
    assert trained.grad is not None


def _silu_at(backend, values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, silu(gate)) from sg_gate_up_silu where the gate projection gives ~`values` and up
    gives ~1 (divided out again): one Q8_0 block per output (fp16 scale, quant 0 = 127) on x = e_0, exact fp32 route."""
    n = len(values)
    q8_0 = KERNEL_TYPES["Q8_0"]

    def blocks(outputs: torch.Tensor) -> torch.Tensor:
        made = torch.zeros(n, 34, dtype=torch.uint8)
        made[:, :2] = (outputs / 127.0).to(torch.float16).view(torch.uint8).view(n, 2)
        made[:, 2] = 127
        return made

    gate_blocks, up_blocks = blocks(torch.tensor(values)), blocks(torch.ones(n))
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    library = backend.library
    gate_values = library.linear_routed(0, x, gate_blocks, n, q8_0, None, 1)
    up_values = library.linear_routed(0, x, up_blocks, n, q8_0, None, 1)  # 1 to fp16 rounding
    fused = library.gate_up_silu(x, (0, gate_blocks, n, q8_0, None), (0, up_blocks, n, q8_0, None), 1)
    return gate_values, fused / up_values


@pytest.fixture(scope="module", params=["gguf", "gguf-a8"])
def smollm2(request):
    from conftest import skip_without_kernel

    from specdec.api import load_target

    skip_without_kernel()
    return load_target("smollm2-135m", progress=False, weights=request.param)


def test_a_block_in_one_call_is_the_block_op_by_op(smollm2):
    """sg_layer gives the residual stream and the KV cache of Block.run_ops bit for bit: one decode
    row, a causal verify of 5 rows, a tree mask, two sequences of different lengths; past
    MAX_LAYER_ROWS rows (a prefill) the block runs op by op."""
    from specdec.kernels.backends import MAX_LAYER_ROWS

    model = smollm2.model
    block, kernels = model.model.layers[3], model.kernels
    generator = torch.Generator().manual_seed(6)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    cases = [  # (lengths per row, new tokens, mask among the new tokens or None)
        ([9], 1, None), ([9], 5, torch.ones(1, 5, 5, dtype=torch.bool).tril()), ([12], 4, tree[None]),
        ([7, 10], 3, torch.ones(2, 3, 3, dtype=torch.bool).tril()),
    ]
    with torch.inference_mode():
        for lengths, num_new, new_mask in cases:
            batch = len(lengths)
            caches = []
            for _ in range(2):  # the same committed keys / values in two caches
                cache = smollm2.new_cache(batch, 64)
                cache.reserve(max(lengths) + num_new)
                for layer in range(cache.num_layers):
                    cache.keys[layer].copy_(torch.randn(cache.keys[layer].shape, generator=torch.Generator().manual_seed(layer)))
                    cache.values[layer].copy_(torch.randn(cache.values[layer].shape, generator=torch.Generator().manual_seed(50 + layer)))
                cache.lengths.copy_(torch.tensor(lengths))
                caches.append(cache)
            x = torch.randn(batch, num_new, model.config.hidden_size, generator=generator)
            positions = torch.tensor(lengths)[:, None] + torch.arange(num_new)[None]
            cos, sin = model.rope(positions, torch.float32)
            mask = None if new_mask is None else caches[0].attention_mask(num_new, new_mask)
            fused = kernels.run_layer(block, x, cos, sin, caches[0], 3, mask)
            assert fused is not None, (lengths, num_new)  # the one-call path ran
            assert torch.equal(fused, block.run_ops(x, cos, sin, caches[1], 3, mask)), (lengths, num_new)
            for mine, theirs in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
                assert torch.equal(mine, theirs)
        prefill = torch.randn(1, MAX_LAYER_ROWS + 1, model.config.hidden_size, generator=generator)
        cos, sin = model.rope(torch.arange(MAX_LAYER_ROWS + 1)[None], torch.float32)
        assert kernels.run_layer(block, prefill, cos, sin, smollm2.new_cache(1, 128), 3, None) is None
