"""Shared fixtures."""

import os

import specdec  # noqa: F401  (first: the package sets OMP_WAIT_POLICY before torch is imported, docs/architecture.md "Machine facts")
import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# Two float32 computations of one function that add in a different order (the kernel's AVX2 or
# AVX-512 build, torch's BLAS, a cached vs a full forward, another thread count) differ by rounding
# that grows with the values' magnitude: ~2e-6 of their scale in this suite's models (tiny and
# SmolLM2's 30 layers alike, measured with all three linear backends). A wrong mask, position or
# weight moves them by a large part of it.
FLOAT32_REL = 1e-4


def kernel_is_on() -> bool:
    """Whether the native runtime gets the compiled kernel here (SPECDEC_LINEAR=torch turns it off;
    so does a machine without a compiler): GGUF block weights and the bitwise contracts need it."""
    from specdec.kernels import make_backend

    return make_backend().backend.name == "cpp"


def skip_without_kernel() -> None:
    if not kernel_is_on():
        pytest.skip("needs the compiled kernel (off here: SPECDEC_LINEAR=torch or no compiler)")


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rel: float = FLOAT32_REL,
                          what: str = "values") -> None:
    """max |actual - expected| <= rel * max |expected|: a tolerance that scales with the values."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = float((actual.double() - expected.double()).abs().max())
    scale = float(expected.double().abs().max())
    assert error <= rel * scale, f"{what}: max |difference| {error:.3g} > {rel:g} x scale {scale:.3g}"


def _tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    base = dict(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    if model_type == "qwen3":
        base["head_dim"] = 16
    if model_type == "gemma3_text":  # Gemma 3: a 4-token sliding window on every layer but the middle one
        base.update(head_dim=16, sliding_window=4)
    base.update(overrides)
    if model_type == "gemma3_text" and "layer_types" not in overrides:
        layers = base["num_hidden_layers"]
        base["layer_types"] = ["full_attention" if i == layers // 2 else "sliding_attention" for i in range(layers)]
    return AutoConfig.for_model(model_type, **base)


def make_tiny_hf_dir(path, model_type: str = "llama", seed: int = 0, **overrides):
    """A randomly initialised transformers model saved as an HF directory (config + safetensors + tokenizer)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # random init is tiny-std: scale up so logits are not flat and argmax ties are unlikely
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.2)
            elif "norm" not in str(param.shape):
                param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)
    _write_byte_tokenizer(path, cfg.vocab_size)
    return path, model.eval()


def _write_byte_tokenizer(path, vocab_size: int):
    """A tiny real tokenizer (character level over printable ASCII) so tiny models have a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + vocab_size - 2)]
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="</s>")
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """name -> (hf_dir, transformers model) for tiny random Llama / Qwen2 / Qwen3 models."""
    root = tmp_path_factory.mktemp("tiny")
    return {mt: make_tiny_hf_dir(root / mt, mt, seed=i) for i, mt in enumerate(("llama", "qwen2", "qwen3"))}


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    """(hf_dir, transformers model) for a tiny random Gemma 3 text model (sliding + full attention layers)."""
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny") / "gemma3", "gemma3_text", seed=3)


@pytest.fixture(scope="session")
def tiny_target(tiny_dirs):
    from specdec.models.llama import load_native

    return load_native(tiny_dirs["llama"][0], name="tiny-llama")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (installed from PyPI and converted once into the cache)."""
    from specdec import load_target

    return load_target("smollm2-135m", progress=False)


# The tiny "counter" target the training and head-drafter tests share (tests/train_support.py);
# one per test module, as each module's own fixture was.
@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    from train_support import make_counter_target

    return make_counter_target(tmp_path_factory.mktemp("counter") / "model", seed=0)


@pytest.fixture(scope="module")
def counter_data(counter, tmp_path_factory):
    from train_support import counter_selfdistill_data

    return counter_selfdistill_data(counter, tmp_path_factory.mktemp("counter_data") / "data")
