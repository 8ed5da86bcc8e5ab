"""The trainer and trained drafters: batches and label rows, the loss falls for every head type,
variants (sampled softmax, feature loss), resume; checkpoints (save -> load -> identical proposals,
wrong target rejected) and the `medusa` / `mtp` drafters (greedy output identical to plain
decoding, sampled output distributed like the target). Training data: test_train_data.py; the
tiny "counter" target: tests/train_support.py.
"""

import json

import pytest
import torch
from conftest import assert_close_to_scale
from train_support import AGREEMENT_LIMIT, first_proposal, make_counter_target, token_marginal_pvalues

from specdec import SamplingParams, generate
from specdec.drafters.medusa import MedusaDrafter, best_first_choices
from specdec.drafters.mtp import MTPDrafter
from specdec.heads import target_description
from specdec.train import TrainSettings, build_heads, load_checkpoint, load_samples, train

LOSS_LIMIT = 1.3  # held-out CE every head type must get below (it starts near ln(24) = 3.2-3.5)
HEAD_SETUPS = {  # kind -> (head positions, learning rate)
    "medusa": (3, 3e-3),
    "mtp-parallel": (3, 1e-3),
    "mtp-sequential": (3, 1e-3),
}


@pytest.fixture(scope="module")
def trained(counter, counter_data, tmp_path_factory):
    """kind -> (checkpoint dir, TrainResult, in-memory heads) for every head type."""
    results = {}
    for kind, (positions, lr) in HEAD_SETUPS.items():
        heads = build_heads(kind, counter, positions)
        _, samples = load_samples(counter_data, [heads.input_layer], counter)
        out = tmp_path_factory.mktemp(kind) / "ckpt"
        settings = TrainSettings(steps=150, lr=lr, batch_size=4, loss_rows=256, warmup_steps=10, eval_every=75)
        result = train(heads, counter, samples, out, settings, target_description(counter), progress=False, log=lambda _: None)
        results[kind] = (out, result, heads)
    return results


def drafter_for(kind, target, checkpoint=None, heads=None, rank_acc=None, **options):
    cls = MedusaDrafter if kind == "medusa" else MTPDrafter
    if heads is not None:
        return cls.from_module(target, heads, rank_acc=rank_acc, **options)
    return cls(target, checkpoint=str(checkpoint), **options)


# ---------------------------------------------------------------------------- batches and label rows
def test_label_rows_use_the_targets_choice_and_prompt_rows_widen_them():
    from specdec.train.batches import Batch, label_rows

    tokens = torch.tensor([[5, 6, 7, 8, 9, 0]])  # one row: 5 tokens (prompt 5, 6, 7) + padding
    target_next = torch.tensor([[16, 17, 18, 19, 20, 0]])  # the target's top-1 after each position
    batch = Batch(tokens, torch.zeros(1, 6, 4), torch.arange(6)[None], torch.tensor([5]), torch.tensor([3]), target_next)
    rows, labels = label_rows(batch, num_positions=2)
    # head k at t labels position t + k + 1 in [3, 5): k=1: t=1,2; k=2: t=0,1 -> label target_next[t + k]
    assert rows.tolist() == [[0, 0, 1], [0, 0, 2], [1, 0, 0], [1, 0, 1]]
    assert labels.tolist() == [18, 19, 18, 19]
    rows, labels = label_rows(batch, num_positions=1, prompt_rows=True)  # label position 2 (a prompt token) too
    assert rows[:, 2].tolist() == [0, 1, 2] and labels.tolist() == [17, 18, 19]


def test_label_rows_keep_only_rows_on_the_targets_greedy_path():
    from specdec.train.batches import Batch, label_rows

    # the target's top-1 after token i is i + 1; the text leaves that path at t = 3 (token 9, not 5)
    tokens = torch.tensor([[1, 2, 3, 9, 10, 11, 12]])
    target_next = tokens + 1
    batch = Batch(tokens, torch.zeros(1, 7, 4), torch.arange(7)[None], torch.tensor([7]), torch.tensor([1]), target_next)
    all_rows, _ = label_rows(batch, num_positions=2)
    # a head reading no later token: head k at t needs tokens t + 1 .. t + k on the path (t + j != 3)
    rows, labels = label_rows(batch, num_positions=2, greedy_from=1)
    assert [tuple(r) for r in rows.tolist()] == [(0, 0, 0), (0, 0, 1), (0, 0, 3), (0, 0, 4), (1, 0, 0), (1, 0, 3)]
    assert labels.tolist() == [target_next[0, t + k + 1].item() for k, _, t in rows.tolist()]
    # a head that reads the committed next token (MTP sequential): only tokens t + 2 .. t + k must be on the path
    rows, _ = label_rows(batch, num_positions=2, greedy_from=2)
    assert [tuple(r) for r in rows.tolist()] == [(0, 0, t) for t in range(5)] + [(1, 0, 0), (1, 0, 2), (1, 0, 3)]
    assert len(all_rows) == 5 + 4  # without the condition every label position counts


def test_crop_window_keeps_the_answer_rows():
    """A long prompt with a short answer is cropped to the answer and the prompt tokens right before
    it (a uniform window would often hold none of the answer: a step spent on rows that never count);
    a long answer gets windows inside it; `prompt_rows` (every row counts) keeps uniform windows."""
    from specdec.train.data import Sample
    from specdec.train.batches import crop_start, make_batch

    def sample(prompt: int, answer: int) -> Sample:
        length = prompt + answer
        return Sample(tokens=torch.arange(length) % 50, hidden={1: torch.zeros(length, 4)}, num_prompt_tokens=prompt,
                      target_next=torch.arange(length) % 50)

    generator = torch.Generator().manual_seed(0)
    rag = sample(prompt=700, answer=100)
    for _ in range(20):
        batch = make_batch([rag], 1, 512, generator, torch.device("cpu"))
        assert int(batch.lengths[0]) == 512 and int(batch.positions[0, -1]) == 799  # ends at the answer's end
        assert int(batch.answer_start[0]) == 700 - 288  # the whole answer is inside the window
    long_answer = sample(prompt=50, answer=1000)
    starts = {crop_start(long_answer, 256, generator) for _ in range(50)}
    assert min(starts) >= 49 and max(starts) <= 1050 - 256 and len(starts) > 10
    uniform = {crop_start(rag, 512, generator, prompt_rows=True) for _ in range(50)}
    assert min(uniform) < 100 and len(uniform) > 10
    assert crop_start(sample(prompt=10, answer=20), 512, generator) == 0  # fits: no crop


def test_sampled_vocab_covers_labels_and_scores_like_the_full_head(counter, counter_data):
    from specdec.heads import FrozenTargetParts
    from specdec.train.batches import SampledVocab

    _, samples = load_samples(counter_data, [counter.num_layers], counter)
    vocab = SampledVocab.from_samples(samples, counter.vocab_size, negatives=2)
    answer_tokens = torch.cat([s.tokens[s.num_prompt_tokens:] for s in samples])
    assert set(vocab.label_ids.tolist()) == set(torch.cat([s.target_next for s in samples]).tolist())
    assert set(answer_tokens.tolist()) <= set(vocab.label_ids.tolist())  # greedy answers: every answer token is a label
    parts = FrozenTargetParts.from_target(counter).to(dtype=torch.float32)
    features = torch.randn(5, counter.hidden_size)
    labels = answer_tokens[:5]
    generator = torch.Generator().manual_seed(0)
    sub_parts, local = vocab.draw(parts, labels, generator)
    ids = torch.cat([vocab.label_ids, vocab.others[torch.randperm(vocab.others.numel(), generator=torch.Generator().manual_seed(0))[:2]]])
    assert sub_parts.lm_head_weight.shape[0] == vocab.label_ids.numel() + 2
    assert not set(ids[vocab.label_ids.numel():].tolist()) & set(vocab.label_ids.tolist())  # negatives are not labels
    full, sub = parts.lm_head(features), sub_parts.lm_head(features)  # [5, V], [5, V']
    assert_close_to_scale(sub, full[:, ids], what="sampled-vocab logits")
    assert torch.equal(ids[local], labels)  # remapped labels point at the same tokens
    with pytest.raises(ValueError, match="missing"):
        vocab.draw(parts, torch.tensor([vocab.others[0]]), generator)


# ---------------------------------------------------------------------------- training
@pytest.mark.parametrize("kind", list(HEAD_SETUPS))
def test_training_loss_falls_below_limit(trained, kind):
    _, result, _ = trained[kind]
    first, last = result.history["eval"][0], result.history["eval"][-1]
    assert first["step"] == 0 and last["step"] == result.steps == 150
    assert first["loss"] > 2.5  # untrained heads do not know the pattern
    assert last["loss"] < LOSS_LIMIT, result.history["eval"]
    assert last["top1"][0] > AGREEMENT_LIMIT, last["top1"]
    assert len(last["rank_acc"]) == HEAD_SETUPS[kind][0]


@pytest.mark.parametrize("kind,lr,variant", [
    ("medusa", 3e-3, {"softmax_negatives": 2}),  # sampled softmax; eval still over the FULL vocabulary
    ("mtp-sequential", 1e-3, {"feature_weight": 1.0}),  # token loss + feature regression
], ids=["sampled-softmax", "feature-loss"])
def test_training_variants_learn_too(counter, counter_data, tmp_path, kind, lr, variant):
    heads = build_heads(kind, counter, HEAD_SETUPS[kind][0])
    _, samples = load_samples(counter_data, sorted({heads.input_layer, counter.num_layers}), counter)
    settings = TrainSettings(steps=150, lr=lr, batch_size=4, loss_rows=256, warmup_steps=10, eval_every=150, **variant)
    result = train(heads, counter, samples, tmp_path / "ckpt", settings, target_description(counter), progress=False,
                   log=lambda _: None)
    last = result.history["eval"][-1]
    assert last["loss"] < LOSS_LIMIT and last["top1"][0] > AGREEMENT_LIMIT, last


def test_sampled_softmax_settings_are_checked():
    with pytest.raises(ValueError, match="softmax_negatives"):
        TrainSettings(steps=1, softmax_negatives=-1).validate()


def test_feature_loss_is_smooth_l1_to_the_targets_top_hidden(counter, counter_data):
    import torch.nn.functional as F

    from specdec.heads import FrozenTargetParts
    from specdec.train.batches import label_rows, make_batch
    from specdec.train.trainer import heads_loss

    heads = build_heads("medusa", counter, 1)
    torch.nn.init.normal_(heads.heads[0][0].weight, std=0.1)
    layers = [counter.num_layers]
    _, samples = load_samples(counter_data, layers, counter)
    parts = FrozenTargetParts.from_target(counter).to(dtype=torch.float32)
    batch = make_batch(samples[:2], counter.num_layers, 512, torch.Generator().manual_seed(0), torch.device("cpu"),
                       top_layer=counter.num_layers)
    plain = TrainSettings(steps=1, loss_rows=10_000, head_decay=1.0)
    with_features = TrainSettings(steps=1, loss_rows=10_000, head_decay=1.0, feature_weight=0.5)
    token_loss, _, _ = heads_loss(heads, batch, parts, plain, torch.Generator())
    both, _, _ = heads_loss(heads, batch, parts, with_features, torch.Generator())
    rows, _ = label_rows(batch, 1, greedy_from=1)  # the rows the trainer learns on
    readout = heads(batch.hidden)[rows[:, 0], rows[:, 1], rows[:, 2]]
    wanted = batch.top_hidden[rows[:, 1], rows[:, 2] + 1]  # head 1 at t: the state at t + 1 produced label t + 2
    assert torch.allclose(both, token_loss + 0.5 * F.smooth_l1_loss(readout, wanted), atol=1e-5)
    batch.top_hidden = None
    with pytest.raises(ValueError, match="top-layer"):
        heads_loss(heads, batch, parts, with_features, torch.Generator())
    with pytest.raises(ValueError, match="feature_weight"):
        TrainSettings(steps=1, feature_weight=-1.0).validate()


def test_trainer_resume_continues_exactly(counter, counter_data, tmp_path):
    heads_layer = counter.num_layers
    _, samples = load_samples(counter_data, [heads_layer], counter)
    info = target_description(counter)
    quiet = lambda _: None  # noqa: E731
    settings = lambda: TrainSettings(steps=12, lr=3e-3, batch_size=2, loss_rows=64, eval_every=100, save_every=100)  # noqa: E731
    straight = build_heads("medusa", counter, 2)
    train(straight, counter, samples, tmp_path / "straight", settings(), info, progress=False, log=quiet)
    halves = build_heads("medusa", counter, 2)
    # the "interrupted" run stops after 6 of its 12 steps
    train(halves, counter, samples, tmp_path / "halves", settings(), info, progress=False, log=quiet, stop_after_steps=6)
    resumed = build_heads("medusa", counter, 2)  # a new process: fresh weights, restored from the state file
    result = train(resumed, counter, samples, tmp_path / "halves", settings(), info, resume=True, progress=False, log=quiet)
    assert result.steps == 12
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert (tmp_path / "halves" / "training.png").stat().st_size > 0


@torch.no_grad()
def test_mtp_training_pass_matches_the_drafting_computation(counter, counter_data):
    """The unrolled training forward must compute exactly what the drafter computes step by step."""
    from specdec.heads import FrozenTargetParts

    parts = FrozenTargetParts.from_target(counter)
    torch.manual_seed(0)
    sequential = build_heads("mtp-sequential", counter, 3)
    parallel = build_heads("mtp-parallel", counter, 2)
    for module in (sequential, parallel):
        for param in module.parameters():  # random weights: nothing may match by accident
            param.add_(torch.randn_like(param) * 0.1)
    _, samples = load_samples(counter_data, [counter.num_layers - 1, counter.num_layers], counter)
    sample = samples[0]
    tokens, length = sample.tokens[None], sample.tokens.shape[0]
    positions = torch.arange(length)[None]
    last, trunk = sample.hidden[counter.num_layers].float()[None], sample.hidden[counter.num_layers - 1].float()[None]
    trained_view = sequential(last, tokens, positions, parts)  # [D, 1, T, H]
    for p in (4, 11, length - 5):
        cache = sequential.new_cache(64, torch.float32, "cpu")
        depth1 = sequential.step(last[:, : p + 1], tokens[:, 1 : p + 2], positions[:, : p + 1], cache, parts)
        assert_close_to_scale(depth1[0], trained_view[0, 0, : p + 1], what=f"depth 1 at {p}")
        previous = depth1[:, -1:]
        for depth in (2, 3):  # depth d at position p + d - 1, reading token p + d
            token, position = tokens[:, p + depth : p + depth + 1], torch.tensor([[p + depth - 1]])
            previous = sequential.step(previous, token, position, cache, parts)
            assert_close_to_scale(previous[0, 0], trained_view[depth - 1, 0, p], what=f"depth {depth} at {p}")
    trained_view = parallel(trunk, tokens, positions)  # [K, 1, T, H]
    cache = parallel.new_cache(length, torch.float32, "cpu")
    first = parallel.absorb(trunk[:, :7], positions[:, :7], cache)  # [K, H] at position 6
    assert_close_to_scale(first, trained_view[:, 0, 6], what="first absorb")
    rest = parallel.absorb(trunk[:, 7:], positions[:, 7:], cache)  # incremental, like verify steps
    assert_close_to_scale(rest, trained_view[:, 0, -1], what="incremental absorb")


def test_train_dtype_auto_is_bf16_on_cuda_and_on_cpus_with_native_bf16():
    from specdec.kernels.build import cpu_flags
    from specdec.train.cli import default_train_dtype

    native = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    assert default_train_dtype("cpu") == ("bf16" if native else "fp32")
    assert default_train_dtype("cuda:0") == "bf16"


# ---------------------------------------------------------------------------- checkpoints and drafters
@pytest.mark.parametrize("kind", list(HEAD_SETUPS))
def test_save_load_gives_identical_proposals(counter, trained, kind):
    checkpoint, result, heads = trained[kind]
    loaded = drafter_for(kind, counter, checkpoint=checkpoint)
    in_memory = drafter_for(kind, counter, heads=heads, rank_acc=result.eval["rank_acc"])
    sampled = SamplingParams(temperature=1.0, seed=3)
    for prompt in ([5, 6, 7, 8], [20, 21, 22], [9, 4, 17, 3, 11]):
        for sampling in (SamplingParams(), sampled):
            a = first_proposal(loaded, counter, prompt, 6, sampling)
            b = first_proposal(in_memory, counter, prompt, 6, sampling)
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            assert (a.draft_probs is None) == (b.draft_probs is None)
            if a.draft_probs is not None:
                assert torch.equal(a.draft_probs, b.draft_probs)
    # the trained heads know the cycle: the first drafted token follows the root
    greedy = first_proposal(loaded, counter, [5, 6, 7, 8], 3)
    assert int(greedy.tokens[0]) == 9  # newest cached token 7, root 8: head 1 proposes the token after the root


@pytest.mark.parametrize("kind,options", [
    ("medusa", {}),
    ("medusa", {"choices": "[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"}),
    ("mtp-parallel", {}),
    ("mtp-parallel", {"tree": True, "tree_nodes": 8}),
    ("mtp-sequential", {}),
    ("mtp-sequential", {"gamma": 5}),
], ids=["medusa", "medusa-choices", "parallel-chain", "parallel-tree", "sequential", "sequential-gamma5"])
def test_greedy_with_trained_heads_equals_plain(counter, trained, kind, options):
    drafter = drafter_for(kind, counter, checkpoint=trained[kind][0], **options)
    for prompt in ([5, 6, 7, 8], [20, 21], [13, 3, 22, 9]):
        plain = generate(counter, prompt, max_new_tokens=30)
        spec = generate(counter, prompt, drafter, max_new_tokens=30)
        assert spec.tokens == plain.tokens
        assert spec.stats.tau > 2.5  # the heads learned the pattern: drafts are accepted


@pytest.mark.parametrize("kind,draft_vocab", [("mtp-sequential", 0), ("mtp-parallel", 0), ("mtp-sequential", 12)])
def test_sampled_mtp_drafts_keep_the_target_distribution(counter, trained, kind, draft_vocab):
    """Temperature 1: drafts are SAMPLED from the heads (draft_probs = q); outputs must follow the target.
    With a reduced draft vocabulary q is zero outside it: still exactly the target's distribution."""
    from specdec.api import generate_batch

    drafter = drafter_for(kind, counter, checkpoint=trained[kind][0], gamma=2, draft_vocab=draft_vocab)
    prompt, runs = [5, 6, 7, 8], 1500
    # token 1 comes from the prefill, tokens 2-3 from ONE step: 2 sampled draft tokens + verification
    results = generate_batch(counter, [prompt] * runs, drafter, max_new_tokens=4,
                             sampling=[SamplingParams(1.0, seed=seed) for seed in range(runs)])
    assert sum(r.stats.accepted_tokens for r in results) > 0.1 * runs  # drafts were really tried and accepted
    for pvalue in token_marginal_pvalues(counter, prompt, results):
        assert pvalue > 1e-3


@pytest.mark.parametrize("kind", list(HEAD_SETUPS))
def test_reduced_draft_vocabulary_limits_proposals_and_stays_lossless(counter, trained, counter_data, kind):
    checkpoint = trained[kind][0]
    ranking = json.loads((checkpoint / "config.json").read_text())["draft_vocab"]
    from specdec.train.trainer import split_samples

    _, samples = load_samples(counter_data, [counter.num_layers], counter)
    train_samples, _ = split_samples(samples, TrainSettings().eval_fraction)
    answer_labels = torch.cat([s.target_next[s.num_prompt_tokens - 1 : -1] for s in train_samples])
    assert set(ranking["ids"]) == set(answer_labels.tolist())  # every training label, nothing else
    counts = [int((answer_labels == token).sum()) for token in ranking["ids"]]
    assert len(ranking["ids"]) >= 15 and counts == sorted(counts, reverse=True)  # most frequent first
    assert ranking["heldout_coverage"][str(len(ranking["ids"]))] > 0.9
    options = {"tree": True} if kind == "mtp-parallel" else {}
    small = drafter_for(kind, counter, checkpoint=checkpoint, draft_vocab=6, **options)
    allowed = set(ranking["ids"][:6])
    proposed = set()
    for prompt in ([5, 6, 7, 8], [20, 21], [13, 3, 22, 9]):
        draft = first_proposal(small, counter, prompt, 4)
        proposed |= set(draft.tokens.tolist())
        plain = generate(counter, prompt, max_new_tokens=30)
        assert generate(counter, prompt, small, max_new_tokens=30).tokens == plain.tokens
    assert proposed and proposed <= allowed
    full = drafter_for(kind, counter, checkpoint=checkpoint, draft_vocab=0, **options)
    assert full.vocab.ids is None and small.vocab.rows == 6
    assert small.cost.per_token < full.cost.per_token
    with pytest.raises(ValueError, match="draft_vocab"):
        drafter_for(kind, counter, checkpoint=checkpoint, draft_vocab=-1)


def test_eval_by_source_pools_to_the_same_agreement_as_one_eval(counter, trained, counter_data):
    from specdec.heads import FrozenTargetParts
    from specdec.train.trainer import evaluate, evaluate_by_source

    heads = trained["medusa"][2]
    _, samples = load_samples(counter_data, [heads.input_layer], counter)
    assert {s.source for s in samples} == {"self-instruct"}  # read from the data's prompts.jsonl
    for index, sample in enumerate(samples):  # three made-up sources of unequal size
        sample.source = ["a", "b", "b", "c"][index % 4]
    parts = FrozenTargetParts.from_target(counter)
    settings = TrainSettings(steps=1, eval_rows=10**9)  # every row: the pooled rate is the one-pass rate
    by_source = evaluate_by_source(heads, samples, parts, settings, torch.device("cpu"))
    whole = evaluate(heads, samples, parts, settings, torch.device("cpu"))
    assert list(by_source) == ["a", "b", "c", "all"] and [by_source[n]["samples"] for n in "abc"] == [4, 8, 4]
    assert by_source["all"]["rows"] == whole["rows"] and by_source["all"]["rows_greedy_path"] == whole["rows_greedy_path"]
    assert by_source["all"]["top1"] == pytest.approx(whole["top1"], abs=1e-6)
    assert by_source["all"]["top1_greedy_path"] == pytest.approx(whole["top1_greedy_path"], abs=1e-6)


def test_wrong_target_checkpoint_is_rejected(counter, trained, counter_data, tmp_path):
    other = make_counter_target(tmp_path / "other", seed=1)
    for kind in HEAD_SETUPS:
        with pytest.raises(ValueError, match="made for target"):
            drafter_for(kind, other, checkpoint=trained[kind][0])
    with pytest.raises(ValueError, match="made for target"):
        load_samples(counter_data, [other.num_layers], other)
    with pytest.raises(ValueError, match="for the 'mtp' drafter"):
        MedusaDrafter(counter, checkpoint=str(trained["mtp-sequential"][0]))
    with pytest.raises(ValueError, match="needs checkpoint"):
        MTPDrafter(counter)
    with pytest.raises(ValueError, match="tree=true needs parallel"):
        MTPDrafter(counter, checkpoint=str(trained["mtp-sequential"][0]), tree=True)
    with pytest.raises(ValueError, match="deeper than"):
        MedusaDrafter(counter, checkpoint=str(trained["medusa"][0]), choices="[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]")
    heads, config = load_checkpoint(trained["medusa"][0], counter)
    assert config["target"]["name"] == counter.name and "lm_head.weight" not in heads.state_dict()


def test_best_first_tree_is_prefix_closed_and_greedy():
    rank_acc = [[0.8, 0.1, 0.05], [0.6, 0.2, 0.1], [0.4, 0.2, 0.1]]
    choices = best_first_choices(rank_acc, 8)
    assert choices[:3] == [(0,), (0, 0), (0, 0, 0)]  # 0.8, 0.48, 0.19 beat every alternative
    for count in range(1, 9):
        kept = set(choices[:count])
        assert all(len(path) == 1 or path[:-1] in kept for path in kept)


def test_cli_end_to_end_on_tiny_model(tiny_dirs, tmp_path, capsys):
    from specdec.cli import main

    model_dir = str(tiny_dirs["llama"][0])
    data, ckpt = str(tmp_path / "data"), str(tmp_path / "ckpt")
    assert main(["train", "data", "--model", model_dir, "--out", data, "--num-prompts", "3", "--max-new-tokens", "8",
                 "--shard-size", "2", "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["complete"] and sum(info["prompts"] for info in manifest["sources"].values()) == 3
    answers = sum(info["supervised_positions"] for info in manifest["shards"].values())
    throughput = manifest["throughput"]
    assert throughput["supervised_positions"] == answers > 0 and throughput["positions_per_cpu_minute"] > 0
    train_args = ["train", "mtp", "--model", model_dir, "--data", data, "--out", ckpt, "--flavour", "parallel",
                  "--num-heads", "2", "--steps", "5", "--batch-size", "2", "--loss-rows", "32", "--no-progress"]
    assert main(train_args) == 0
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["head"]["kind"] == "mtp-parallel" and config["training"]["steps"] == 5
    assert config["training"]["samples_per_minute"] == pytest.approx(
        60 * 5 * 2 / config["training"]["elapsed_s"], rel=0.01)  # steps x batch rows per minute of training
    assert (tmp_path / "ckpt" / "training.png").exists()
    assert main(train_args) == 2  # refuses to overwrite a checkpoint without --resume / --overwrite
    resume_args = [arg if arg != "5" else "8" for arg in train_args] + ["--resume"]
    assert main(resume_args) == 0
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["training"]["steps"] == 8
    capsys.readouterr()
    assert main(["train", "eval", "--model", model_dir, "--checkpoint", ckpt, "--data", data]) == 0
    report = capsys.readouterr().out.splitlines()
    held_out_source = json.loads((tmp_path / "data" / "prompts.jsonl").read_text().splitlines()[1])["source"]
    assert "1 held-out answers" in report[0] and [line.split()[0] for line in report[1:]] == [held_out_source, "all"]
    assert main(["train", "eval", "--model", model_dir, "--checkpoint", ckpt, "--data", data, "--max-rows", "-1"]) == 2

    # teacher-forced text as a second --data directory
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "notes.md").write_text("speculative decoding drafts tokens and the target verifies them. " * 8)
    text = str(tmp_path / "text")
    assert main(["train", "data", "--model", model_dir, "--out", text, "--corpus", str(corpus), "--chunk-tokens", "64",
                 "--corpus-licence", "CC0", "--no-progress"]) == 0
    text_manifest = json.loads((tmp_path / "text" / "manifest.json").read_text())
    assert text_manifest["kind"] == "teacher-forced" and text_manifest["sources"]["corpus"]["licence"] == "CC0"
    both = ["train", "medusa", "--model", model_dir, "--data", data, "--data", text, "--out", str(tmp_path / "medusa"),
            "--num-heads", "2", "--steps", "3", "--batch-size", "2", "--loss-rows", "32", "--no-progress"]
    assert main(both) == 0
    used = json.loads((tmp_path / "medusa" / "config.json").read_text())["data"]
    assert [d["kind"] for d in used] == ["self-distilled", "teacher-forced"] and used[1]["samples"] == text_manifest["num_prompts"]
