"""DFlash (block diffusion drafting): the block attends non-causally within itself and to the
target's context, the training forward computes what drafting computes, training lowers held-out
loss and resumes exactly after a kill, greedy output through the loop equals plain decoding
(batched), sampled output is distributed like the target (and a wrong q is caught), and the
export is the DFlashDraftModel layout SGLang / vLLM load, loading back with identical logits.

Training tests use the "counter" target of train_support.py (greedy decoding walks a cycle of
tokens); the structural tests run on SmolLM2 (real weights, seconds).
"""

import json

import pytest
import torch
from conftest import assert_close_to_scale
from safetensors.torch import load_file
from test_eagle import WrongQ
from train_support import counter_selfdistill_data, first_proposal, token_marginal_pvalues

from specdec import SamplingParams, generate
from specdec.api import generate_batch
from specdec.drafters.dflash import DFlashDrafter
from specdec.heads import FrozenTargetParts, dflash_hidden_layers, dflash_target_layer_ids, target_description
from specdec.heads.dflash import ANCHOR_FEATURE_LAYOUT, ContextKeys, DFlashModule
from specdec.heads.export import export_dflash, load_dflash_export
from specdec.train import TrainSettings, build_heads, load_samples, train

BLOCK = 5  # the anchor + 4 drafted tokens on the counter


@pytest.fixture(scope="module")
def dflash_data(counter, tmp_path_factory):
    return counter_selfdistill_data(counter, tmp_path_factory.mktemp("dflash_data") / "data", layers=[0, 1, 2, 3])


def _settings(**changes):
    return TrainSettings(**{"steps": 120, "lr": 3e-3, "batch_size": 4, "loss_rows": 256, "warmup_steps": 10,
                            "eval_every": 60, "save_every": 100, "anchors_per_row": 8, **changes})


def _train(counter, data, out, settings=None, **train_options):
    heads = build_heads("dflash", counter, BLOCK - 1, block_size=BLOCK, num_draft_layers=2)
    _, samples = load_samples(data, sorted(set(heads.input_layers)), counter)
    result = train(heads, counter, samples, out, settings or _settings(), target_description(counter), progress=False,
                   log=lambda _: None, **train_options)
    return heads, result


@pytest.fixture(scope="module")
def trained(counter, dflash_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash") / "ckpt"
    heads, result = _train(counter, dflash_data, out)
    return out, result, heads


def _perturbed(module, seed=0, scale=0.05):
    """Random weights on top of the init (output projections start at zero): nothing matches by accident."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param) * scale)
    return module.eval()


def test_fused_layers_are_spread_like_the_published_drafters():
    # z-lab's Qwen3-4B drafter (36 target layers, 5 draft layers) lists target_layer_ids [1, 9, 17, 25, 33]
    assert dflash_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert dflash_target_layer_ids(28, 1) == (14,)
    assert dflash_hidden_layers(30, 3) == (2, 15, 28)  # block i's output is specdec's hidden layer i + 1


@torch.no_grad()
def test_block_attention_is_non_causal_and_reads_the_context(smollm2):
    module = _perturbed(build_heads("dflash", smollm2, 7, block_size=8))
    parts = FrozenTargetParts.from_target(smollm2)
    torch.manual_seed(1)
    length, width = 12, len(module.input_layers) * smollm2.hidden_size
    context = torch.randn(1, length, width)
    states = module.context_states(context)
    kv = module.context_kv(states, torch.arange(length)[None])
    positions = torch.arange(length, length + 8)[None]
    block = module.block_tokens(torch.tensor([100]))  # [1, 8]: anchor, MASK x 7
    base = module.run_block(block, positions, ContextKeys(kv), None, parts)  # [1, 8, H]
    later = block.clone()
    later[0, 6] = 200  # change a LATER block row: earlier rows move (a causal mask would keep them)
    moved = module.run_block(later, positions, ContextKeys(kv), None, parts)
    assert (moved[0, 1] - base[0, 1]).abs().max() > 1e-3 * base.abs().max()
    # the context is real K/V input: changing its first row moves every block row ...
    other = context.clone()
    other[0, 0] += 1.0
    kv_other = module.context_kv(module.context_states(other), torch.arange(length)[None])
    changed = module.run_block(block, positions, ContextKeys(kv_other), None, parts)
    assert ((changed - base).abs().amax(-1) > 1e-3 * base.abs().max()).all()
    # ... unless that row is masked out (block_hidden's context_valid), which equals dropping it
    valid = torch.ones(1, length, dtype=torch.bool)
    valid[0, 0] = False
    masked = module.block_hidden(other, torch.tensor([100]), parts, context_valid=valid)
    dropped = module.block_hidden(other[:, 1:], torch.tensor([100]), parts, context_positions=torch.arange(1, length)[None])
    assert_close_to_scale(masked, dropped, what="masked context row vs no row")
    assert_close_to_scale(module.block_hidden(context, torch.tensor([100]), parts), base[:, 1:], what="block_hidden")


@torch.no_grad()
@pytest.mark.parametrize("anchor_feature", [False, True])
def test_training_forward_is_the_drafting_computation(smollm2, anchor_feature):
    """One pass over many anchors (each block sees only context rows <= its anchor and its own rows)
    equals block_hidden on each anchor's own context, which is what the drafter runs; with
    anchor_feature too (each anchor row adds its own newest context state, not another block's)."""
    module = _perturbed(build_heads("dflash", smollm2, 7, block_size=8, anchor_feature=anchor_feature))
    parts = FrozenTargetParts.from_target(smollm2)
    torch.manual_seed(2)
    batch, length = 2, 24
    hidden = torch.randn(batch, length, len(module.input_layers) * smollm2.hidden_size)
    tokens = torch.randint(0, smollm2.vocab_size, (batch, length))
    positions = torch.arange(length).expand(batch, length)
    anchors = torch.tensor([[3, 10, 19], [0, 7, 22]])
    features = module(hidden, tokens, positions, parts, anchors=anchors)  # [K, B, T, H]
    for b in range(batch):
        for a in anchors[b].tolist():
            expected = module.block_hidden(hidden[b : b + 1, : a + 1], tokens[b : b + 1, a + 1], parts)  # [1, K, H]
            assert_close_to_scale(features[:, b, a], expected[0], what=f"anchor {a} of row {b}")
    untouched = torch.ones(length, dtype=torch.bool)
    untouched[anchors[0]] = False
    assert features[:, 0, untouched].abs().max() == 0  # only anchor rows are computed
    # the switch really changes what the rows compute: the same weights (anchor_norm at its init or dropped)
    flipped = build_heads("dflash", smollm2, 7, block_size=8, anchor_feature=not anchor_feature)
    flipped.load_state_dict(module.state_dict(), strict=False)
    other = flipped(hidden, tokens, positions, parts, anchors=anchors)
    assert (other[:, 0, 3] - features[:, 0, 3]).abs().max() > 1e-3 * features[:, 0, 3].abs().max()


def test_the_anchor_feature_variant_trains_drafts_losslessly_and_does_not_export(counter, dflash_data, tmp_path, capsys):
    """--anchor-feature: recorded in the checkpoint, greedy output through the loop is plain decoding's,
    and `specdec export` refuses it (no engine's layout has it) without writing anything."""
    from specdec.cli import main

    ckpt, export = tmp_path / "ckpt", tmp_path / "export"
    assert main(["train", "dflash", "--model", str(counter.model_dir), "--data", str(dflash_data), "--block-size", "4",
                 "--draft-layers", "1", "--steps", "3", "--batch-size", "2", "--no-progress", "--anchor-feature",
                 "--out", str(ckpt)]) == 0
    head = json.loads((ckpt / "config.json").read_text())["head"]
    assert head["anchor_feature"] == ANCHOR_FEATURE_LAYOUT
    drafter = DFlashDrafter(counter, checkpoint=str(ckpt))
    assert drafter.heads.anchor_feature
    prompt = [5, 6, 7, 8]
    assert generate(counter, prompt, drafter, max_new_tokens=16).tokens == generate(counter, prompt, max_new_tokens=16).tokens
    capsys.readouterr()
    assert main(["export", str(ckpt), str(export)]) != 0
    assert "--anchor-feature" in capsys.readouterr().err and not export.exists()
    # a checkpoint of the retired layout (raw embedding + state) has no anchor_norm: it does not load
    weights = load_file(ckpt / "model.safetensors")
    assert "anchor_norm.weight" in weights
    del weights["anchor_norm.weight"]
    module = DFlashModule.from_config({**head, "anchor_feature": True}, counter.config)
    with pytest.raises(RuntimeError, match="anchor_norm.weight"):
        module.load_state_dict(weights)


def test_the_anchor_rows_embedding_reaches_it_at_the_states_scale(smollm2):
    """The anchor-feature input is anchor_norm(embedding) + state: at init both at RMS ~1, so changing the
    anchor token moves the row's input by as much as the state does (the raw embedding, RMS ~0.02 on
    real models, was drowned by the state)."""
    module = build_heads("dflash", smollm2, 7, block_size=8, anchor_feature=True)
    parts = FrozenTargetParts.from_target(smollm2).to(dtype=torch.float32)
    state = torch.randn(1, 1, module.fc.weight.shape[0])
    state = module.hidden_norm(state)  # a context state as the module makes them: RMS 1
    captured = [module.block_input(module.block_tokens(torch.tensor([token])), parts, state)[:, 0]
                for token in (260, 1400)]  # [1, H]: the anchor row of a one-block batch
    moved = (captured[0] - captured[1]).pow(2).mean().sqrt()
    assert moved > 0.5 * state.pow(2).mean().sqrt(), float(moved)


def test_training_lowers_held_out_loss_and_drafts_whole_blocks(trained):
    _, result, _ = trained
    first, last = result.history["eval"][0], result.history["eval"][-1]
    assert last["loss"] < 0.5 * first["loss"], (first["loss"], last["loss"])
    assert last["tau"] > first["tau"] and last["tau"] > 3.0  # of at most BLOCK = 5 per verify
    assert min(last["top1_greedy_path"]) > 0.8


def test_training_resumes_exactly_after_a_kill(counter, dflash_data, tmp_path):
    settings = lambda: _settings(steps=8, eval_every=100)  # noqa: E731
    straight, _ = _train(counter, dflash_data, tmp_path / "straight", settings())
    _train(counter, dflash_data, tmp_path / "halves", settings(), stop_after_steps=4)  # "killed" after 4 of 8 steps
    resumed, result = _train(counter, dflash_data, tmp_path / "halves", settings(), resume=True)
    assert result.steps == 8
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_a_timed_run_resumes_its_schedule_and_its_budget(counter, dflash_data, tmp_path):
    """--minutes is the whole training's budget: a resumed run goes on down the same cosine (its first
    learning rate is no higher than the last before the kill) and stops when the total time is spent.
    It restarted the schedule at the top and trained another full budget before."""
    settings = lambda: _settings(steps=None, minutes=0.1, warmup_steps=1, eval_every=1000, save_every=1000)  # noqa: E731
    out = tmp_path / "timed"
    _, first = _train(counter, dflash_data, out, settings(), stop_after_steps=6)
    last_lr, elapsed = first.history["train"][-1]["lr"], first.elapsed_s
    assert last_lr < 3e-3 * (1 - 1e-6)  # some of the budget went: below the top of the cosine
    _, resumed = _train(counter, dflash_data, out, settings(), resume=True)
    history = resumed.history["train"]
    assert history[6]["lr"] <= last_lr and history[-1]["lr"] < history[6]["lr"]
    assert 6.0 <= resumed.elapsed_s < 6.0 + elapsed  # one budget in all (it trained another whole budget)


def test_greedy_batch_through_the_loop_equals_plain(counter, trained):
    drafter = DFlashDrafter(counter, checkpoint=str(trained[0]))
    prompts = [[5, 6, 7, 8], [20, 21], [13, 3, 22, 9]]
    results = generate_batch(counter, prompts, drafter, max_new_tokens=30)
    for prompt, result in zip(prompts, results):
        assert result.tokens == generate(counter, prompt, max_new_tokens=30).tokens
        assert result.stats.tau > 2.5  # whole blocks are accepted
    single = generate(counter, prompts[0], drafter, max_new_tokens=30)
    assert single.tokens == results[0].tokens


def test_sampled_blocks_keep_the_target_distribution(counter, trained):
    """Temperature 1: every block row's token is SAMPLED from its own q (draft_probs = q); outputs
    follow the target exactly. The same test fails a drafter that reports a wrong q."""
    drafter = DFlashDrafter(counter, checkpoint=str(trained[0]))
    prompt, runs = [5, 6, 7, 8], 1500
    sampling = [SamplingParams(1.0, seed=seed) for seed in range(runs)]
    results = generate_batch(counter, [prompt] * runs, drafter, max_new_tokens=4, sampling=sampling)
    assert sum(r.stats.accepted_tokens for r in results) > 0.1 * runs  # drafts were really tried and accepted
    assert min(token_marginal_pvalues(counter, prompt, results)) > 1e-3
    wrong = generate_batch(counter, [prompt] * 500, WrongQ(drafter), max_new_tokens=4, sampling=sampling[:500])
    assert min(token_marginal_pvalues(counter, prompt, wrong)) < 1e-6


def test_export_is_the_dflash_layout_the_engines_load(counter, trained, tmp_path):
    """Checked against the loaders (read, not copied):
    * vLLM vllm/model_executor/models/qwen3_dflash.py: DFlashQwen3ForCausalLM.load_weights prefixes
      every non-lm_head name with "model." and maps layers.{i}.self_attn.{q,k,v}_proj -> qkv_proj,
      mlp.{gate,up}_proj -> gate_up_proj; DFlashQwen3Model builds fc [H, F*H] (bias False; F = the
      number of aux layers, else num_hidden_layers), hidden_norm, norm, per layer q_norm / k_norm of
      head_dim; embed_tokens / lm_head are optional (shared with the target when absent); the mask
      embedding is embed_tokens[dflash_config.mask_token_id]; attention is non-causal unless
      layer_types say sliding_attention or dflash_config.causal is set.
    * SGLang python/sglang/srt/models/dflash.py DFlashDraftModel.load_weights: layers.{i}.* with
      q/k/v_proj -> qkv_proj and gate/up_proj -> gate_up_proj, fc.weight shape checked against
      len(target_layer_ids) * hidden_size, hidden_norm, norm; no embed_tokens / lm_head (the target's
      are used); layer_types "full_attention" -> ENCODER_ONLY (non-causal) attention.
      speculative/dflash_utils.py parse_dflash_draft_config: block_size (top level or dflash_config),
      dflash_config.target_layer_ids (each in [0, num_target_layers)), dflash_config.mask_token_id
      (a non-negative int), num_target_layers; build_target_layer_ids = "hidden states after each
      selected target layer".
    * z-lab/dflash dflash/model.py DFlashDraftModel: config.block_size, dflash_config
      {mask_token_id, target_layer_ids} (default from num_target_layers), hidden states
      hidden_states[layer_id + 1] concatenated in order, target_hidden = hidden_norm(fc(.)).
    """
    _, _, module = trained
    export_dflash(module, tmp_path / "bf16")
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    hidden, heads, kv_heads, head_dim, inter = counter.hidden_size, 4, 2, 16, 128
    expected = {"fc.weight": (hidden, len(module.input_layers) * hidden), "hidden_norm.weight": (hidden,),
                "norm.weight": (hidden,)}
    for i in range(2):
        expected.update({
            f"layers.{i}.input_layernorm.weight": (hidden,), f"layers.{i}.post_attention_layernorm.weight": (hidden,),
            f"layers.{i}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"layers.{i}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"layers.{i}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"layers.{i}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"layers.{i}.self_attn.q_norm.weight": (head_dim,), f"layers.{i}.self_attn.k_norm.weight": (head_dim,),
            f"layers.{i}.mlp.gate_proj.weight": (inter, hidden), f"layers.{i}.mlp.up_proj.weight": (inter, hidden),
            f"layers.{i}.mlp.down_proj.weight": (hidden, inter),
        })
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == BLOCK and config["num_target_layers"] == counter.num_layers == 3
    assert config["dflash_config"] == {"mask_token_id": module.mask_token_id,
                                       "target_layer_ids": [layer - 1 for layer in module.input_layers]}
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == counter.vocab_size
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        hidden, heads, kv_heads, head_dim)
    assert config["layer_types"] == ["full_attention"] * 2 and "causal" not in config["dflash_config"]
    assert all(0 <= i < counter.num_layers for i in config["dflash_config"]["target_layer_ids"])
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"

    export_dflash(module, tmp_path / "fp32", dtype="float32")  # exact weights: identical logits and drafts
    loaded = load_dflash_export(tmp_path / "fp32", counter)
    parts = FrozenTargetParts.from_target(counter)
    context, anchors = torch.randn(2, 9, len(module.input_layers) * hidden), torch.tensor([4, 17])
    with torch.no_grad():
        ours = module.project(module.block_hidden(context, anchors, parts), parts)
        theirs = loaded.project(loaded.block_hidden(context, anchors, parts), parts)
    assert torch.equal(ours, theirs)
    checkpoint_drafter = DFlashDrafter(counter, checkpoint=str(trained[0]), draft_vocab=0)
    export_drafter = DFlashDrafter(counter, checkpoint=str(tmp_path / "fp32"))
    for prompt in ([5, 6, 7, 8], [20, 21, 22]):
        for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
            a = first_proposal(checkpoint_drafter, counter, prompt, 4, sampling)
            b = first_proposal(export_drafter, counter, prompt, 4, sampling)
            assert torch.equal(a.tokens, b.tokens) and (a.draft_probs is None) == (b.draft_probs is None)
            if a.draft_probs is not None:
                assert torch.equal(a.draft_probs, b.draft_probs)
    bf16 = DFlashDrafter(counter, checkpoint=str(tmp_path / "bf16"))
    assert generate(counter, [5, 6, 7, 8], bf16, max_new_tokens=20).tokens == generate(counter, [5, 6, 7, 8], max_new_tokens=20).tokens


def test_bad_checkpoints_are_clear_errors(counter, trained, smollm2, tmp_path):
    _, _, module = trained
    export_dflash(module, tmp_path / "export", dtype="float32")
    with pytest.raises(ValueError, match="does not fit target"):
        DFlashDrafter(smollm2, checkpoint=str(tmp_path / "export"))
    with pytest.raises(ValueError, match="checkpoint=DIR"):
        DFlashDrafter(counter)
    with pytest.raises(ValueError, match="block_size"):
        build_heads("dflash", counter, 0, block_size=1)


def test_dflash_cli_end_to_end(counter, tmp_path, capsys):
    """train data --for dflash -> train dflash (killed and resumed) -> export -> generate with the export."""
    from specdec.cli import main

    model_dir = str(counter.model_dir)
    data, ckpt, export = str(tmp_path / "data"), str(tmp_path / "ckpt"), str(tmp_path / "export")
    assert main(["train", "data", "--model", model_dir, "--out", data, "--num-prompts", "4", "--max-new-tokens", "16",
                 "--shard-size", "2", "--for", "dflash", "--draft-layers", "2", "--prompt-mix", "conversation=1",
                 "--no-progress"]) == 0
    layers = json.loads((tmp_path / "data" / "manifest.json").read_text())["settings"]["layers"]
    assert set(dflash_hidden_layers(3, 2)) <= set(layers)
    train_args = ["train", "dflash", "--model", model_dir, "--data", data, "--out", ckpt, "--block-size", "4",
                  "--draft-layers", "2", "--steps", "4", "--batch-size", "2", "--no-progress"]
    assert main(train_args) == 0
    assert main([arg if arg != "4" or i != train_args.index("--steps") + 1 else "6" for i, arg in enumerate(train_args)]
                + ["--resume"]) == 0
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["head"]["kind"] == "dflash" and config["training"]["steps"] == 6 and "tau" in config["eval"]
    assert main(["export", ckpt, export]) == 0
    assert json.loads((tmp_path / "export" / "config.json").read_text())["block_size"] == 4
    capsys.readouterr()
    for checkpoint in (ckpt, export):
        assert main(["generate", "!#%'", "--model", model_dir, "--drafter", "dflash", "--drafter-arg",
                     f"checkpoint={checkpoint}", "--max-new-tokens", "12", "--temperature", "0"]) == 0
    assert main(["generate", "!#%'", "--model", model_dir, "--max-new-tokens", "12", "--temperature", "0"]) == 0
    outputs = capsys.readouterr().out.strip().splitlines()
    assert outputs[0] == outputs[1] == outputs[2]


def test_greedy_on_smollm2_equals_plain_with_any_drafts(smollm2):
    """Real SmolLM2, an untrained (perturbed) module: drafts are mostly wrong, output is still plain
    decoding's, for a batch of two requests and for one."""
    module = _perturbed(build_heads("dflash", smollm2, 3, block_size=4, num_draft_layers=2), scale=0.01)
    drafter = DFlashDrafter.from_module(smollm2, module)
    prompts = ["Write one sentence about cats.", "def fibonacci(n):"]
    results = generate_batch(smollm2, prompts, drafter, max_new_tokens=16)
    for prompt, result in zip(prompts, results):
        assert result.tokens == generate(smollm2, prompt, max_new_tokens=16).tokens
        assert result.stats.drafted_tokens > 0  # the drafter really proposed


def test_one_draft_layer_can_fuse_several_target_layers(counter, dflash_data, tmp_path, capsys):
    """--target-layers decouples the fused layers from --draft-layers (a cheaper block forward: one layer
    reading three target layers), and the engines' layout carries it: fc over 2 layers, 1 hidden layer."""
    from specdec.cli import main

    model_dir, ckpt, export = str(counter.model_dir), tmp_path / "ckpt", tmp_path / "export"
    train_args = ["train", "dflash", "--model", model_dir, "--data", str(dflash_data), "--block-size", "4",
                  "--draft-layers", "1", "--steps", "3", "--batch-size", "2", "--no-progress"]
    assert main(train_args + ["--out", str(ckpt), "--target-layers", "0,2"]) == 0
    head = json.loads((ckpt / "config.json").read_text())["head"]
    assert head["num_draft_layers"] == 1 and head["input_layers"] == [1, 3]
    assert main(["export", str(ckpt), str(export), "--dtype", "float32"]) == 0
    config = json.loads((export / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["dflash_config"]["target_layer_ids"] == [0, 2]
    assert tuple(load_file(str(export / "model.safetensors"))["fc.weight"].shape) == (counter.hidden_size,
                                                                                     2 * counter.hidden_size)
    prompt = [5, 6, 7, 8]
    plain = generate(counter, prompt, max_new_tokens=16).tokens
    for checkpoint in (ckpt, export):
        assert generate(counter, prompt, DFlashDrafter(counter, checkpoint=str(checkpoint)), max_new_tokens=16).tokens == plain
    capsys.readouterr()
    assert main(train_args + ["--out", str(tmp_path / "bad"), "--target-layers", "0,3"]) != 0
    assert "0 .. 2" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit):
        main(train_args + ["--out", str(tmp_path / "bad"), "--target-layers", "0,x"])
    assert "comma-separated block ids" in capsys.readouterr().err
