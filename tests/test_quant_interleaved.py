"""The a8 weights interleaved 16 (AVX-512 VNNI) or 8 (256-bit builds) output columns wide
(csrc/a8_interleaved.cpp), K-quants and 32-weight formats: bitwise the raw-block a8 kernel of the
same build for every row count (K-quants: 1-2 rows walk two column groups at once, then tiles of up
to 8 / 4 rows, more rows in blocks; 32-weight formats: row pairs), odd N (a partial last group), bias,
1 or 2 threads, K not a multiple of 256 and the largest integer sums; and GGUFLinear in int8 mode
runs those formats on the copy."""

import pytest
import torch
from test_quant_a8 import extreme_k_quant_blocks, isa_backend
from test_quant_kernel import random_blocks

from specdec.kernels.gguf_linear import INTERLEAVED_ROWS_OVER_AMX, KERNEL_TYPES, GGUFLinear

K_QUANTS = ["Q4_K", "Q6_K"]
BLOCK32_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0"]  # Qwen2.5-Coder-0.5B (Q5_0, Q8_0), SmolLM2-135M (Q4_1, Q8_0)
INTERLEAVED_TYPES = K_QUANTS + BLOCK32_TYPES


def has_copy(library, name: str) -> bool:
    """Whether this build interleaves `name` (a build without VNNI keeps Q8_0 on its raw blocks: its
    maddubs byte products would overflow int16 on Q8_0's unsigned quants)."""
    if library.interleaved_bytes(KERNEL_TYPES[name], 16, 256):
        return True
    assert name == "Q8_0" and not library.a8_vnni, f"{name} has no interleaved copy on {library.isa}"
    return False


@pytest.fixture(scope="module", params=["avx512", "avx2-vnni", "avx2"])
def library(request):
    """Each build this CPU runs, with AMX tiles off (the raw-block reference then runs on the VNNI
    tiles where the build has both)."""
    library = isa_backend(request.param).library
    was_on = library.amx
    library.set_amx(False)
    yield library
    library.set_amx(was_on)


def interleaved(library, blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    nbytes = library.interleaved_bytes(qtype, blocks.shape[0], in_features)
    buffer = torch.empty(nbytes + 64, dtype=torch.uint8)
    start = -buffer.data_ptr() % 64
    packed = buffer[start:start + nbytes]
    library.interleave(blocks, qtype, in_features, packed)
    return packed


@pytest.mark.parametrize("name", INTERLEAVED_TYPES)
def test_the_interleaved_copy_is_bitwise_the_raw_blocks(library, name):
    if not has_copy(library, name):
        pytest.skip(f"no {name} copy on {library.isa}")
    qtype = KERNEL_TYPES[name]
    in_features = 5 * 256 if name in K_QUANTS else 28 * 32  # the 0.5B's 896: no multiple of 256
    for out_features in (45, 1029 if name in K_QUANTS else 333):  # a partial last group; enough groups to split across threads
        blocks = random_blocks(name, out_features, in_features, seed=41)
        packed = interleaved(library, blocks, qtype, in_features)
        generator = torch.Generator().manual_seed(42)
        bias = torch.randn(out_features, generator=generator)
        x = torch.randn(40, in_features, generator=generator) * 3.0  # [40, K]
        for threads in (1, 2):
            for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 40):
                for b in (None, bias):
                    expected = library.linear_gguf_a8(x[:rows], blocks, qtype, b, threads)
                    got = library.linear_interleaved_a8(x[:rows], packed, out_features, qtype, b, threads)
                    assert torch.equal(got, expected), f"N {out_features}, {rows} rows, {threads} threads, bias {b is not None}"


@pytest.mark.parametrize("name", K_QUANTS)
def test_the_interleaved_copy_holds_the_largest_integer_sums(library, name):
    """Every quant and sub-block scale at its largest magnitude, activations at +-amax: the int16
    product pairs (Q4_K: a sub-block's 16 products per lane; Q6_K: 4 of up to 63 x 127), the scale
    and offset products and the min terms keep the raw-block bits."""
    qtype, rows, in_features = KERNEL_TYPES[name], 21, 3 * 256
    blocks = extreme_k_quant_blocks(name, rows, in_features)
    packed = interleaved(library, blocks, qtype, in_features)
    signs = torch.where(torch.rand(16, in_features, generator=torch.Generator().manual_seed(5)) < 0.5, -1.0, 1.0)
    signs[0], signs[1] = 1.0, -1.0  # all one sign: the largest sums
    x = 2.5 * signs  # [16, K]: every activation is its block's amax
    for num_rows in (1, 2, 3, 5, 8, 16):
        expected = library.linear_gguf_a8(x[:num_rows], blocks, qtype, None, 2)
        got = library.linear_interleaved_a8(x[:num_rows], packed, rows, qtype, None, 2)
        assert torch.equal(got, expected), f"{num_rows} rows"


@pytest.mark.parametrize("name", [name for name in BLOCK32_TYPES if name != "Q4_1"])
def test_the_32_weight_copy_holds_the_largest_lane_sums(library, name):
    """Every quant at an end of its range (q = -offset or its largest) against activations at
    +-amax: each lane's 4 products and its start (-offset x the 4 activations) are at their largest
    magnitude, and the raw blocks' bits hold (Q8_0 also at q = -128, u = 0)."""
    if not has_copy(library, name):
        pytest.skip(f"no {name} copy on {library.isa}")
    qtype, rows, in_features = KERNEL_TYPES[name], 19, 3 * 32
    blocks = random_blocks(name, rows, in_features, seed=33).view(rows, in_features // 32, -1).clone()
    quants = slice(2, None)  # after d: Q4_0 nibbles, Q5_0 qh then nibbles, Q8_0 int8
    blocks[0::2, :, quants] = 0x00  # q = -8, -16 (qh = 0), -128
    blocks[1::2, :, quants] = 0xFF if name != "Q8_0" else 0x7F  # q = 7, 15, 127
    blocks = blocks.view(rows, -1)
    packed = interleaved(library, blocks, qtype, in_features)
    signs = torch.where(torch.rand(9, in_features, generator=torch.Generator().manual_seed(6)) < 0.5, -1.0, 1.0)
    signs[0], signs[1] = 1.0, -1.0
    x = 1.5 * signs  # [9, K]
    for num_rows in (1, 2, 3, 9):
        expected = library.linear_gguf_a8(x[:num_rows], blocks, qtype, None, 2)
        got = library.linear_interleaved_a8(x[:num_rows], packed, rows, qtype, None, 2)
        assert torch.equal(got, expected), f"{num_rows} rows"


def test_gguf_linear_runs_int8_layers_on_the_copy(library):
    """int8 layers of the copy's formats hold it and give the raw blocks' bits through it (also past
    INTERLEAVED_ROWS_OVER_AMX rows); the exact mode and the other formats have none."""
    from specdec.kernels import CppSkinnyLinear

    backend = CppSkinnyLinear(isa=library.isa)
    in_features = 2 * 256
    for name in INTERLEAVED_TYPES:
        if not has_copy(library, name):
            continue
        qtype = KERNEL_TYPES[name]
        blocks = random_blocks(name, 33, in_features, seed=43)
        layer = GGUFLinear(blocks, qtype, in_features, None, backend, activations="int8")
        assert layer.interleaved_weight is not None and "interleaved" in repr(layer)
        # a copy this small sits in ordinary pages: a 2 MiB huge page would hold it whole
        assert layer.interleaved_weight.untyped_storage().nbytes() < 2 * 1024 * 1024
        x = torch.randn(INTERLEAVED_ROWS_OVER_AMX + 3, in_features)
        assert torch.equal(layer(x), library.linear_gguf_a8(x, blocks, qtype, None, 2))
        assert GGUFLinear(blocks, qtype, in_features, None, backend).interleaved_weight is None  # fp32 activations
        layer.set_activations("fp32")  # switching modes drops the copy, and back builds it again
        assert layer.interleaved_weight is None and torch.equal(layer(x), library.linear_gguf(x, blocks, qtype, None, 2))
        layer.set_activations("int8")
        assert layer.interleaved_weight is not None and torch.equal(layer(x), library.linear_gguf_a8(x, blocks, qtype, None, 2))
    q5k = random_blocks("Q5_K", 33, in_features, seed=44)
    assert GGUFLinear(q5k, KERNEL_TYPES["Q5_K"], in_features, None, backend, activations="int8").interleaved_weight is None
    assert library.interleaved_bytes(KERNEL_TYPES["Q4_K"], 33, 288) == 0  # K not a multiple of 256
    assert library.interleaved_bytes(KERNEL_TYPES["Q4_0"], 33, 288) > 0  # 9 blocks of 32
    # the 4/5-bit formats run on the copy from 1 row, Q8_0 from 8, the K-quants from 2 or 3; no copy, no rows
    assert library.interleaved_min_rows(KERNEL_TYPES["Q5_0"]) == 1
    assert library.interleaved_min_rows(KERNEL_TYPES["Q8_0"]) in (8, 0)
    assert library.interleaved_min_rows(KERNEL_TYPES["Q4_K"]) in (2, 3)
    assert library.interleaved_min_rows(KERNEL_TYPES["Q5_K"]) == 0
    assert library.interleaved_cols in (8, 16)


def test_the_copy_can_be_switched_off(library, monkeypatch):
    """SPECDEC_KERNEL_INTERLEAVE=0 (the library's interleave_weights): no copy, the raw blocks' bits
    at every row count, and a cost-table key of its own (its T(k) differ)."""
    from specdec.kernels import CppSkinnyLinear
    from specdec.kernels.library import _env_switch

    monkeypatch.setenv("SPECDEC_KERNEL_INTERLEAVE", "0")
    assert not _env_switch("SPECDEC_KERNEL_INTERLEAVE")
    monkeypatch.setenv("SPECDEC_KERNEL_INTERLEAVE", "1")
    assert _env_switch("SPECDEC_KERNEL_INTERLEAVE")
    backend = CppSkinnyLinear(isa=library.isa)
    monkeypatch.setattr(backend.library, "interleave_weights", False)
    in_features = 256
    blocks = random_blocks("Q4_K", 20, in_features, seed=45)
    layer = GGUFLinear(blocks, KERNEL_TYPES["Q4_K"], in_features, None, backend, activations="int8")
    assert layer.interleaved_weight is None
    x = torch.randn(5, in_features)
    assert torch.equal(layer(x), library.linear_gguf_a8(x, blocks, KERNEL_TYPES["Q4_K"], None, 2))

    from types import SimpleNamespace

    from specdec.cost import cost_key

    target = SimpleNamespace(name="m", dtype=torch.float32, weights="gguf-a8", kernel_library=backend.library)
    without = cost_key(target)
    monkeypatch.setattr(backend.library, "interleave_weights", True)
    assert cost_key(target) != without and without["interleaved"] is False
