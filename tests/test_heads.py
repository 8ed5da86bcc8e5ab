"""The head modules reuse the target's own RMSNorm, rotary table and block layout (specdec.heads)."""

import pytest
import torch

from specdec.heads import HEAD_TYPES, FrozenTargetParts, build_heads, load_checkpoint, save_checkpoint, target_description
from specdec.heads.modules import TargetRope
from specdec.models.llama import load_native


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_heads_use_the_targets_norm_and_rope_exactly(tiny_dirs, model_type, dtype):
    target = load_native(tiny_dirs[model_type][0], dtype=dtype, name=model_type, linear="torch")
    hidden = torch.randn(2, 5, target.hidden_size, generator=torch.Generator().manual_seed(0)).to(target.dtype)
    parts = FrozenTargetParts.from_target(target)
    assert torch.equal(parts.final_norm(hidden), target.model.model.norm(hidden))
    positions = torch.arange(10).view(2, 5) + 3
    heads_rope, target_rope = TargetRope(target.config)(positions, target.dtype), target.model.rope(positions, target.dtype)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(heads_rope, target_rope))
    # a block copied from the target has the target's parameter names and flags (qk-norm, biases)
    heads = build_heads("mtp-parallel", target, 1)
    assert heads.blocks[0].state_dict().keys() == target.model.model.layers[-1].state_dict().keys()


@pytest.mark.parametrize("kind", sorted(HEAD_TYPES))
def test_checkpoint_round_trip_keeps_keys_and_outputs(tiny_target, tmp_path, kind):
    torch.manual_seed(0)
    heads = build_heads(kind, tiny_target, 2)
    with torch.no_grad():
        for param in heads.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    save_checkpoint(tmp_path, heads, target_description(tiny_target))
    loaded, config = load_checkpoint(tmp_path, tiny_target)
    assert config["head"]["kind"] == kind and loaded.state_dict().keys() == heads.state_dict().keys()
    parts = FrozenTargetParts.from_target(tiny_target)
    hidden = torch.randn(1, 4, tiny_target.hidden_size * len(heads.input_layers))  # EAGLE-3 fuses three layers
    tokens, positions = torch.tensor([[5, 6, 7, 8]]), torch.arange(4)[None]
    with torch.no_grad():
        assert torch.equal(loaded(hidden, tokens, positions, parts), heads.eval()(hidden, tokens, positions, parts))


@pytest.mark.parametrize("kind", ["mtp-parallel", "mtp-sequential", "eagle1"])
def test_heads_start_from_a_gguf_block_target_as_from_its_fp32_twin(kind):
    """The registry's default weights="gguf" keeps the target's blocks quantized; a head that starts
    as a copy of a target block must read them dequantized, exactly as the fp32 target holds them."""
    from specdec import load_target

    block_target = load_target("smollm2-135m", progress=False)  # default: GGUF blocks in the kernel
    fp32_target = load_target("smollm2-135m", weights="fp32", progress=False)
    from_blocks = build_heads(kind, block_target, 2).state_dict()
    from_fp32 = build_heads(kind, fp32_target, 2).state_dict()
    assert from_blocks.keys() == from_fp32.keys()
    copied = [name for name in from_blocks if ".block" in f".{name}" or name.startswith("blocks")]
    assert copied, "the head copies no target block: the test checks nothing"
    for name in from_blocks:
        if torch.is_floating_point(from_blocks[name]):
            assert torch.equal(from_blocks[name], from_fp32[name]), name


@pytest.mark.parametrize("weights", ["gguf", "fp32"])
def test_frozen_parts_of_a_tied_target_hold_one_dense_matrix(weights):
    """SmolLM2 ties its LM head to its embeddings: the frozen parts keep one dense copy for both
    (a GGUF-block target used to dequantize the table twice), equal to the LM head's own matrix."""
    from specdec import load_target

    target = load_target("smollm2-135m", weights=weights, progress=False)
    assert target.config.tie_word_embeddings
    parts = FrozenTargetParts.from_target(target)
    assert parts.lm_head_weight.data_ptr() == parts.embed_weight.data_ptr()
    lm_head = target.model.lm_head
    dense = lm_head.fp32_weight() if hasattr(lm_head, "fp32_weight") else lm_head.weight
    assert torch.equal(parts.lm_head_weight, dense)


def test_a_bf16_lm_head_gives_autocast_the_same_logits_and_gradients(smollm2):
    """Training in bf16 keeps one bf16 copy of the frozen LM head (trainer): under autocast the logits
    and the readout's gradient are bitwise what the fp32 head re-cast on every call gives."""
    from specdec.heads import FrozenTargetParts

    parts = FrozenTargetParts.from_target(smollm2).to(dtype=torch.float32)
    bf16 = parts.with_lm_head_dtype(torch.bfloat16)
    assert bf16.lm_head_weight.dtype == torch.bfloat16 and bf16.embed_weight.dtype == torch.float32
    readout = torch.randn(5, parts.lm_head_weight.shape[1], generator=torch.Generator().manual_seed(0))
    results = []
    for frozen in (parts, bf16):
        x = readout.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = frozen.lm_head(x)
        logits.float().logsumexp(-1).sum().backward()
        results.append((logits, x.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
