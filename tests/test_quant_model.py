"""A GGUF-sourced model run as its file stores it (weights="gguf", the default) is bitwise the
dequantized-fp32 model (weights="fp32"): tiny quantized GGUFs of both native architectures, and
the real SmolLM2 and Qwen2.5-Coder-0.5B files."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from specdec import generate, load_target
from specdec.kernels import GGUFEmbedding, GGUFLinear
from specdec.models.gguf import read_block_types, read_gguf_state_dict
from specdec.models.hf import HFTarget
from specdec.models.llama import load_native
from specdec.models.registry import resolve_model_dir

from conftest import skip_without_kernel
from test_registry import tiny_model, write_tiny_gguf

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.fixture(autouse=True)
def kernel_or_skip():
    skip_without_kernel()  # GGUF blocks run in the kernel (SPECDEC_LINEAR=torch turns it off)


def quant_types(arch, model):
    """A mix like the registry files: Q8_0 embedding (and head), Q4_1 / Q5_0 / Q4_0 projections."""
    kinds = {"q_proj": Q.Q4_1, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q4_0, "gate_proj": Q.Q4_1,
             "up_proj": Q.Q5_0, "down_proj": Q.Q8_0}  # fmt: skip
    types = {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q5_0}
    for name in model.state_dict():
        projection = name.split(".")[-2]
        if name.endswith(".weight") and projection in kinds:
            types[name] = kinds[projection]
    return types


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def quantized_gguf(request, tmp_path_factory):
    """(arch, GGUF path, its converted dir in a private cache): converted once per module."""
    model = tiny_model(request.param)
    root = tmp_path_factory.mktemp(f"qgguf-{request.param}")
    path = write_tiny_gguf(root / "tiny-q.gguf", request.param, model, quant_types(request.param, model))
    with pytest.MonkeyPatch.context() as patch:  # only the conversion: the kernel stays in the usual cache
        patch.setenv("SPECDEC_CACHE", str(root / "cache"))
        model_dir = resolve_model_dir(path, progress=False)
    return request.param, path, model_dir


def _logits(target, ids):
    cache = target.new_cache(1, 64)
    logits, _ = target.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    return logits[0]  # [T, V]


def test_tiny_quantized_gguf_runs_as_stored_and_equals_fp32_bitwise(quantized_gguf):
    arch, path, model_dir = quantized_gguf
    block_types = read_block_types(model_dir / "model.safetensors")
    assert len(block_types) == 7 * 2 + 1 + (arch == "qwen2")  # projections, embedding (+ untied head)
    stored, dense = load_native(model_dir), load_native(model_dir, weights="fp32")
    assert (stored.weights, dense.weights) == ("gguf", "fp32")
    assert stored.dtype == torch.float32 and stored.linear_backend == "cpp"
    assert isinstance(stored.model.model.embed_tokens, GGUFEmbedding)
    assert isinstance(stored.model.model.layers[1].mlp.down_proj, GGUFLinear)
    if arch == "llama":  # tied head: the head runs on the embedding's own blocks
        assert stored.model.lm_head.weight is stored.model.model.embed_tokens.weight
    # the fp32 path is exactly what the all-fp32 converter produced (gguf's dequantize, unpermuted)
    reference = read_gguf_state_dict(path)
    for name, tensor in dense.model.state_dict().items():
        if name in reference:
            assert torch.equal(tensor, torch.from_numpy(reference[name])), name
    ids = list(range(3, 40))
    assert torch.equal(_logits(stored, ids), _logits(dense, ids))
    for prompt in ("he thought: the tea", [5, 6, 7]):
        a = generate(stored, prompt, max_new_tokens=12)
        b = generate(dense, prompt, max_new_tokens=12)
        assert a.tokens == b.tokens and len(a.tokens) > 0


def test_blocks_are_read_into_huge_page_memory_with_the_file_bytes(quantized_gguf):
    """The loader reads the blocks again with plain file reads into one 2 MiB-aligned buffer (the
    kernel streams them every forward): the same bytes as safetensors' own reader, every tensor
    on a 4 KiB boundary, and the modules compute on that memory."""
    from safetensors.torch import load_file

    from specdec.models.gguf import read_blocks_in_huge_pages

    _, _, model_dir = quantized_gguf
    weights_file = model_dir / "model.safetensors"
    names = sorted(read_block_types(weights_file))
    expected = load_file(weights_file)
    read = read_blocks_in_huge_pages(weights_file, names)
    assert sorted(read) == names
    for name in names:
        assert torch.equal(read[name], expected[name]), name
        assert read[name].data_ptr() % 4096 == 0
    base = min(tensor.data_ptr() for tensor in read.values())
    assert base % (2 * 1024 * 1024) == 0
    target = load_native(model_dir)
    module = target.model.model.layers[0].self_attn.q_proj
    assert isinstance(module, GGUFLinear) and torch.equal(module.weight, expected["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(KeyError, match="no tensor 'no.such.tensor'"):
        read_blocks_in_huge_pages(weights_file, ["no.such.tensor"])


def test_weights_option_errors_are_clear(quantized_gguf, tmp_path, monkeypatch):
    from conftest import make_tiny_hf_dir

    _, _, model_dir = quantized_gguf
    with pytest.raises(ValueError, match="weights must be one of gguf, gguf-a8, fp32"):
        load_native(model_dir, weights="int4")
    with pytest.raises(ValueError, match="float32 activations"):
        load_native(model_dir, dtype="bfloat16", weights="gguf")
    with pytest.raises(ValueError, match="weights='gguf-a8' runs float32 activations"):
        load_native(model_dir, dtype="bfloat16", weights="gguf-a8")
    assert load_native(model_dir, dtype="bfloat16").weights == "fp32"  # unset: dense bf16
    hf_dir, _ = make_tiny_hf_dir(tmp_path / "hf", "qwen2")
    for blocks_mode in ("gguf", "gguf-a8"):
        with pytest.raises(ValueError, match="holds no GGUF blocks"):
            load_native(hf_dir, weights=blocks_mode)
    assert load_native(hf_dir).weights == "fp32"
    monkeypatch.setenv("SPECDEC_LINEAR", "torch")  # kernel off: the blocks are dequantized at load
    assert load_native(model_dir).weights == "fp32"
    with pytest.raises(ValueError, match="needs the compiled kernel"):
        load_native(model_dir, weights="gguf")
    with pytest.raises(ValueError, match="needs the compiled kernel"):
        load_native(model_dir, weights="gguf-a8")


def test_transformers_reads_a_block_cache_through_its_source_gguf(quantized_gguf):
    """The bench's transformers peers load the same converted dir (HFTarget.from_dir)."""
    _, _, model_dir = quantized_gguf
    peer = HFTarget.from_dir(model_dir)
    dense = load_native(model_dir, weights="fp32")
    ids = list(range(3, 20))
    scale = float(_logits(dense, ids).abs().max())
    torch.testing.assert_close(_logits(peer, ids), _logits(dense, ids), rtol=1e-4, atol=1e-4 * scale)


def _assert_real_model_gguf_equals_fp32(name):
    stored = load_target(name, progress=False)
    assert stored.weights == "gguf"
    ids = [stored.encode_prompt(p) for p in PROMPTS]
    stored_logits = [_logits_long(stored, i) for i in ids]
    stored_out = [generate(stored, p, max_new_tokens=24).tokens for p in PROMPTS]
    del stored
    dense = load_target(name, progress=False, weights="fp32")
    assert dense.weights == "fp32"
    for i, logits in zip(ids, stored_logits):
        assert torch.equal(_logits_long(dense, i), logits)
    assert [generate(dense, p, max_new_tokens=24).tokens for p in PROMPTS] == stored_out


def _logits_long(target, ids):
    cache = target.new_cache(1, len(ids) + 8)
    logits, _ = target.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    return logits[0, -4:]  # [4, V]: enough to compare, small to keep


@pytest.mark.slow
def test_smollm2_gguf_weights_equal_fp32_weights_bitwise():
    _assert_real_model_gguf_equals_fp32("smollm2-135m")


@pytest.mark.heavy  # 314 s on 2 cores (the fp32 side dequantizes 2.5 GB at load): run with `pytest -m heavy`
def test_qwen_coder_05b_gguf_weights_equal_fp32_weights_bitwise():
    """Q5_0 / Q8_0 / Q6_K / Q4_K blocks (one Qwen model in memory at a time)."""
    _assert_real_model_gguf_equals_fp32("qwen2.5-coder-0.5b")


@pytest.mark.parametrize("command", [
    ["generate", "hi"], ["bench"], ["profile", "--model", "m"], ["serve"], ["train", "data", "--out", "d"],
    ["train", "medusa", "--data", "d", "--out", "o"], ["train", "eval", "--model", "m", "--checkpoint", "c", "--data", "d"],
])  # fmt: skip
def test_every_command_that_loads_a_target_takes_weights(command):
    from specdec.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([*command, "--weights", "fp32"]).weights == "fp32"
    assert parser.parse_args([*command, "--weights", "gguf-a8"]).weights == "gguf-a8"
    assert parser.parse_args(command).weights is None  # as stored
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--weights", "int4"])


def test_cost_tables_are_per_weight_format(quantized_gguf):
    from specdec.cost import cost_key, default_cache_path

    _, _, model_dir = quantized_gguf
    stored, dense = load_native(model_dir), load_native(model_dir, weights="fp32")
    a8 = load_native(model_dir, weights="gguf-a8")
    assert [cost_key(t)["weights"] for t in (stored, dense, a8)] == ["gguf", "fp32", "gguf-a8"]
    assert len({default_cache_path(cost_key(t)) for t in (stored, dense, a8)}) == 3
    # AMX tiles (where the CPU has them) make another a8 T(k): a table measured without them is not reused
    library = next(m for m in a8.model.modules() if isinstance(m, GGUFLinear)).backend.library
    was_on = library.amx
    try:
        assert cost_key(a8).get("amx", False) == was_on
        library.set_amx(False)
        assert "amx" not in cost_key(a8) and "amx" not in cost_key(stored)
    finally:
        library.set_amx(was_on)


def test_cost_tables_are_per_kernel_build(quantized_gguf):
    """A table timed on one build of the kernel is not reused by another build (the library file
    is named by the digest of its source, flags and compiler), so kernel work never runs on stale T(k)."""
    from specdec.cost import cost_key, default_cache_path

    _, _, model_dir = quantized_gguf
    target = load_native(model_dir)
    library = next(m for m in target.model.modules() if isinstance(m, GGUFLinear)).backend.library
    key = cost_key(target)
    assert key["kernel"] == library.path.stem and library.isa in key["kernel"]
    built_path = library.path
    try:
        library.path = built_path.with_name(f"skinny_gemm-{library.isa}-0123456789abcdef.so")  # another build
        assert cost_key(target)["kernel"] != key["kernel"]
        assert default_cache_path(cost_key(target)) != default_cache_path(key)
    finally:
        library.path = built_path
