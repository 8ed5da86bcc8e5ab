"""EAGLE-1 / EAGLE-3 drafters: the trained computation is the drafted one, EAGLE-2 dynamic trees,
greedy output identical to plain decoding, sampled output distributed like the target (and a wrong
q is caught), the export layout SGLang / vLLM load, and the CLI end to end.

Uses the "counter" target of train_support.py (greedy decoding walks a cycle of tokens).
"""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from train_support import counter_selfdistill_data, first_proposal, token_marginal_pvalues

from specdec import SamplingParams, generate
from specdec.api import generate_batch
from specdec.budget import AutoBudget
from specdec.cost import CostTable
from specdec.drafters.base import Drafter
from specdec.drafters.eagle import Eagle1Drafter, Eagle3Drafter
from specdec.heads import FrozenTargetParts, eagle3_layers, target_description
from specdec.heads.export import export_eagle3, export_medusa
from specdec.loop import run
from specdec.train import DataSettings, TrainSettings, build_dataset, build_heads, load_samples, save_checkpoint, train
from specdec.train.batches import chain_starts, label_rows, make_batch

DRAFTERS = {"eagle1": Eagle1Drafter, "eagle3": Eagle3Drafter}
DRAFT_VOCAB = 16  # EAGLE-3's reduced vocabulary on the 24-token counter


@pytest.fixture(scope="module")
def eagle_data(counter, tmp_path_factory):
    """Self-distilled data with every hidden layer (EAGLE-3 fuses 2, 1, 0 of the 3-block counter; 3 = top)."""
    return counter_selfdistill_data(counter, tmp_path_factory.mktemp("eagle_data") / "data", layers=[0, 1, 2, 3])


def _train(kind, counter, data, out, steps=150, **settings):
    options = {"draft_vocab_size": DRAFT_VOCAB} if kind == "eagle3" else {}
    heads = build_heads(kind, counter, 3, **options)
    _, samples = load_samples(data, sorted({*heads.input_layers, counter.num_layers}), counter)
    settings = TrainSettings(**{"steps": steps, "lr": 2e-3, "batch_size": 4, "loss_rows": 256, "warmup_steps": 10,
                                "eval_every": 75, "feature_weight": 10.0 if kind == "eagle1" else 0.0, **settings})
    return heads, train(heads, counter, samples, out, settings, target_description(counter), progress=False, log=lambda _: None)


@pytest.fixture(scope="module")
def trained(counter, eagle_data, tmp_path_factory):
    """kind -> (checkpoint dir, TrainResult, module)."""
    results = {}
    for kind in DRAFTERS:
        out = tmp_path_factory.mktemp(kind) / "ckpt"
        heads, result = _train(kind, counter, eagle_data, out)
        results[kind] = (out, result, heads)
    return results


def test_eagle3_reads_the_layers_the_engines_capture(counter):
    assert eagle3_layers(32) == (2, 16, 29)  # transformers' hidden_states[2, N/2, N-3]: outputs of blocks 1, N/2-1, N-4
    assert eagle3_layers(28) == (2, 14, 25)
    module = build_heads("eagle3", counter, 2)
    assert module.input_layers == (2, 1, 0) and module.fc.weight.shape == (counter.hidden_size, 3 * counter.hidden_size)


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_training_pass_matches_the_drafting_computation(counter, eagle_data, kind):
    """The unrolled training forward (training-time test) computes exactly what drafting computes step by step."""
    parts = FrozenTargetParts.from_target(counter)
    torch.manual_seed(0)
    module = build_heads(kind, counter, 3)
    with torch.no_grad():
        for param in module.parameters():  # random weights: nothing may match by accident
            param.add_(torch.randn_like(param) * 0.1)
    _, samples = load_samples(eagle_data, [0, 1, 2, 3], counter)
    sample = samples[0]
    tokens, length = sample.tokens[None], sample.tokens.shape[0]
    positions = torch.arange(length)[None]
    hidden = torch.cat([sample.hidden[layer] for layer in module.input_layers], -1).float()[None]  # [1, T, H_in]
    trained_view = module(hidden, tokens, positions, parts)  # [D, 1, T, H]
    for p in (4, 11, length - 5):
        cache = module.new_cache(64, torch.float32, "cpu")
        state = module.first_state(hidden[:, : p + 1])
        depth1 = module.step(state, tokens[:, 1 : p + 2], positions[:, : p + 1], cache, parts)
        assert torch.allclose(depth1[0], trained_view[0, 0, : p + 1], atol=1e-4)
        previous = depth1[:, -1:]
        for depth in (2, 3):  # depth d at position p + d - 1, reading token p + d
            token, position = tokens[:, p + depth : p + depth + 1], torch.tensor([[p + depth - 1]])
            previous = module.step(previous, token, position, cache, parts)
            assert torch.allclose(previous[0, 0], trained_view[depth - 1, 0, p], atol=1e-4), (p, depth)


@pytest.mark.parametrize("kind", [*DRAFTERS, "mtp-sequential"])
def test_computing_only_the_read_rows_gives_their_features_and_gradients(counter, eagle_data, kind):
    """Training computes only the chain starts its loss rows read (every position still gives its
    depth-1 keys): those rows' features and the parameters' gradients are the full pass's, the rest
    are zeros; leaving the other positions' keys out is caught."""
    parts = FrozenTargetParts.from_target(counter)
    torch.manual_seed(1)
    module = build_heads(kind, counter, 3)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    _, samples = load_samples(eagle_data, [0, 1, 2, 3], counter)
    batch = make_batch(samples[:2], module.input_layers, 64, torch.Generator().manual_seed(0), torch.device("cpu"))
    rows, _ = label_rows(batch, 3)
    rows = rows[torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(2))[:40]]  # a few loss rows
    read = chain_starts(batch, rows, 3)  # [D, B, T]
    assert (read[1:] <= read[:-1]).all() and (read[1] < read[0]).any() and (read[2] < read[1]).any()
    assert 0 < int(read[0].sum()) < int((batch.tokens > 0).sum()) // 2
    weights = torch.randn(3, *batch.tokens.shape, counter.hidden_size) * read[..., None]  # a loss over the read rows

    def run_pass(read_rows):
        module.zero_grad()
        features = module(batch.hidden, batch.tokens, batch.positions, parts, read_rows=read_rows)  # [D, B, T, H]
        (features * weights).sum().backward()
        return features.detach(), {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}

    full, full_grads = run_pass(None)
    only, only_grads = run_pass(read)
    assert only.shape == full.shape and not only[~read].any()
    scale = full.abs().max()
    torch.testing.assert_close(only[read], full[read], rtol=1e-4, atol=1e-5 * scale)
    assert full_grads.keys() == only_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(only_grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().clamp(min=1e-6), msg=name)
    # the read rows without the earlier positions' keys are a different computation
    first = int(read[0].any(0).nonzero()[0])
    alone = module(batch.hidden[:, first:], batch.tokens[:, first:], batch.positions[:, first:], parts)
    assert not torch.allclose(alone[read[:, :, first:]], full[read], rtol=1e-3, atol=1e-3 * scale)


def test_eagle3_draft_vocabulary_is_the_most_frequent_labels_sorted(counter, eagle_data, trained):
    from specdec.train.trainer import rank_label_tokens, split_samples

    _, _, module = trained["eagle3"]
    _, samples = load_samples(eagle_data, [3], counter)
    train_samples, _ = split_samples(samples, TrainSettings().eval_fraction)
    ranked, _ = rank_label_tokens(train_samples)
    draft_ids = (torch.arange(DRAFT_VOCAB) + module.d2t).tolist()  # target id = i + d2t[i]
    assert draft_ids == sorted(draft_ids) and set(ranked[:DRAFT_VOCAB]) <= set(draft_ids)
    assert module.t2d.sum() == DRAFT_VOCAB and module.t2d[torch.tensor(draft_ids)].all()


@pytest.mark.parametrize("kind", list(DRAFTERS))
@pytest.mark.parametrize("options", [{}, {"tree": False}, {"tree_nodes": 4, "tree_topk": 2}],
                         ids=["dynamic-tree", "chain", "small-tree"])
def test_greedy_with_eagle_equals_plain(counter, trained, kind, options):
    drafter = DRAFTERS[kind](counter, checkpoint=str(trained[kind][0]), **options)
    for prompt in ([5, 6, 7, 8], [20, 21], [13, 3, 22, 9]):
        plain = generate(counter, prompt, max_new_tokens=30)
        spec = generate(counter, prompt, drafter, max_new_tokens=30)
        assert spec.tokens == plain.tokens
        assert spec.stats.tau > 2.0  # the drafter learned the pattern: drafts are accepted


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_greedy_under_the_cost_model_equals_plain(counter, trained, kind):
    """--gamma auto: the budget (tree size) comes from a cost table; output stays plain decoding's."""
    # forwards far slower than the tiny drafter's steps: the budget follows the acceptance estimates
    table = CostTable({}, [1, 2, 4, 8, 13, 256], [1000.0, 1040.0, 1100.0, 1250.0, 1400.0, 14000.0])
    drafter = DRAFTERS[kind](counter, checkpoint=str(trained[kind][0]))
    # priced as it runs (~1 ms a step against the table's 1 s forwards), not by its parameter count
    # (0.5 of the tiny target's): its prompt feed is then worth paying before the first draft
    drafter.cost = dataclasses.replace(drafter.cost, per_token=0.001)
    policy = AutoBudget(table, max_budget=12)
    plain = generate(counter, [5, 6, 7, 8], max_new_tokens=40)
    spec = run(counter, [[5, 6, 7, 8]], drafter, 40, SamplingParams(), (), policy).finish()[0]
    # small budgets (~4 nodes) often go to depth-1 siblings: tau stays below the fixed 10-node tree's
    assert spec.tokens == plain.tokens and spec.stats.tau > 1.5
    assert spec.stats.drafted_tokens > 2 * spec.stats.steps  # the cost model chose trees, not single tokens


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_dynamic_tree_nodes_are_the_drafters_top_k_given_their_path(counter, trained, kind):
    """Every node's token is among the drafter's top-k after its path (recomputed by the training
    forward), at most tree_topk children per node, and the tree is the best-N by path score."""
    checkpoint, _, _ = trained[kind]
    drafter = DRAFTERS[kind](counter, checkpoint=str(checkpoint), tree_nodes=9, tree_topk=3, tree_depth=4)
    module, parts = drafter.heads, drafter.vocab.parts
    prompt = [9, 4, 17, 3, 11]
    draft = first_proposal(drafter, counter, prompt, 9)
    assert 1 < len(draft) <= 9 and draft.draft_probs is None and int(draft.depths.max()) > 1
    assert all(len(children) <= 3 for children in draft.children_lists)
    cached = prompt[:-1]
    _, hiddens = counter.forward(torch.tensor([cached]), torch.arange(len(cached))[None], counter.new_cache(1, 64),
                                 hidden_layers=drafter.hidden_layers)
    newest = len(cached) - 1
    for node in range(len(draft)):
        path = draft.path_to(node)[:-1]
        tokens = prompt + draft.tokens[path].tolist() + [0] * 4  # the row at `newest` reads tokens newest + 1 ..
        hidden = torch.zeros(1, len(tokens), hiddens[drafter.hidden_layers[0]].shape[-1] * len(drafter.hidden_layers))
        hidden[0, : len(cached)] = torch.cat([hiddens[layer][0] for layer in drafter.hidden_layers], -1)
        with torch.no_grad():
            features = module(hidden, torch.tensor([tokens]), torch.arange(len(tokens))[None], parts)  # [D, 1, T, H]
            logits = module.project(features[len(path), 0, newest], parts)
        top = drafter.vocab.tokens(logits.topk(3).indices)
        assert int(draft.tokens[node]) in top, (node, path)


class WrongQ(Drafter):
    """Reports a deliberately wrong q (uniform) for tokens sampled from the real drafter's q."""

    name = "wrong-q-for-tests"

    def __init__(self, inner):
        self.inner, self.hidden_layers = inner, inner.hidden_layers

    def for_sequence(self):
        return WrongQ(self.inner.for_sequence())

    def begin(self, prompt_ids, target):
        self.inner.begin(prompt_ids, target)

    def on_verified(self, result, ctx):
        self.inner.on_verified(result, ctx)

    def propose(self, ctx, budget):
        draft = self.inner.propose(ctx, budget)
        if draft.draft_probs is not None:
            draft.draft_probs = torch.full_like(draft.draft_probs, 1.0 / draft.draft_probs.shape[1])
        return draft


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_sampled_eagle_chains_keep_the_target_distribution(counter, trained, kind):
    """Temperature 1, chains: each token is SAMPLED from the drafter's q (draft_probs = q, zero outside
    EAGLE-3's draft vocabulary); outputs follow the target exactly. The same test fails a wrong q."""
    drafter = DRAFTERS[kind](counter, checkpoint=str(trained[kind][0]), tree=False, gamma=2)
    prompt, runs = [5, 6, 7, 8], 1500
    sampling = [SamplingParams(1.0, seed=seed) for seed in range(runs)]
    results = generate_batch(counter, [prompt] * runs, drafter, max_new_tokens=4, sampling=sampling)
    assert sum(r.stats.accepted_tokens for r in results) > 0.1 * runs  # drafts were really tried and accepted
    assert min(token_marginal_pvalues(counter, prompt, results)) > 1e-3
    wrong = generate_batch(counter, [prompt] * 500, WrongQ(drafter), max_new_tokens=4, sampling=sampling[:500])
    assert min(token_marginal_pvalues(counter, prompt, wrong)) < 1e-6


def test_export_is_the_sglang_vllm_layout_and_loads_back_with_identical_drafts(counter, trained, tmp_path):
    checkpoint, _, module = trained["eagle3"]
    hidden, heads, kv_heads, head_dim = counter.hidden_size, 4, 2, 16
    export_eagle3(module, tmp_path / "bf16")
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    expected = {
        "fc.weight": ((hidden, 3 * hidden), torch.bfloat16),
        "midlayer.input_layernorm.weight": ((hidden,), torch.bfloat16),
        "midlayer.hidden_norm.weight": ((hidden,), torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": ((hidden,), torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": ((heads * head_dim, 2 * hidden), torch.bfloat16),
        "midlayer.self_attn.k_proj.weight": ((kv_heads * head_dim, 2 * hidden), torch.bfloat16),
        "midlayer.self_attn.v_proj.weight": ((kv_heads * head_dim, 2 * hidden), torch.bfloat16),
        "midlayer.self_attn.o_proj.weight": ((hidden, heads * head_dim), torch.bfloat16),
        "midlayer.mlp.gate_proj.weight": ((128, hidden), torch.bfloat16),
        "midlayer.mlp.up_proj.weight": ((128, hidden), torch.bfloat16),
        "midlayer.mlp.down_proj.weight": ((hidden, 128), torch.bfloat16),
        "norm.weight": ((hidden,), torch.bfloat16),
        "lm_head.weight": ((DRAFT_VOCAB, hidden), torch.bfloat16),
        "d2t": ((DRAFT_VOCAB,), torch.int64),
        "t2d": ((counter.vocab_size,), torch.bool),
    }
    assert {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()} == expected
    ids = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
    assert torch.equal(tensors["t2d"].nonzero().squeeze(1), ids)  # target id = i + d2t[i], t2d marks exactly those
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    cfg = counter.config
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["hidden_act"] == "silu" and config["tie_word_embeddings"] is False
    assert (config["vocab_size"], config["draft_vocab_size"]) == (cfg.vocab_size, DRAFT_VOCAB)
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        hidden, heads, kv_heads, head_dim)
    assert config["rms_norm_eps"] == cfg.rms_norm_eps and config["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert config["rope_scaling"] is None and config["torch_dtype"] == "bfloat16"
    assert not [key for key in config if "aux" in key or "eagle_config" in key]  # the engines' default fused layers

    export_eagle3(module, tmp_path / "fp32", dtype="float32")  # exact weights: the drafts must be identical
    for options in ({}, {"tree": False}):
        ours = Eagle3Drafter(counter, checkpoint=str(checkpoint), **options)
        exported = Eagle3Drafter(counter, checkpoint=str(tmp_path / "fp32"), **options)
        for prompt in ([5, 6, 7, 8], [20, 21, 22], [9, 4, 17, 3, 11]):
            for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
                a, b = first_proposal(ours, counter, prompt, 6, sampling), first_proposal(exported, counter, prompt, 6, sampling)
                assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
                assert (a.draft_probs is None) == (b.draft_probs is None)
                if a.draft_probs is not None:
                    assert torch.equal(a.draft_probs, b.draft_probs)
    bf16 = Eagle3Drafter(counter, checkpoint=str(tmp_path / "bf16"))
    assert generate(counter, [5, 6, 7, 8], bf16, max_new_tokens=20).tokens == generate(counter, [5, 6, 7, 8], max_new_tokens=20).tokens


def test_published_style_and_wrong_target_exports(counter, trained, tiny_target, tmp_path):
    """A published drafter may carry the target's embed_tokens (ignored: we use the target's own);
    a drafter for another target is a clear error."""
    _, _, module = trained["eagle3"]
    export_eagle3(module, tmp_path / "e3", dtype="float32")
    tensors = load_file(str(tmp_path / "e3" / "model.safetensors"))
    from safetensors.torch import save_file

    save_file({**tensors, "embed_tokens.weight": torch.zeros(counter.vocab_size, counter.hidden_size)},
              str(tmp_path / "e3" / "model.safetensors"))
    assert len(first_proposal(Eagle3Drafter(counter, checkpoint=str(tmp_path / "e3")), counter, [5, 6, 7, 8], 4)) > 0
    with pytest.raises(ValueError, match="does not fit target"):
        Eagle3Drafter(tiny_target, checkpoint=str(tmp_path / "e3"))
    with pytest.raises(ValueError, match="checkpoint=DIR"):
        Eagle3Drafter(counter)


def test_medusa_export_is_vllms_layout(counter, tmp_path):
    heads = build_heads("medusa", counter, 3)
    with torch.no_grad():
        for param in heads.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    export_medusa(heads, counter, tmp_path, dtype="float32")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    names = {f"blocks.{k}.layers.0.{p}" for k in range(3) for p in ("weight", "bias")} | {f"lm_heads.{k}.weight" for k in range(3)}
    assert set(tensors) == names
    assert torch.equal(tensors["blocks.1.layers.0.weight"], heads.heads[1][0].weight.detach())
    assert torch.equal(tensors["lm_heads.2.weight"], counter.model.lm_head.weight.detach())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["num_heads"], config["num_hidden_layers"], config["medusa_fc_bias"]) == (3, 1, True)
    assert config["vocab_size"] == config["truncated_vocab_size"] == counter.vocab_size


def test_eagle3_cli_end_to_end(counter, tmp_path, capsys):
    """train data --for eagle3 -> train eagle3 (killed and resumed) -> eval -> export -> generate with the export."""
    from specdec.cli import main

    model_dir = str(counter.model_dir)
    data, ckpt, export = str(tmp_path / "data"), str(tmp_path / "ckpt"), str(tmp_path / "export")
    assert main(["train", "data", "--model", model_dir, "--out", data, "--num-prompts", "4", "--max-new-tokens", "16",
                 "--shard-size", "2", "--for", "eagle3", "--prompt-mix", "conversation=1", "--no-progress"]) == 0
    assert json.loads((tmp_path / "data" / "manifest.json").read_text())["settings"]["layers"] == [0, 1, 2, 3]
    train_args = ["train", "eagle3", "--model", model_dir, "--data", data, "--out", ckpt, "--depth", "3", "--steps", "4",
                  "--draft-vocab-size", "12", "--batch-size", "2", "--no-progress"]
    assert main(train_args) == 0
    assert main([arg if arg != "4" else "7" for arg in train_args] + ["--resume"]) == 0
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["head"]["kind"] == "eagle3" and config["training"]["steps"] == 7
    capsys.readouterr()
    assert main(["train", "eval", "--model", model_dir, "--checkpoint", ckpt, "--data", data]) == 0
    report = capsys.readouterr().out.splitlines()
    assert "held-out answers" in report[0] and report[-1].split()[0] == "all" and report[-1].count("/") == 4  # 3 depths, twice
    assert main(["export", ckpt, export]) == 0
    assert main(["export", ckpt, export]) == 2  # no silent overwrite
    assert json.loads((tmp_path / "export" / "config.json").read_text())["draft_vocab_size"] == 12
    capsys.readouterr()
    for checkpoint in (ckpt, export):
        assert main(["generate", "!#%'", "--model", model_dir, "--drafter", "eagle3", "--drafter-arg", f"checkpoint={checkpoint}",
                     "--max-new-tokens", "12", "--temperature", "0"]) == 0
    assert main(["generate", "!#%'", "--model", model_dir, "--max-new-tokens", "12", "--temperature", "0"]) == 0
    outputs = capsys.readouterr().out.strip().splitlines()
    assert outputs[0] == outputs[1] == outputs[2]
    mtp = str(tmp_path / "mtp")
    assert main(["train", "mtp", "--model", model_dir, "--data", data, "--out", mtp, "--steps", "1", "--no-progress"]) == 0
    assert main(["export", mtp, str(tmp_path / "mtp-export")]) == 2  # engines load EAGLE-3 and Medusa only


@pytest.mark.slow
def test_eagle3_trained_on_smollm2_drafts_losslessly(smollm2, tmp_path):
    """A few steps on real SmolLM2 data, end to end: greedy output with the drafter (and its export) equals plain."""
    from specdec.heads.export import load_eagle3_export

    data = tmp_path / "data"
    layers = sorted({*eagle3_layers(smollm2.num_layers), smollm2.num_layers})
    build_dataset(smollm2, data, DataSettings(num_prompts=4, max_new_tokens=24, shard_size=2, layers=layers), progress=False,
                  log=lambda _: None)
    heads, _ = _train("eagle3", smollm2, data, tmp_path / "ckpt", steps=8, batch_size=2, eval_every=100)
    export_eagle3(heads, tmp_path / "export")
    exported = load_eagle3_export(tmp_path / "export", smollm2)
    assert exported.input_layers == eagle3_layers(smollm2.num_layers) == (2, 15, 27)
    for drafter in (Eagle3Drafter(smollm2, checkpoint=str(tmp_path / "ckpt")), Eagle3Drafter(smollm2, checkpoint=str(tmp_path / "export"))):
        for prompt in ("Write one sentence about cats.", "def fibonacci(n):"):
            assert generate(smollm2, prompt, drafter, max_new_tokens=24).tokens == generate(smollm2, prompt, max_new_tokens=24).tokens


def test_checkpoint_keeps_index_buffers_exact(counter, tmp_path):
    module = build_heads("eagle3", counter, 2, draft_vocab_size=DRAFT_VOCAB)
    module.set_draft_vocab([23, 5, 9, 3])
    save_checkpoint(tmp_path, module, target_description(counter))
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert torch.equal(state["d2t"], module.d2t) and {3, 5, 9, 23} <= set((torch.arange(DRAFT_VOCAB) + state["d2t"]).tolist())


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_sampled_eagle_trees_keep_the_target_distribution(counter, trained, kind):
    """Temperature 1, EAGLE-2 dynamic trees: children DRAWN from q without replacement, each with the
    exact row it was drawn from (ScoredTree's sampled mode; zero outside EAGLE-3's draft vocabulary);
    outputs follow the target exactly. (This drafter's q is close to the flat counter's p, too close
    for a wrong row or selection to show in 1500 runs: test_sampled_tree.py catches those through
    the real loop on a crafted pair.)"""
    drafter = DRAFTERS[kind](counter, checkpoint=str(trained[kind][0]), tree_nodes=3, tree_topk=2, tree_depth=2)
    prompt, runs = [5, 6, 7, 8], 1500
    draft = first_proposal(drafter, counter, prompt, 3, SamplingParams(1.0, seed=0))
    assert len(draft) == 3 and draft.draft_probs is not None and not draft.is_chain
    assert torch.allclose(draft.draft_probs.sum(-1), torch.ones(3))
    if kind == "eagle3":  # q is zero outside the reduced draft vocabulary
        outside = ~drafter.heads.t2d.cpu()
        assert float(draft.draft_probs[:, outside].abs().sum()) == 0.0
    sampling = [SamplingParams(1.0, seed=seed) for seed in range(runs)]
    results = generate_batch(counter, [prompt] * runs, drafter, max_new_tokens=4, sampling=sampling)
    assert sum(r.stats.accepted_tokens for r in results) > 0.1 * runs  # drafts were really tried and accepted
    assert min(token_marginal_pvalues(counter, prompt, results)) > 1e-3


@pytest.mark.parametrize("chunk_rows", [1, 7, 512])
def test_chunked_soft_cross_entropy_is_the_plain_form_with_its_gradients(chunk_rows):
    """EAGLE-3's loss in row chunks (forward keeps per-row losses, backward recomputes each chunk, p once
    per distinct target state): values, top-1 and both gradients equal the plain [N, V'] computation;
    a wrong p is not."""
    import torch.nn.functional as F

    from specdec.heads.soft_ce import soft_cross_entropy

    generator = torch.Generator().manual_seed(0)
    rows, hidden, vocab = 37, 16, 50
    readout = torch.randn(rows, hidden, generator=generator, requires_grad=True)
    draft_weight = torch.randn(vocab, hidden, generator=generator).mul(0.5).requires_grad_()
    # the trainer's rows share target states (one position's state at several depths): 11 distinct of 37
    distinct = torch.randn(11, hidden, generator=generator)
    target_top = distinct[torch.randint(0, 11, (rows,), generator=generator)]
    target_rows = torch.randn(vocab, hidden, generator=generator)
    row_weights = torch.rand(rows, generator=generator)  # the trainer weighs rows by depth

    def plain(top_rows):
        target_probs = F.softmax(F.linear(target_top, top_rows), -1)
        log_q = F.log_softmax(F.linear(readout, draft_weight), -1)
        return -(target_probs * log_q).sum(-1), log_q.argmax(-1)

    def gradients(per_row):
        return torch.autograd.grad((per_row * row_weights).sum(), (readout, draft_weight))

    expected, expected_top = plain(target_rows)
    chunked, top = soft_cross_entropy(readout, draft_weight, target_top, target_rows, chunk_rows=chunk_rows)
    torch.testing.assert_close(chunked, expected)
    assert torch.equal(top, expected_top)
    for got, want in zip(gradients(chunked), gradients(expected)):
        torch.testing.assert_close(got, want)
    wrong, _ = plain(target_rows.flip(0))  # p over the wrong ids
    assert not torch.allclose(chunked, wrong, atol=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 products: close at bf16 precision
        in_bf16, _ = soft_cross_entropy(readout, draft_weight, target_top, target_rows, chunk_rows=chunk_rows)
    torch.testing.assert_close(in_bf16, expected, rtol=0.05, atol=0.05 * float(expected.detach().abs().max()))
