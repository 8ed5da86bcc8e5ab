"""GGUF block weights in the batch-invariant kernel (specdec.kernels.gguf_linear): for every block
format, bitwise equal to the fp32 kernel on the weights `gguf.quants.dequantize` produces, rows
bitwise batch invariant, embedding lookups equal to dequantized rows, both ISA builds."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specdec.kernels import CppSkinnyLinear, KernelUnavailable
from specdec.kernels.gguf_linear import KERNEL_TYPES, GGUFEmbedding, GGUFLinear, dequantize_blocks, gguf_module

QUANTIZE_SUPPORTED = {"Q4_0", "Q4_1", "Q5_0", "Q8_0"}  # gguf-py can quantize these; K-quants it only reads
# offsets of the fp16 scale fields in each block (d, and dmin / m where present)
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.fixture(scope="module", params=["avx512", "avx2"])
def backend(request):
    """The kernel built for each instruction set this CPU can run (AVX2 also on AVX-512 CPUs)."""
    try:
        return CppSkinnyLinear(isa=request.param)
    except KernelUnavailable as exc:
        pytest.skip(f"{request.param} kernel unavailable here: {exc}")


def random_blocks(name: str, rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Valid random blocks [rows, row_bytes]: every quant bit pattern is random; the fp16 scales
    are finite, of both signs, and include zero and subnormal values."""
    qtype = GGMLQuantizationType[name]
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, in_features // block, nbytes), dtype=np.uint8)
    scales = (rng.standard_normal((rows, in_features // block)) * 0.02).astype(np.float16)
    scales.flat[::7] = np.float16(0.0)
    scales.flat[3::11] = np.float16(3e-6)  # subnormal in fp16
    for offset in FP16_FIELDS[name]:
        data[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
        scales = -scales[:, ::-1].copy()  # a different value for the second field
    return torch.from_numpy(data.reshape(rows, -1))


def quantized_blocks(name: str, rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Blocks as gguf-py's own quantizer writes them from a random fp32 matrix."""
    weights = np.random.default_rng(seed).standard_normal((rows, in_features)).astype(np.float32) * 0.05
    return torch.from_numpy(np.ascontiguousarray(quantize(weights, GGMLQuantizationType[name])))


def block_cases():
    for name in KERNEL_TYPES:
        block = GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]
        # odd row counts; K of one block, a few blocks, and past the kernel's 512-weight K chunk
        for rows, blocks_per_row in ((1, 1), (37, 3), (131, 40 if block == 32 else 5)):
            yield pytest.param(name, rows, block * blocks_per_row, id=f"{name}-{rows}x{block * blocks_per_row}")


@pytest.mark.parametrize("name, rows, in_features", list(block_cases()))
def test_kernel_equals_fp32_kernel_on_dequantized_weights_bitwise(backend, name, rows, in_features):
    qtype = KERNEL_TYPES[name]
    makers = [random_blocks] + ([quantized_blocks] if name in QUANTIZE_SUPPORTED else [])
    for seed, make in enumerate(makers):
        blocks = make(name, rows, in_features, seed)
        dense = dequantize_blocks(blocks, qtype)  # [N, K] fp32: today's fp32 path
        assert torch.equal(dense, torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType(qtype))))
        bias = torch.randn(rows, generator=torch.Generator().manual_seed(seed)) if seed == 0 else None
        layer = GGUFLinear(blocks, qtype, in_features, bias, backend)
        x = torch.randn(16, in_features, generator=torch.Generator().manual_seed(100 + seed))  # [16, K]
        alone = [layer(x[i : i + 1])[0] for i in range(len(x))]  # 16 x [N]
        for num_rows in range(1, len(x) + 1):
            out = layer(x[:num_rows])  # [k, N]
            assert torch.equal(out, backend.linear(x[:num_rows], dense, bias)), f"{num_rows} rows differ from fp32"
            for i in range(num_rows):
                assert torch.equal(out[i], alone[i]), f"row {i} of a {num_rows}-row call differs from the row alone"


@pytest.mark.parametrize("name", list(KERNEL_TYPES))
def test_rows_do_not_depend_on_thread_count(backend, name):
    qtype = KERNEL_TYPES[name]
    block = GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]
    in_features = block * (12 if block == 32 else 2)
    blocks = random_blocks(name, 1029, in_features, seed=5)  # enough work to split across threads
    layer = GGUFLinear(blocks, qtype, in_features, None, backend)
    x = torch.randn(9, in_features)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = layer(x)
        torch.set_num_threads(max(2, threads))
        multi = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, multi)
    assert torch.equal(single, backend.linear(x, dequantize_blocks(blocks, qtype), None))


@pytest.mark.parametrize("name", list(KERNEL_TYPES))
def test_embedding_lookup_is_the_dequantized_row(backend, name):
    qtype = KERNEL_TYPES[name]
    block = GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]
    blocks = random_blocks(name, 53, block * 3, seed=7)
    table = GGUFEmbedding(blocks, qtype, block * 3, backend)
    dense = dequantize_blocks(blocks, qtype)  # [53, K]
    tokens = torch.tensor([[0, 52, 7, 7], [3, 1, 0, 44]])
    out = table(tokens)
    assert out.shape == (2, 4, block * 3) and out.dtype == torch.float32
    assert torch.equal(out, dense[tokens])
    assert table(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, block * 3)
    with pytest.raises(IndexError, match="out of range"):
        table(torch.tensor([53]))
    with pytest.raises(IndexError, match="out of range"):
        table(torch.tensor([-1]))


def test_fallbacks_for_other_dtypes_and_autograd(backend):
    blocks, qtype = random_blocks("Q4_K", 40, 256, seed=9), KERNEL_TYPES["Q4_K"]
    bias = torch.randn(40)
    layer = GGUFLinear(blocks, qtype, 256, bias, backend)
    dense = dequantize_blocks(blocks, qtype)
    x = torch.randn(3, 256)
    out_bf16 = layer(x.bfloat16())
    assert out_bf16.dtype == torch.bfloat16
    assert torch.equal(out_bf16, torch.nn.functional.linear(x.bfloat16(), dense.bfloat16(), bias.bfloat16()))
    x_grad = x.clone().requires_grad_(True)
    layer(x_grad).sum().backward()  # through F.linear on a dense copy: the kernel has no backward
    torch.testing.assert_close(x_grad.grad, dense.sum(0).expand(3, -1))
    assert layer(torch.randn(0, 256)).shape == (0, 40)
    assert torch.equal(layer.fp32_weight(), dense)
    assert not layer.weight.requires_grad and layer.weight.dtype == torch.uint8
    assert sum(p.numel() for p in layer.parameters() if p.dtype == torch.uint8) == 40 * 144  # bytes, as stored


def test_bad_blocks_are_refused_with_a_clear_message(backend):
    blocks = random_blocks("Q8_0", 4, 64, seed=1)  # [4, 68]
    with pytest.raises(ValueError, match=r"uint8 \[out, 68\]"):
        GGUFLinear(blocks[:, :60].contiguous(), KERNEL_TYPES["Q8_0"], 64, None, backend)
    with pytest.raises(ValueError, match="multiple of 32"):
        GGUFLinear(blocks, KERNEL_TYPES["Q8_0"], 48, None, backend)
    with pytest.raises(ValueError, match="does not compute on GGUF type Q2_K"):
        GGUFLinear(blocks, int(GGMLQuantizationType.Q2_K), 64, None, backend)
    with pytest.raises(TypeError, match="nn.Linear and nn.Embedding"):
        gguf_module(torch.nn.Conv1d(1, 1, 1), blocks, KERNEL_TYPES["Q8_0"], None, backend)
    linear = gguf_module(torch.nn.Linear(64, 4, device="meta"), blocks, KERNEL_TYPES["Q8_0"], None, backend)
    assert isinstance(linear, GGUFLinear) and linear.out_features == 4


@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("name", list(KERNEL_TYPES))
def test_rows_of_a_long_prefill_equal_the_rows_alone_bitwise(backend, name, activations):
    """A 300-row call (a prefill: several row panels, each decoding the weights once for all its
    row blocks) gives every row bitwise as that row alone, which decodes per row block."""
    qtype = KERNEL_TYPES[name]
    block = GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]
    in_features = block * (40 if block == 32 else 5)  # past the 512-weight K chunk
    blocks = random_blocks(name, 37, in_features, seed=11)  # odd N: a partial column tile
    layer = GGUFLinear(blocks, qtype, in_features, None, backend, activations=activations)
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(12))  # [300, K]
    out = layer(x)  # [300, N]
    for i in range(len(x)):
        assert torch.equal(out[i], layer(x[i : i + 1])[0]), f"row {i} of the 300-row call differs from the row alone"
    if activations == "fp32":
        assert torch.equal(out, backend.linear(x, dequantize_blocks(blocks, qtype), None))
