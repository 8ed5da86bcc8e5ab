"""The int8-activation mode (weights="gguf-a8"): GGUF block weights times activations quantized to
int8 per block (32, or 256 for K-quants) with integer dot products. Per format the kernel equals a
float64 reference computed from the same int8 activation blocks (tight, scale-aware tolerance);
rows are bitwise batch and thread-count invariant; the AVX2, AVX2 + AVX-VNNI and AVX-512 builds (and
AMX tiles where the CPU has them) give the same bits;
speculation on SmolLM2 reproduces the a8 model's own plain greedy output."""

import importlib.util
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from conftest import skip_without_kernel
from test_quant_kernel import QUANTIZE_SUPPORTED, quantized_blocks, random_blocks

from specdec import generate, make_drafter
from specdec.kernels import CppSkinnyLinear, GGUFEmbedding, GGUFLinear, KernelUnavailable
from specdec.kernels.gguf_linear import KERNEL_TYPES, dequantize_blocks

FLT_MAX = np.finfo(np.float32).max
# Kernel vs float64 reference from the same int8 blocks: the integer sums are exact, so the
# difference is fp32 rounding of a few products per block plus gguf's rounded weights (~1e-7 of
# the sum of |terms| measured); an activation or weight decoded wrongly is off by ~1e-1 of it.
A8_REL = 2e-6


@pytest.fixture(scope="module")
def kernel_quality():
    """scripts/kernel_quality.py, the developer tool that scores the a8 mode on a fixed text."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "kernel_quality.py"
    spec = importlib.util.spec_from_file_location("kernel_quality", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def isa_backend(isa: str) -> CppSkinnyLinear:
    try:
        return CppSkinnyLinear(isa=isa)
    except KernelUnavailable as exc:
        pytest.skip(f"{isa} kernel unavailable here: {exc}")


@pytest.fixture(scope="module", params=["avx512", "avx2-vnni", "avx2"])
def backend(request):
    """The kernel built for each instruction set this CPU can run (AVX2 also on AVX-512 CPUs)."""
    return isa_backend(request.param)


def other_builds() -> list[CppSkinnyLinear]:
    """The builds besides AVX2 that this CPU runs (AVX-512, AVX2 + AVX-VNNI); a skip where there are none."""
    from specdec.kernels.build import cpu_isas

    builds = [CppSkinnyLinear(isa=isa) for isa in cpu_isas() if isa != "avx2"]
    if not builds:
        pytest.skip("this CPU runs the AVX2 build only")
    return builds


def block_of(name: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]


def reference_quantize(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] fp32 -> (q [M, K] int8, d [M, K / block] fp32): d = amax / 127, q = rint(x * 127 / amax)."""
    rows, in_features = x.shape
    blocks = x.reshape(rows, in_features // block, block).astype(np.float32)
    amax = np.abs(blocks).max(axis=2)  # [M, K / block]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inverse = np.float32(127.0) / amax
    inverse = np.where(inverse <= FLT_MAX, inverse, np.float32(0.0)).astype(np.float32)
    q = np.rint(blocks * inverse[..., None]).astype(np.int8)  # float32 product, half to even
    return q.reshape(rows, in_features), (amax / np.float32(127.0)).astype(np.float32)


def test_activation_blocks_are_bitwise_the_reference_quantization(backend):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 768)) * np.exp(rng.uniform(-8, 8, (5, 1)))).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, q 0
    x[2, 5] = 1e-42  # a subnormal alone in its block: 127 / amax overflows, q 0
    x[2, 6:32] = 0.0
    x[3, ::7] *= 40.0  # outliers
    for block in (32, 256):
        q, d = backend.library.quantize_a8(torch.from_numpy(x), block)
        q_ref, d_ref = reference_quantize(x, block)
        assert np.array_equal(q.numpy(), q_ref), f"int8 values differ (block {block})"
        assert np.array_equal(d.numpy(), d_ref), f"block scales differ (block {block})"
    with pytest.raises(ValueError, match="multiple"):
        backend.library.quantize_a8(torch.zeros(2, 48), 32)
    with pytest.raises(ValueError, match="32 or 256"):
        backend.library.quantize_a8(torch.zeros(2, 64), 64)


def a8_cases():
    for name in KERNEL_TYPES:
        block = block_of(name)
        # odd row counts; K of one block, a few blocks, and past the kernel's 512-weight K chunk
        for rows, blocks_per_row in ((1, 1), (37, 3), (131, 40 if block == 32 else 5)):
            yield pytest.param(name, rows, block * blocks_per_row, id=f"{name}-{rows}x{block * blocks_per_row}")


def assert_equals_the_reference(out, x, blocks, qtype, bias, library, activation_block, weight=None, what=""):
    """out [M, N] of the a8 kernel vs float64 x_blocks @ W.T (+ bias) on the same int8 activation blocks,
    W = gguf's own dequantization of the blocks (or `weight` when given), within A8_REL of the magnitude."""
    rows, in_features = x.shape
    q, d = library.quantize_a8(x, activation_block)
    x_blocks = (q.double().view(rows, -1, activation_block) * d.double()[..., None]).view(rows, in_features)  # [M, K]
    weight = dequantize_blocks(blocks, qtype).double() if weight is None else weight  # [N, K]
    expected = x_blocks @ weight.T + (0.0 if bias is None else bias.double())  # [M, N]
    magnitude = x_blocks.abs() @ weight.abs().T + (0.0 if bias is None else bias.double().abs())
    error = (out.double() - expected).abs()
    assert bool((error <= A8_REL * magnitude + 1e-30).all()), (
        f"{what}max error {float((error / magnitude.clamp_min(1e-30)).max()):.3g} of the magnitude"
    )


@pytest.mark.parametrize("name, rows, in_features", list(a8_cases()))
def test_a8_kernel_equals_the_reference_on_the_same_int8_blocks(backend, name, rows, in_features):
    qtype = KERNEL_TYPES[name]
    activation_block = backend.library.a8_block(qtype)
    assert activation_block == (256 if name.endswith("_K") else 32)
    makers = [random_blocks] + ([quantized_blocks] if name in QUANTIZE_SUPPORTED else [])
    for seed, make in enumerate(makers):
        blocks = make(name, rows, in_features, seed)
        bias = torch.randn(rows, generator=torch.Generator().manual_seed(seed)) if seed == 0 else None
        layer = GGUFLinear(blocks, qtype, in_features, bias, backend, activations="int8")
        x = torch.randn(7, in_features, generator=torch.Generator().manual_seed(100 + seed)) * 3.0  # [7, K]
        out = layer(x)  # [7, N]
        assert_equals_the_reference(out, x, blocks, qtype, bias, backend.library, activation_block)
        if rows > 1:  # fp32 activations differ by the int8 rounding: the mode is really on (a 1-row
            # case may have a zero weight scale: then both give the bias)
            assert not torch.equal(out, GGUFLinear(blocks, qtype, in_features, bias, backend)(x))


def extreme_k_quant_blocks(name: str, rows: int, in_features: int) -> torch.Tensor:
    """K-quant blocks whose integer sums are as large as the format allows: every quant at its
    maximum (Q6_K: half the rows at q - 32 = 31, half at -32) and every sub-block scale at its
    largest magnitude (6-bit 63, or int8 127 / -128), with random finite fp16 super-block scales."""
    blocks = random_blocks(name, rows, in_features, seed=31)
    nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]][1]
    blocks = blocks.view(rows, -1, nbytes).clone()  # [N, K / 256, bytes]
    if name == "Q6_K":  # ql[128] qh[64] scales[16] d
        blocks[0::2, :, :192] = 0xFF  # q = 63
        blocks[1::2, :, :192] = 0x00  # q = 0
        blocks[:, :, 192:208:2] = 127
        blocks[:, :, 193:208:2] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
    else:  # d, dmin, 12 bytes of 6-bit scales and mins, then the quants (and Q5_K's fifth bits)
        blocks[:, :, 4:] = 0xFF
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_a8_k_quants_equal_the_reference_at_the_largest_integer_sums(backend, name):
    """Activations at +-amax in every position (|q| = 127) against the largest quants and scales:
    each path's int16 and int32 intermediates (2 products per int16 lane, scale products, the Q6_K
    offset term) must hold these sums exactly, for 1-row tiles, 4-row tiles and the decoded scratch."""
    qtype, rows, in_features = KERNEL_TYPES[name], 21, 3 * 256
    blocks = extreme_k_quant_blocks(name, rows, in_features)
    library = backend.library
    was_on = getattr(library, "amx", False)
    if was_on:
        library.set_amx(False)  # the VNNI path; AMX has its own test at the extremes
    try:
        layer = GGUFLinear(blocks, qtype, in_features, None, backend, activations="int8")
        signs = torch.where(torch.rand(16, in_features, generator=torch.Generator().manual_seed(5)) < 0.5, -1.0, 1.0)
        signs[0], signs[1] = 1.0, -1.0  # all one sign: the largest sums
        x = 2.5 * signs  # [16, K]: every activation is its block's amax
        assert int(library.quantize_a8(x, 256)[0].abs().min()) == 127
        weight = dequantize_blocks(blocks, qtype).double()  # [N, K]
        for num_rows in (1, 3, 4, 8, 16):
            assert_equals_the_reference(layer(x[:num_rows]), x[:num_rows], blocks, qtype, None, library, 256,
                                        weight=weight, what=f"{num_rows} rows: ")
    finally:
        if was_on:
            library.set_amx(True)


@pytest.mark.parametrize("name", list(KERNEL_TYPES))
def test_a8_rows_are_bitwise_batch_and_thread_invariant(backend, name):
    qtype = KERNEL_TYPES[name]
    in_features = block_of(name) * (37 if block_of(name) == 32 else 5)  # odd, past the 512 K chunk
    blocks = random_blocks(name, 1029, in_features, seed=3)  # odd N, enough work to split across threads
    layer = GGUFLinear(blocks, qtype, in_features, None, backend, activations="int8")
    x = torch.randn(13, in_features)  # [13, K]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [layer(x[i : i + 1])[0] for i in range(len(x))]  # 13 x [N]
        torch.set_num_threads(max(2, threads))
        for num_rows in (1, 2, 3, 4, 5, 8, 9, 13):
            out = layer(x[:num_rows])  # [k, N]
            for i in range(num_rows):
                assert torch.equal(out[i], alone[i]), f"row {i} of a {num_rows}-row call differs from the row alone"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(KERNEL_TYPES))
def test_a8_bits_are_the_same_on_every_build(name):
    """1-6 rows (the few-row tiles: AVX-512 VNNI's zmm steps, AVX-VNNI's paired sub-blocks, AVX2's
    maddubs) and odd N give the AVX2 build's bits on every other build this CPU runs."""
    avx2 = isa_backend("avx2")
    qtype = KERNEL_TYPES[name]
    in_features = block_of(name) * (20 if block_of(name) == 32 else 3)
    blocks = random_blocks(name, 45, in_features, seed=7)
    x = torch.randn(6, in_features)
    for rows in (1, 2, 3, 4, 6):
        expected = GGUFLinear(blocks, qtype, in_features, None, avx2, activations="int8")(x[:rows])
        for build in other_builds():
            got = GGUFLinear(blocks, qtype, in_features, None, build, activations="int8")(x[:rows])
            assert torch.equal(got, expected), f"{build.library.isa}, {rows} rows"


@pytest.mark.parametrize("name", list(KERNEL_TYPES))
def test_a8_prefill_bits_are_the_same_on_every_build(name):
    """300 rows: the many-row path (weights decoded once per row panel; on VNNI CPUs two columns
    per zmm for the 32-weight formats) keeps the bits of the AVX2 build."""
    avx2 = isa_backend("avx2")
    qtype = KERNEL_TYPES[name]
    in_features = block_of(name) * (20 if block_of(name) == 32 else 3)
    blocks = random_blocks(name, 23, in_features, seed=8)  # odd N: a partial column tile
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(9))  # [300, K]
    expected = GGUFLinear(blocks, qtype, in_features, None, avx2, activations="int8")(x)
    for build in other_builds():
        assert torch.equal(GGUFLinear(blocks, qtype, in_features, None, build, activations="int8")(x), expected)


@pytest.mark.parametrize("name", list(KERNEL_TYPES))
def test_the_avx_vnni_build_keeps_the_avx2_bits_with_fp32_activations(name):
    """avx2-vnni changes only the integer dot products: the exact mode (fp32 activations) is the AVX2
    build's, bitwise, at the few-row and the many-row sizes."""
    from specdec.kernels.build import cpu_isas

    if "avx2-vnni" not in cpu_isas():
        pytest.skip("this CPU has no AVX-VNNI")
    avx2, vnni = isa_backend("avx2"), isa_backend("avx2-vnni")
    qtype = KERNEL_TYPES[name]
    in_features = block_of(name) * (20 if block_of(name) == 32 else 3)
    blocks = random_blocks(name, 23, in_features, seed=10)
    x = torch.randn(40, in_features, generator=torch.Generator().manual_seed(11))  # [40, K]
    for rows in (1, 4, 40):
        outputs = [GGUFLinear(blocks, qtype, in_features, None, b)(x[:rows]) for b in (avx2, vnni)]
        assert torch.equal(*outputs), f"{rows} rows"


def amx_library():
    """The AVX-512 kernel with AMX tiles turned on, or a skip saying why they cannot be."""
    library = isa_backend("avx512").library
    was_on = library.amx  # off under SPECDEC_KERNEL_AMX=0: the other tests then run on VNNI
    if not library.set_amx(True):
        pytest.skip("no AMX here: the CPU lacks amx_tile / amx_int8, the build or compiler lacks them, "
                    "or Linux refused the tile state")
    library.set_amx(was_on)
    return library


@pytest.mark.parametrize("name", list(KERNEL_TYPES))
def test_a8_bits_are_the_same_on_amx_vnni_and_avx2(name):
    """AMX tiles (K-quants, forced on from 1 row so every tile path runs: 4, 8 and 16 rows per B
    tile, 16-row activation blocks past 16) give the bits of the VNNI tiles and of the AVX2 build,
    for any row count, odd N (a partial 16-row weight tile), and 1 or 2 threads."""
    library, avx2 = amx_library(), isa_backend("avx2")
    avx512, was_on = isa_backend("avx512"), library.amx
    qtype = KERNEL_TYPES[name]
    in_features = block_of(name) * (24 if block_of(name) == 32 else 15)  # past the 512-weight AMX K-chunk
    blocks = random_blocks(name, 45, in_features, seed=11)  # 45 = 2 full 16-row tiles + 13
    bias = torch.randn(45, generator=torch.Generator().manual_seed(12))
    layers = [GGUFLinear(blocks, qtype, in_features, bias, b, activations="int8") for b in (avx512, avx2)]
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(13)) * 2.0  # [300, K]
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for rows in (1, 2, 5, 8, 16, 300):
                # the raw blocks (the layer runs few rows on its 16-column copy where it has one)
                library.set_amx(True, min_rows=1)
                on_amx = library.linear_gguf_a8(x[:rows], blocks, qtype, bias, num_threads)  # [rows, 45]
                library.set_amx(False)
                on_vnni = library.linear_gguf_a8(x[:rows], blocks, qtype, bias, num_threads)
                assert torch.equal(on_amx, on_vnni), f"AMX != VNNI at {rows} rows, {num_threads} threads"
                assert torch.equal(on_vnni, layers[1](x[:rows])), f"VNNI != AVX2 at {rows} rows"
                assert torch.equal(layers[0](x[:rows]), on_vnni), f"the AVX-512 layer differs at {rows} rows"
        library.set_amx(True, min_rows=1)
        # a row's bits do not depend on its position in the call: row 17 (block 2 of 16) alone
        assert torch.equal(library.linear_gguf_a8(x[:40], blocks, qtype, bias, 2)[17],
                           library.linear_gguf_a8(x[17:18], blocks, qtype, bias, 2)[0])
    finally:
        torch.set_num_threads(threads)
        library.set_amx(was_on)


def test_q6_k_amx_planes_are_exact_at_the_extremes():
    """Q6_K on AMX multiplies each quant by its sub-block scale in the decode and splits the int16
    into a signed high and an unsigned low byte plane: the extremes (q - 32 = -32 or 31, scales
    -128 / 127 / 0, activations at +-amax, so |w| up to 4096 and every low byte) keep the bits of
    the VNNI and AVX2 kernels."""
    library, avx2 = amx_library(), isa_backend("avx2")
    was_on = library.amx
    rows, in_features = 19, 3 * 256
    blocks = random_blocks("Q6_K", rows, in_features, seed=21).view(rows, -1, 210).clone()  # [N, K / 256, 210]
    ql, qh, scales = blocks[..., :128], blocks[..., 128:192], blocks[..., 192:208]
    ql[:6], qh[:6] = 0x00, 0x00  # q = 0: q - 32 = -32
    ql[6:12], qh[6:12] = 0xFF, 0xFF  # q = 63: q - 32 = 31
    scales[0::3] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
    scales[1::3] = 127
    scales[2::3, :, ::2] = 0
    x = torch.randn(16, in_features, generator=torch.Generator().manual_seed(22))  # [16, K]
    x[:, ::5] = x.abs().amax(dim=1, keepdim=True) * torch.where(torch.arange(x.shape[1] // 5 + 1)[None] % 2 == 0, 1.0, -1.0)
    blocks = blocks.reshape(rows, -1)
    qtype = KERNEL_TYPES["Q6_K"]
    avx2_layer = GGUFLinear(blocks, qtype, in_features, None, avx2, activations="int8")
    try:
        for num_rows in (5, 8, 16):
            library.set_amx(True, min_rows=1)
            on_amx = library.linear_gguf_a8(x[:num_rows], blocks, qtype, None, 2)  # [num_rows, 19]
            library.set_amx(False)
            assert torch.equal(on_amx, library.linear_gguf_a8(x[:num_rows], blocks, qtype, None, 2)), f"AMX != VNNI at {num_rows} rows"
            assert torch.equal(on_amx, avx2_layer(x[:num_rows])), f"AMX != AVX2 at {num_rows} rows"
    finally:
        library.set_amx(was_on)


def test_amx_switch_turns_the_tiles_off():
    import subprocess
    import sys

    amx_library()  # skips without AMX
    code = "from specdec.kernels import CppSkinnyLinear; print(CppSkinnyLinear(isa='avx512').library.amx)"
    for value, expected in (("0", "False"), ("1", "True")):
        env = dict(os.environ, SPECDEC_KERNEL_AMX=value)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == expected, (value, result.stdout)


def test_a_compiler_without_amx_intrinsics_builds_the_kernel_without_tiles(tmp_path):
    """gcc < 11 rejects -mamx-tile / -mamx-int8: the build falls back to the same AVX-512 kernel
    without tiles (VNNI, the same a8 bits) instead of to no kernel at all."""
    amx_library()  # skips where there are no tiles to fall back from
    from specdec.kernels import load_library
    from specdec.kernels.build import find_compiler

    wrapper = tmp_path / "cxx-without-amx"
    wrapper.write_text("#!/bin/sh\n"
                       'for arg in "$@"; do case "$arg" in -mamx*) echo "unrecognized option $arg" >&2; exit 1;; esac; done\n'
                       f'exec "{find_compiler()}" "$@"\n')
    wrapper.chmod(0o755)
    library = load_library(compiler=str(wrapper), isa="avx512", cache_dir=tmp_path / "kernels")
    assert library.vector_width == 16 and library.a8_vnni
    assert not library.set_amx(True) and not library.amx


def test_a_compiler_without_avx_vnni_gives_the_avx2_build(tmp_path, monkeypatch):
    """On an AVX2 CPU with AVX-VNNI the widest build is avx2-vnni; a compiler that rejects -mavxvnni
    (gcc < 11) gives the AVX2 build instead of no kernel, unless avx2-vnni was asked for by name."""
    from specdec.kernels import build, load_library
    from specdec.kernels.build import find_compiler

    if not {"avx2", "fma", "f16c"} <= build.cpu_flags():
        pytest.skip("no AVX2 here")
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx_vnni"})  # as an Alder Lake laptop
    monkeypatch.delenv("SPECDEC_KERNEL_ISA", raising=False)
    wrapper = tmp_path / "cxx-without-avx-vnni"
    wrapper.write_text("#!/bin/sh\n"
                       'for arg in "$@"; do case "$arg" in -mavxvnni) echo "unrecognized option $arg" >&2; exit 1;; esac; done\n'
                       f'exec "{find_compiler()}" "$@"\n')
    wrapper.chmod(0o755)
    library = load_library(compiler=str(wrapper), cache_dir=tmp_path / "kernels")
    assert library.isa == "avx2" and not library.a8_vnni
    with pytest.raises(KernelUnavailable, match="failed"):
        load_library(compiler=str(wrapper), isa="avx2-vnni", cache_dir=tmp_path / "kernels")


def test_a8_mode_errors_are_clear():
    backend = CppSkinnyLinear()
    blocks = random_blocks("Q8_0", 4, 64, seed=0)
    with pytest.raises(ValueError, match="activations must be one of"):
        GGUFLinear(blocks, KERNEL_TYPES["Q8_0"], 64, None, backend, activations="int4")
    q2_k = int(GGMLQuantizationType.Q2_K)  # a format neither mode computes on
    with pytest.raises(ValueError, match="does not compute on GGUF type Q2_K"):
        GGUFLinear(torch.zeros(4, 84, dtype=torch.uint8), q2_k, 256, None, backend, activations="int8")


# ------------------------------------------------------------------ SmolLM2 in the a8 mode

PROMPTS = [
    "Repeat this list exactly twice: apple, banana, cherry, date, elderberry, fig, grape.",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def smollm2_a8():
    from specdec.api import load_target

    skip_without_kernel()
    return load_target("smollm2-135m", progress=False, weights="gguf-a8")


@pytest.mark.slow
def test_smollm2_loads_its_blocks_with_int8_activations(smollm2_a8):
    assert smollm2_a8.weights == "gguf-a8"
    linears = [m for m in smollm2_a8.model.modules() if isinstance(m, GGUFLinear)]
    assert linears and all(m.activations == "int8" for m in linears)  # lm_head (tied) included
    assert isinstance(smollm2_a8.model.lm_head, GGUFLinear)
    assert all(isinstance(m, GGUFEmbedding) for m in [smollm2_a8.model.model.embed_tokens])  # lookup unchanged


@pytest.mark.slow
@pytest.mark.parametrize("drafter_name, options", [("pld", {}), ("layer-skip", {"num_layers": 6, "gamma": 3})])
def test_speculation_reproduces_a8_plain_greedy(smollm2_a8, drafter_name, options):
    accepted = 0
    for prompt in PROMPTS:
        plain = generate(smollm2_a8, prompt, max_new_tokens=40)
        drafter = make_drafter(drafter_name, smollm2_a8, **options)
        speculative = generate(smollm2_a8, prompt, drafter, max_new_tokens=40)
        assert speculative.tokens == plain.tokens, (drafter_name, prompt)
        accepted += speculative.stats.accepted_tokens
    assert accepted > 0  # multi-token verify forwards did run and were accepted


@pytest.mark.slow
def test_quality_check_scores_the_fixed_text_in_both_modes(smollm2_a8, kernel_quality):
    measure_quality, score_logits = kernel_quality.measure_quality, kernel_quality.score_logits
    set_activations = kernel_quality.set_activations
    result = measure_quality(smollm2_a8)  # leaves the model in int8 mode, as it was loaded
    assert result["tokens"] > 400
    # int8 activation blocks move the logits a little: the same text, nearly the same predictions
    assert result["top1_agreement"] > 0.9
    assert abs(math.log(result["ppl_a8"] / result["ppl_exact"])) < 0.05
    assert 0 < result["mean_kl"] < 0.05
    ids = torch.tensor(smollm2_a8.tokenizer("def f(x):\n    return x + 1\n")["input_ids"])
    a8 = score_logits(smollm2_a8, ids)
    set_activations(smollm2_a8.model, "fp32")
    try:
        exact = score_logits(smollm2_a8, ids)
    finally:
        set_activations(smollm2_a8.model, "int8")
    assert torch.equal(score_logits(smollm2_a8, ids), a8)  # switching back restores the a8 model exactly
    assert not torch.equal(exact, a8)


@pytest.mark.slow
def test_llama_cpp_scores_the_same_file_close_to_the_a8_mode(smollm2_a8, kernel_quality):
    """The quality check's peer column: llama.cpp's logits for the same ids (optional extra)."""
    from specdec.bench.peers import LLAMA_CPP

    if LLAMA_CPP.missing():
        pytest.skip(LLAMA_CPP.missing())
    ids = torch.tensor(smollm2_a8.tokenizer(kernel_quality.QUALITY_TEXT)["input_ids"][:200])
    theirs = kernel_quality.llama_cpp_logits("smollm2-135m", ids)  # [T, V]
    ours = kernel_quality.score_logits(smollm2_a8, ids)
    result = kernel_quality.compare(ours, theirs[:, : ours.shape[-1]], ids)
    # both quantize activations to int8 blocks (in different ways): close, not equal
    assert result["top1_agreement"] > 0.9
    assert abs(math.log(result["ppl_a8"] / result["ppl_exact"])) < 0.05
