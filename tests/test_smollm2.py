"""The native runtime on the real SmolLM2 checkpoint vs transformers (logits and greedy generate)."""

import pytest
import torch
from conftest import assert_close_to_scale

from specdec import generate

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write one sentence about cats.", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    from transformers import AutoModelForCausalLM

    from specdec.models.hf import transformers_load_kwargs

    # the cache keeps GGUF blocks: transformers reads (and dequantises) the source GGUF instead
    return AutoModelForCausalLM.from_pretrained(smollm2.model_dir, dtype=torch.float32,
                                                **transformers_load_kwargs(smollm2.model_dir)).eval()


def test_native_logits_equal_transformers(smollm2, hf_smollm2):
    ids = torch.tensor([smollm2.encode_prompt(PROMPTS[0])])
    with torch.no_grad():
        ref = hf_smollm2(ids).logits
    cache = smollm2.new_cache(1, 256)
    logits, _ = smollm2.forward(ids, torch.arange(ids.shape[1])[None], cache)
    assert_close_to_scale(logits, ref, what="logits")  # the kernel vs BLAS, 30 layers: ~2e-6 of the scale


def test_greedy_generate_equals_transformers_generate(smollm2, hf_smollm2):
    for prompt in PROMPTS:
        ids = smollm2.encode_prompt(prompt)
        with torch.no_grad():
            ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        ours = generate(smollm2, prompt, max_new_tokens=32).tokens
        assert ours == ref, prompt


def test_chat_template_is_applied_to_text_prompts(smollm2):
    ids = smollm2.encode_prompt("Hello")
    text = smollm2.tokenizer.decode(ids)
    assert "user" in text and "assistant" in text and "Hello" in text
    assert smollm2.encode_prompt([1, 2, 3]) == [1, 2, 3]  # token ids are used verbatim
