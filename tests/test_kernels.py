"""Batch-invariant skinny GEMM (specdec.kernels): bitwise row invariance, agreement with F.linear,
fallbacks without a compiler, and a tiny native model after fast_linear_modules."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_scale

from specdec.kernels import (
    CppSkinnyLinear,
    FastLinear,
    Int8SkinnyLinear,
    KernelUnavailable,
    RowwiseTorchLinear,
    TorchLinear,
    fast_linear_modules,
    make_backend,
    quantize_int8,
)
from specdec.kernels import build
from specdec.models.llama import load_native

# (out, in): vector-width multiples, odd tails in K and in N, a K smaller than one vector, and
# K past one 512-element chunk with a tail (rows > 4 walk K in chunks)
SHAPES = [(64, 128), (29, 37), (131, 1000), (5, 3), (300, 1536), (70, 1027)]


def _cpp_or_skip(isa=None):
    try:
        return CppSkinnyLinear(isa=isa)
    except KernelUnavailable as exc:
        pytest.skip(f"compiled skinny GEMM unavailable here: {exc}")


@pytest.fixture(scope="module")
def cpp_backend():
    return _cpp_or_skip()


@pytest.fixture(scope="module", params=["avx512", "avx2"])
def cpp_backend_per_isa(request):
    """The kernel built for each instruction set this CPU can run (AVX2 also on AVX-512 CPUs)."""
    return _cpp_or_skip(request.param)


def _weights(out_features, in_features, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5  # [N, K]
    return weight, (torch.randn(out_features, generator=gen) if bias else None)


def _assert_rows_batch_invariant(backend, weight, bias, x):
    """Row i of every k-row call (k = 1..len(x)) is bitwise the row run alone."""
    alone = [backend.linear(x[i : i + 1], weight, bias)[0] for i in range(len(x))]  # M x [N]
    for num_rows in range(1, len(x) + 1):
        out = backend.linear(x[:num_rows], weight, bias)  # [k, N]
        for i in range(num_rows):
            assert torch.equal(out[i], alone[i]), f"row {i} of a {num_rows}-row call differs from the row alone"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_cpp_rows_are_bitwise_batch_invariant(cpp_backend_per_isa, shape, with_bias):
    weight, bias = _weights(*shape, seed=shape[0], bias=with_bias)
    x = torch.randn(16, shape[1], generator=torch.Generator().manual_seed(7))  # [16, K]
    _assert_rows_batch_invariant(cpp_backend_per_isa, weight, bias, x)


def test_cpp_prefill_sized_calls_keep_rows_invariant(cpp_backend):
    """Hundreds of rows (a prefill) span several row panels: still the bits of each row alone."""
    weight, bias = _weights(96, 1536, seed=12)
    x = torch.randn(300, 1536)  # [M, K], ~84 rows per panel at K = 1536
    out = cpp_backend.linear(x, weight, bias)  # [300, 96]
    for i in (0, 83, 84, 85, 170, 299):
        assert torch.equal(out[i], cpp_backend.linear(x[i : i + 1], weight, bias)[0]), i
    assert_close_to_scale(out, F.linear(x, weight, bias), what="prefill rows")


def test_cpp_rows_do_not_depend_on_thread_count(cpp_backend):
    weight, bias = _weights(1029, 300, seed=3)  # enough work to be split across threads
    x = torch.randn(9, 300)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpp_backend.linear(x, weight, bias)
        torch.set_num_threads(max(2, threads))
        multi = cpp_backend.linear(x, weight, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, multi)


def test_cpp_concurrent_callers_get_the_same_bits(cpp_backend):
    """Python threads calling at once (a server): one gets the thread pool, the others run
    single-threaded; every result is still bitwise the sequential one."""
    import threading

    weight, bias = _weights(777, 200, seed=8)
    inputs = [torch.randn(1 + i % 5, 200) for i in range(12)]
    expected = [cpp_backend.linear(x, weight, bias) for x in inputs]
    mismatches = []

    def caller(offset):
        for step in range(40):
            i = (offset + step) % len(inputs)
            if not torch.equal(cpp_backend.linear(inputs[i], weight, bias), expected[i]):
                mismatches.append(i)

    callers = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    assert not mismatches


def test_kernel_owns_threads_serialises_torch_and_keeps_the_kernels_count(cpp_backend):
    """Inside the block torch's ops run on one thread and kernel calls on the count torch had;
    nested and concurrent blocks restore it once, also after an exception."""
    import threading

    library = cpp_backend.library
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert library.threads() == 3
        with library.kernel_owns_threads():
            assert (torch.get_num_threads(), library.threads()) == (1, 3)
            with library.kernel_owns_threads():
                assert (torch.get_num_threads(), library.threads()) == (1, 3)
            assert (torch.get_num_threads(), library.threads()) == (1, 3)
        assert (torch.get_num_threads(), library.threads()) == (3, 3)
        with pytest.raises(RuntimeError), library.kernel_owns_threads():
            raise RuntimeError("a failing forward")
        assert torch.get_num_threads() == 3
        inside = threading.Barrier(2)
        seen = []

        def worker():
            with library.kernel_owns_threads():
                inside.wait()  # both blocks open at once
                seen.append((torch.get_num_threads(), library.threads()))
                inside.wait()

        workers = [threading.Thread(target=worker) for _ in range(2)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        assert seen == [(1, 3), (1, 3)] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


def test_native_forward_runs_torch_serial_with_the_kernel_on_every_thread(tmp_path, cpp_backend):
    """A float32 native target on the kernel hands the threads over for each forward (seen from a
    block's forward hook) and gives them back; a bfloat16 one (torch's linears) keeps them."""
    from conftest import make_tiny_hf_dir

    hf_dir, _ = make_tiny_hf_dir(tmp_path / "tiny", "qwen2", seed=3, tie_word_embeddings=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dtype, expected in (("float32", (1, 2)), ("bfloat16", (2, 2))):
            target = load_native(hf_dir, dtype=dtype)
            seen = []
            target.model.model.layers[0].register_forward_hook(
                lambda *_: seen.append((torch.get_num_threads(), cpp_backend.library.threads())))
            _forward_rows(target, list(range(5, 15)), 0, 10, target.new_cache(1, 16))
            assert seen == [expected], dtype
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_cpp_matches_f_linear(cpp_backend_per_isa, shape, with_bias):
    weight, bias = _weights(*shape, seed=11, bias=with_bias)
    for num_rows in (1, 3, 8, 17, 40):  # 40 rows spans several row panels for small K
        x = torch.randn(num_rows, shape[1])
        ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        out = cpp_backend_per_isa.linear(x, weight, bias)
        assert out.dtype == torch.float32 and out.shape == (num_rows, shape[0])
        # fp32 dot products of length K: error grows ~ sqrt(K) * eps * |terms|
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


def test_cpp_handles_leading_dims_and_noncontiguous_input(cpp_backend):
    weight, bias = _weights(48, 40, seed=5)
    x = torch.randn(2, 40, 7).transpose(1, 2)  # [2, 7, 40], not contiguous
    out = cpp_backend.linear(x, weight, bias)  # [2, 7, 48]
    assert out.shape == (2, 7, 48)
    assert_close_to_scale(out, F.linear(x, weight, bias))
    assert torch.equal(out[1, 3], cpp_backend.linear(x[1, 3:4].contiguous(), weight, bias)[0])


def test_cpp_falls_back_to_f_linear_where_the_kernel_does_not_apply(cpp_backend):
    weight, bias = _weights(33, 20, seed=2)
    x = torch.randn(4, 20)
    # bf16: F.linear itself (correct, not promised batch invariant)
    out_bf16 = cpp_backend.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16())
    assert out_bf16.dtype == torch.bfloat16
    assert torch.equal(out_bf16, F.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()))
    assert not cpp_backend.batch_invariant(torch.bfloat16) and cpp_backend.batch_invariant(torch.float32)
    # autograd: the kernel has no backward, so grad-requiring calls go through F.linear
    w_grad = weight.clone().requires_grad_(True)
    cpp_backend.linear(x, w_grad, bias).sum().backward()
    torch.testing.assert_close(w_grad.grad, x.sum(0).expand(33, -1))
    # empty input
    assert cpp_backend.linear(torch.randn(0, 20), weight, bias).shape == (0, 33)


@pytest.mark.parametrize("shape", [(29, 37), (300, 1536), (61, 1029)])
def test_int8_is_batch_invariant_and_matches_dequantized_weights(cpp_backend, shape):
    backend = Int8SkinnyLinear()
    weight, bias = _weights(*shape, seed=9)
    x = torch.randn(16, shape[1])
    _assert_rows_batch_invariant(backend, weight, bias, x)
    quantized, scale = quantize_int8(weight)
    assert quantized.dtype == torch.int8 and int(quantized.abs().max()) == 127
    dequantized = quantized.double() * scale.double()[:, None]  # [N, K]
    assert float((dequantized - weight.double()).abs().max()) <= float(scale.max()) / 2 + 1e-7
    ref = F.linear(x.double(), dequantized, bias.double())
    torch.testing.assert_close(backend.linear(x, weight, bias).double(), ref, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


def test_int8_requantizes_after_an_in_place_weight_update(cpp_backend):
    backend = Int8SkinnyLinear()
    weight, bias = _weights(40, 64, seed=10)
    x = torch.randn(3, 64)
    before = backend.linear(x, weight, bias)
    with torch.no_grad():
        weight.mul_(2.0)
    after = backend.linear(x, weight, bias)
    assert_close_to_scale(after - bias, 2 * (before - bias))


def test_rowwise_fallback_is_batch_invariant_and_correct():
    weight, bias = _weights(131, 1000, seed=4)
    x = torch.randn(8, 1000)
    backend = RowwiseTorchLinear()
    _assert_rows_batch_invariant(backend, weight, bias, x)
    assert_close_to_scale(backend.linear(x, weight, bias), F.linear(x, weight, bias))
    assert backend.linear(x.view(2, 4, 1000), weight, bias).shape == (2, 4, 131)


def test_without_a_compiler_auto_falls_back_to_torch(monkeypatch):
    monkeypatch.delenv("SPECDEC_LINEAR", raising=False)
    choice = make_backend("auto", compiler="none")
    assert isinstance(choice.backend, TorchLinear)
    assert "compiler" in choice.reason
    with pytest.raises(KernelUnavailable, match="compiler"):
        make_backend("cpp", compiler="none")
    monkeypatch.setenv("SPECDEC_CXX", "none")  # the same through the environment
    assert isinstance(make_backend("auto").backend, TorchLinear)
    with pytest.raises(KernelUnavailable):
        CppSkinnyLinear()


def test_a_failing_compiler_means_fallback_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_LINEAR", raising=False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with pytest.raises(KernelUnavailable, match="failed to build"):
        CppSkinnyLinear(compiler="true")  # exits 0 but writes nothing
    choice = make_backend("auto", compiler="true")
    assert isinstance(choice.backend, TorchLinear) and "failed to build" in choice.reason
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left in the cache
    with pytest.raises(ValueError, match="isa"):
        CppSkinnyLinear(isa="sse2")


PARTS = len(list(build.SOURCE_DIR.glob("*.cpp")))


def test_an_edit_to_any_part_or_the_header_builds_afresh(tmp_path, monkeypatch):
    """The cached library is named by a digest of every source file: editing the shared header or
    one part gives another library file, never a stale one."""
    source = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, source)
    monkeypatch.setattr(build, "SOURCE_DIR", source)
    compiler = tmp_path / "c++"  # stands in for the compiler (a real build takes minutes): writes each -o file
    compiler.write_text('#!/bin/sh\nwhile [ $# -gt 1 ]; do [ "$1" = -o ] && echo built > "$2"; shift; done\n')
    compiler.chmod(0o755)
    names = []
    for edited in (None, "skinny_gemm.h", "threads.cpp"):
        if edited:
            (source / edited).write_text((source / edited).read_text() + "\n// edited\n")
        names.append(build.build_library(str(compiler), "avx2", tmp_path / "kernels").name)
    assert len(set(names)) == 3
    assert build.build_library(str(compiler), "avx2", tmp_path / "kernels").name == names[-1]  # unchanged: the same


def _no_kernel_setting(cause: str, tmp_path: Path) -> tuple[dict, str]:
    """Environment in which the kernel cannot be built, and a part of the reason the user must read."""
    if cause == "missing compiler":
        return {"SPECDEC_CXX": str(tmp_path / "no-such-c++")}, "no-such-c++"
    if cause == "unwritable cache":  # the kernels folder cannot be made (chmod does not stop root)
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "kernels").write_text("a file where the kernel cache should be")
        return {"SPECDEC_CACHE": str(tmp_path / "cache")}, "cannot write the kernel cache"
    compiler = tmp_path / "broken-c++"  # a compile error; each run appends a line to `runs`
    compiler.write_text(f'#!/bin/sh\necho run >> "{tmp_path / "runs"}"\necho "fatal error: out of ideas" >&2\nexit 1\n')
    compiler.chmod(0o755)
    return {"SPECDEC_CXX": str(compiler), "SPECDEC_CACHE": str(tmp_path / "cache")}, "fatal error: out of ideas"


@pytest.mark.parametrize("cause", ["missing compiler", "unwritable cache", "compile error"])
def test_a_kernel_that_cannot_be_built_is_reported_once_with_its_reason(tmp_path, cause):
    """Decoding without the kernel runs on PyTorch at about half the speed: the user is told once
    per process why, however many times a backend is chosen, and a failed build is not retried."""
    setting, reason = _no_kernel_setting(cause, tmp_path)
    env = {key: value for key, value in os.environ.items() if key != "SPECDEC_LINEAR"} | setting
    code = "from specdec.kernels import make_backend\nfor _ in range(3): print(make_backend('auto').backend.name)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["torch"] * 3
    (line,) = result.stderr.splitlines()
    assert "could not be built or loaded" in line and reason in line and "slower PyTorch path" in line
    if cause == "compile error":  # one build (two where AMX is retried without tiles), not one per call
        assert len((tmp_path / "runs").read_text().split()) <= 2 * PARTS


@pytest.mark.slow
def test_generate_without_a_compiler_says_so_once(tmp_path, smollm2):
    env = {key: value for key, value in os.environ.items() if key != "SPECDEC_LINEAR"}
    env["SPECDEC_CXX"] = str(tmp_path / "no-such-c++")
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "Say hi", "--model", "smollm2-135m", "--max-new-tokens", "4",
         "--drafter", "pld", "--gamma", "3"], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if "could not be built or loaded" in line]
    assert len(warnings) == 1 and "no-such-c++" in warnings[0], result.stderr
    assert result.stdout.strip()


def test_the_build_is_the_widest_the_cpu_runs_and_a_named_one_must_run_here(monkeypatch):
    avx2 = {"avx2", "fma", "f16c"}
    monkeypatch.delenv(build.ENV_ISA, raising=False)
    for flags, widest in ((avx2, "avx2"), (avx2 | {"avx_vnni"}, "avx2-vnni"), (avx2 | {"avx_vnni", "avx512f"}, "avx512")):
        monkeypatch.setattr(build, "cpu_flags", lambda flags=flags: set(flags))
        assert build.cpu_isa() == build.resolve_isa() == widest
        assert build.resolve_isa("avx2") == "avx2"  # every build of an AVX2 CPU runs the plain AVX2 one too
    monkeypatch.setattr(build, "cpu_flags", lambda: set(avx2))
    with pytest.raises(build.KernelUnavailable, match="cannot run the avx2-vnni kernel"):
        build.resolve_isa("avx2-vnni")
    monkeypatch.setenv(build.ENV_ISA, "avx2vnni")
    with pytest.raises(ValueError, match="avx2-vnni"):  # a misspelt name lists the right ones
        build.resolve_isa()
    monkeypatch.setattr(build, "cpu_flags", lambda: {"sse4_2"})
    with pytest.raises(build.KernelUnavailable, match="lacks AVX2"):
        build.resolve_isa("avx2")
    assert "-mavxvnni" in build.isa_build_flags("avx2-vnni") and "-mavxvnni" not in build.isa_build_flags("avx2")


def test_backend_names_and_env_override(monkeypatch):
    monkeypatch.setenv("SPECDEC_LINEAR", "torch")
    assert make_backend("auto").backend.name == "torch"
    assert make_backend("rowwise").backend.name == "rowwise"  # explicit names win over the env
    monkeypatch.setenv("SPECDEC_LINEAR", "fastest")
    with pytest.raises(ValueError, match="SPECDEC_LINEAR"):
        make_backend("auto")
    with pytest.raises(ValueError, match="choose from"):
        make_backend("cuda")


# ---------------------------------------------------------------- tiny native model


def _forward_rows(target, ids, start, num_new, cache):
    tokens = torch.tensor([ids[start : start + num_new]])
    positions = torch.arange(start, start + num_new)[None]
    logits, hiddens = target.forward(tokens, positions, cache, hidden_layers=(target.num_layers,))
    return logits[0], hiddens[target.num_layers][0]  # [T, V], [T, H]


@pytest.mark.parametrize("model_type, tie", [("llama", False), ("qwen2", True)])
def test_fast_linear_model_matches_plain_model(tmp_path, model_type, tie):
    from conftest import make_tiny_hf_dir

    hf_dir, _ = make_tiny_hf_dir(tmp_path / model_type, model_type, seed=3, tie_word_embeddings=tie)
    plain, fast = load_native(hf_dir), load_native(hf_dir)
    info = fast_linear_modules(fast.model, backend="auto")
    layers = fast.model.config.num_hidden_layers
    assert info["count"] == 7 * layers + 1  # q k v o gate up down per block + lm_head
    assert all(isinstance(m, FastLinear) for m in fast.model.modules() if isinstance(m, torch.nn.Linear))
    if tie:  # the tie survives: lm_head still reads the embedding matrix itself
        assert fast.model.lm_head.weight is fast.model.model.embed_tokens.weight
    ids = list(range(5, 31))
    plain_logits, _ = _forward_rows(plain, ids, 0, len(ids), plain.new_cache(1, 64))  # [T, V]
    fast_logits, _ = _forward_rows(fast, ids, 0, len(ids), fast.new_cache(1, 64))
    exact = load_native(hf_dir, dtype="float64")
    exact_logits, _ = _forward_rows(exact, ids, 0, len(ids), exact.new_cache(1, 64))
    scale = float(exact_logits.abs().max())  # logits here are O(5): compare at 1e-5 of that scale
    torch.testing.assert_close(fast_logits, plain_logits, rtol=1e-5, atol=1e-5 * scale)
    # and the kernel is no less accurate than MKL against a float64 forward
    fast_error = float((fast_logits.double() - exact_logits).abs().max())
    plain_error = float((plain_logits.double() - exact_logits).abs().max())
    assert fast_error <= 2 * plain_error + 1e-6 * scale


def test_fast_linear_model_k_row_verify_equals_one_row_steps(tmp_path, cpp_backend):
    """A k-token verification forward vs k one-token decode steps on a tiny model: every
    linear layer's output rows in the k-row forward are bitwise what that layer gives for each
    row alone, and the logits agree to fp32 accuracy. (Whole-forward bitwise equality is not
    promised: attention (SDPA) sums differently for T = 1 and T = k.)"""
    from conftest import make_tiny_hf_dir

    hf_dir, _ = make_tiny_hf_dir(tmp_path / "m", "qwen2", seed=4)
    target = load_native(hf_dir)
    info = fast_linear_modules(target.model, backend="cpp")
    assert info["backend"] == "cpp" and info["batch_invariant"]
    ids, prefix, k = list(range(3, 23)), 10, 8
    cache = target.new_cache(1, 64)
    _forward_rows(target, ids, 0, prefix, cache)
    seen = []  # (module, input [1, k, in], output [1, k, out]) of every linear in the k-row forward
    hooks = [
        module.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0], out)))
        for module in target.model.modules()
        if isinstance(module, FastLinear)
    ]
    try:
        verify_logits, _ = _forward_rows(target, ids, prefix, k, cache)  # [k, V]
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == info["count"]
    with torch.inference_mode():
        for module, layer_in, layer_out in seen:
            for i in range(k):
                assert torch.equal(module(layer_in[:, i : i + 1])[0, 0], layer_out[0, i])
    cache.truncate(torch.tensor([prefix]))
    step_logits = torch.cat([_forward_rows(target, ids, prefix + i, 1, cache)[0] for i in range(k)])  # [k, V]
    scale = float(step_logits.abs().max())
    torch.testing.assert_close(verify_logits, step_logits, rtol=1e-5, atol=1e-5 * scale)
    assert torch.equal(verify_logits.argmax(-1), step_logits.argmax(-1))


def test_int8_model_is_close_to_fp32_and_keeps_the_tie(tmp_path, cpp_backend):
    from conftest import make_tiny_hf_dir

    hf_dir, _ = make_tiny_hf_dir(tmp_path / "q", "qwen2", seed=5, tie_word_embeddings=True)
    plain, quantized = load_native(hf_dir), load_native(hf_dir)
    info = fast_linear_modules(quantized.model, backend="int8")
    assert info["backend"] == "int8" and info["quantized"] and info["batch_invariant"]
    assert quantized.model.lm_head.weight is quantized.model.model.embed_tokens.weight
    assert quantized.model.model.embed_tokens.weight.dtype == torch.float32  # lookups stay exact
    ids = list(range(5, 31))
    plain_logits, _ = _forward_rows(plain, ids, 0, len(ids), plain.new_cache(1, 64))  # [T, V]
    int8_logits, _ = _forward_rows(quantized, ids, 0, len(ids), quantized.new_cache(1, 64))
    error = float((int8_logits - plain_logits).abs().max()) / float(plain_logits.abs().max())
    assert 0 < error < 0.05  # lossy, but only at the int8 rounding level


def test_fast_linear_models_deepcopy_and_pickle(tmp_path, cpp_backend):
    """Copies of a converted model (drafters copy modules; torch.save pickles) keep working."""
    import copy
    import pickle

    layer = torch.nn.Sequential(torch.nn.Linear(20, 30))
    fast_linear_modules(layer, backend="cpp")
    x = torch.randn(3, 20)
    with torch.no_grad():
        expected = layer(x)
        clone = copy.deepcopy(layer)
        assert clone[0].backend is layer[0].backend and clone[0].weight is not layer[0].weight
        assert torch.equal(clone(x), expected)
        restored = pickle.loads(pickle.dumps(layer))
        assert restored[0].backend.name == "cpp" and torch.equal(restored(x), expected)
