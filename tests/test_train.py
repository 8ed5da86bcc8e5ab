"""Trained drafters: self-distillation data (resume), the trainer (loss falls, resume), checkpoints
(save -> load -> identical proposals, wrong target rejected) and the `medusa` / `mtp` drafters
(greedy output identical to plain decoding, sampled output distributed like the target).

The tiny target is a "counter": its embeddings / LM head are set so that greedy decoding walks
the cycle 3, 4, ..., V - 1, 3, ... (its blocks are random but small). Its self-distilled answers are
therefore a repetitive deterministic pattern that heads can learn in a few hundred steps, while
the blocks still make the hidden states (and the heads' job) non-trivial.
"""

import json
import random

import pytest
import torch
from conftest import assert_close_to_scale, make_tiny_hf_dir, skip_without_kernel
from safetensors.torch import load_file
from scipy.stats import chisquare

from specdec import SamplingParams, generate
from specdec import loop
from specdec.drafters.base import DraftContext
from specdec.drafters.medusa import MedusaDrafter, best_first_choices
from specdec.drafters.mtp import MTPDrafter
from specdec.models.llama import load_native
from specdec.train import DataSettings, TrainSettings, build_dataset, build_heads, load_checkpoint, load_samples, train
from specdec.heads import target_description
from specdec.train.prompts import FINITE_POOLS_MIX, SOURCES, PromptItem, mixed_prompts
from specdec.verify import VerifyResult

VOCAB = 24
FIRST_CYCLE_TOKEN = 3  # 0 = <s>, 1 and 2 are EOS ids of the tiny tokenizer / generation config
LOSS_LIMIT = 1.3  # held-out CE every head type must get below (it starts near ln(24) = 3.2-3.5)
AGREEMENT_LIMIT = 0.9  # held-out top-1 agreement of head 1 after training
FLOAT16_REL = 2e-3  # stored hidden states are float16 (each value rounded to 2^-11 of itself) from batched forwards
HEAD_SETUPS = {  # kind -> (head positions, learning rate)
    "medusa": (3, 3e-3),
    "mtp-parallel": (3, 1e-3),
    "mtp-sequential": (3, 1e-3),
}


def make_counter_target(path, seed: int = 0, logit_gap: float = 2.5):
    """A tiny Llama whose greedy output is the cycle 3..V-1 (p(next in cycle) ~ 0.25 at temperature 1)."""
    _, model = make_tiny_hf_dir(path, "llama", seed=seed, vocab_size=VOCAB)
    hidden_size = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        codes = torch.linalg.qr(torch.randn(hidden_size, hidden_size, generator=generator))[0][:VOCAB]  # [V, H]
        successor = [FIRST_CYCLE_TOKEN if t < FIRST_CYCLE_TOKEN or t == VOCAB - 1 else t + 1 for t in range(VOCAB)]
        lm_head = torch.zeros(VOCAB, hidden_size)
        for token, following in enumerate(successor):
            lm_head[following] += codes[token]
        model.model.embed_tokens.weight.copy_(codes * 4)
        model.lm_head.weight.copy_(lm_head * logit_gap / hidden_size**0.5)
        for layer in model.model.layers:  # keep the blocks, but small: the cycle stays the argmax
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(path)
    return load_native(path, name=f"counter-{seed}")


def text_prompts(count: int, seed: int) -> list[PromptItem]:
    """Short prompts in the tiny char tokenizer's alphabet (ids 3..V-1 are chr(33)..chr(30 + V - 1))."""
    rng = random.Random(seed)
    return [
        PromptItem("".join(chr(30 + rng.randrange(FIRST_CYCLE_TOKEN, VOCAB)) for _ in range(rng.randrange(2, 6))), "self-instruct")
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    return make_counter_target(tmp_path_factory.mktemp("counter") / "model", seed=0)


def counter_selfdistill_data(counter, out, layers=None):
    """16 greedy self-distilled answers of the counter in shards of 8 (`layers`: the hidden layers
    to store, default the heads' own); the data every trainer test in this suite learns from."""
    settings = DataSettings(num_prompts=16, max_new_tokens=40, shard_size=8, sampled_fraction=0.0, layers=layers)
    build_dataset(counter, out, settings, prompts=text_prompts(16, seed=0), progress=False, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def counter_data(counter, tmp_path_factory):
    return counter_selfdistill_data(counter, tmp_path_factory.mktemp("counter_data") / "data")


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
        return cls.from_heads(target, heads, rank_acc=rank_acc, **options)
    return cls(target, checkpoint=str(checkpoint), **options)


# ---------------------------------------------------------------------------- prompts and data
def test_offline_prompt_mix_is_deterministic_and_sourced():
    prompts = mixed_prompts(60, seed=3, weights=FINITE_POOLS_MIX)  # the kinds' own tests: tests/test_prompts.py
    assert prompts == mixed_prompts(60, seed=3, weights=FINITE_POOLS_MIX) and prompts != mixed_prompts(60, 4, FINITE_POOLS_MIX)
    assert len({p.text for p in prompts}) == 60
    assert {p.source for p in prompts} == set(FINITE_POOLS_MIX)  # all three finite pools take part
    assert "PSF" in SOURCES["python-docs"].licence or "Python Software Foundation" in SOURCES["python-docs"].licence
    with pytest.raises(ValueError, match="num_prompts"):
        mixed_prompts(0)


def _shard_tensors(directory):
    manifest = json.loads((directory / "manifest.json").read_text())
    return manifest, {shard: load_file(str(directory / info["file"])) for shard, info in manifest["shards"].items()}


def test_held_out_samples_are_spread_over_the_data_not_its_tail():
    from types import SimpleNamespace

    from specdec.train.trainer import split_samples

    # a job's tail can be a single prompt source (the pools run out): 70 of one kind, then 30 of another
    samples = [SimpleNamespace(source="mixed" if i < 70 else "code", teacher_forced=False) for i in range(100)]
    train_part, held_out = split_samples(samples, 0.1)
    assert len(held_out) == 10 and len(train_part) == 90 and not {id(s) for s in held_out} & {id(s) for s in train_part}
    assert [s.source for s in held_out].count("mixed") == 7  # the same mix as the whole data
    for count in (2, 3, 11, 57):  # every sample lands on exactly one side, at least one on each
        few = [SimpleNamespace(teacher_forced=False) for _ in range(count)]
        train_part, held_out = split_samples(few, 0.1)
        assert len(train_part) + len(held_out) == count and held_out and train_part
        assert {id(s) for s in train_part} | {id(s) for s in held_out} == {id(s) for s in few}


def test_a_prompt_drawn_by_two_data_jobs_is_used_once_and_never_on_both_sides_of_the_split():
    from specdec.train.data import Sample
    from specdec.train.trainer import drop_repeated_prompts, split_samples

    def sample(prompt, answer, teacher_forced=False):
        tokens = torch.tensor(prompt + answer)
        return Sample(tokens, {}, len(prompt), tokens.clone(), teacher_forced=teacher_forced)

    job_a = [sample([1, 2, i], [7, i]) for i in range(20)]
    job_b = [sample([1, 2, i], [7, i]) for i in range(10, 30)]  # prompts 10..19 drawn by both jobs
    # the same prompt tokens with another (sampled) answer still repeats the prompt; a longer prompt does not
    job_b += [sample([1, 2, 3], [9, 9]), sample([1, 2, 3, 4], [7])]
    corpus = [sample([5, 6], [i, i + 1], teacher_forced=True) for i in range(4)]  # one instruction, every chunk kept
    kept, dropped = drop_repeated_prompts(job_a + job_b + corpus)
    assert dropped == 11 and len(kept) == 20 + 10 + 1 + 4
    assert kept[:20] == job_a  # the first directory's copy stays, in order
    prompts = [tuple(s.tokens[: s.num_prompt_tokens].tolist()) for s in kept if not s.teacher_forced]
    assert len(prompts) == len(set(prompts))
    train_part, held_out = split_samples(kept, 0.1)
    seen = lambda part: {tuple(s.tokens[: s.num_prompt_tokens].tolist()) for s in part if not s.teacher_forced}  # noqa: E731
    assert not seen(train_part) & seen(held_out)


def test_data_resume_after_interruption_gives_identical_shards(counter, tmp_path):
    # half of the answers are sampled: their seeds must not depend on when the job ran
    settings = lambda: DataSettings(num_prompts=6, max_new_tokens=12, shard_size=2, sampled_fraction=0.5, seed=5)  # noqa: E731
    prompts = text_prompts(6, seed=1)
    quiet = lambda _: None  # noqa: E731
    build_dataset(counter, tmp_path / "whole", settings(), prompts=prompts, progress=False, log=quiet)
    partial = build_dataset(counter, tmp_path / "resumed", settings(), prompts=prompts, progress=False, log=quiet,
                            stop_after_shards=1)
    assert len(partial["shards"]) == 1 and not partial["complete"]
    _, samples = load_samples(tmp_path / "resumed", [counter.num_layers], counter)  # finished shards are usable
    assert len(samples) == 2
    resumed = build_dataset(counter, tmp_path / "resumed", settings(), prompts=prompts, progress=False, log=quiet)
    assert resumed["complete"]

    whole_manifest, whole = _shard_tensors(tmp_path / "whole")
    resumed_manifest, again = _shard_tensors(tmp_path / "resumed")
    assert whole.keys() == again.keys() == {"0", "1", "2"}
    for shard in whole:
        assert whole[shard].keys() == again[shard].keys()
        for name in whole[shard]:
            assert torch.equal(whole[shard][name], again[shard][name]), (shard, name)
    assert any(bool(t["sampled"].any()) for t in whole.values()) and any(not bool(t["sampled"].all()) for t in whole.values())
    assert resumed_manifest["sources"]["self-instruct"]["licence"] and resumed_manifest["generated_text_licence"]
    assert resumed_manifest["target"]["fingerprint"] == target_description(counter)["fingerprint"]

    with pytest.raises(ValueError, match="other settings"):
        build_dataset(counter, tmp_path / "whole", DataSettings(num_prompts=6, max_new_tokens=13, shard_size=2),
                      prompts=prompts, progress=False, log=quiet)


def test_hidden_states_in_data_match_the_target(counter, counter_data):
    layer = counter.num_layers
    _, samples = load_samples(counter_data, [layer], counter)
    sample = samples[3]
    _, hiddens = counter.forward(sample.tokens[None], torch.arange(len(sample.tokens))[None],
                                 counter.new_cache(1, len(sample.tokens)), hidden_layers=(layer,))
    assert_close_to_scale(sample.hidden[layer].float(), hiddens[layer][0], FLOAT16_REL, "stored hidden")
    # the answer is the target's own greedy continuation of the prompt (without its last token,
    # which was never fed to the target; the last row's label is that token)
    prompt = sample.tokens[: sample.num_prompt_tokens].tolist()
    answer = generate(counter, prompt, max_new_tokens=40).tokens
    assert answer[:-1] == sample.tokens[sample.num_prompt_tokens :].tolist() and int(sample.target_next[-1]) == answer[-1]


@pytest.mark.parametrize("prefill_logits_bytes", [None, 1])
def test_data_rows_come_from_the_decoding_forwards_bitwise(counter, tmp_path, monkeypatch, prefill_logits_bytes):
    """No second pass: the stored hidden rows and labels are those of the forwards that decoded the
    answers, bitwise equal to one forward over prompt + answer (rows are batch invariant), for
    greedy and sampled answers decoded together in one ragged batch — also when the memory bound
    on the prefill's every-row logits splits the prompts into one prefill forward each."""
    skip_without_kernel()
    if prefill_logits_bytes is not None:
        monkeypatch.setattr(loop, "PREFILL_LOGITS_BYTES", prefill_logits_bytes)
    layers = [1, counter.num_layers]
    settings = DataSettings(num_prompts=6, max_new_tokens=14, shard_size=6, sampled_fraction=0.5, seed=3, layers=layers)
    prompts = text_prompts(6, seed=2)
    build_dataset(counter, tmp_path, settings, prompts=prompts, progress=False, log=lambda _: None)
    _, samples = load_samples(tmp_path, layers, counter)
    assert len(samples) == 6
    kinds = set()
    for index, (prompt, sample) in enumerate(zip(prompts, samples)):
        decoding = settings.decoding_for(index)
        kinds.add(decoding.greedy)
        prompt_ids = counter.encode_prompt(prompt.text)
        full = prompt_ids + generate(counter, prompt_ids, max_new_tokens=14, sampling=decoding).tokens
        assert sample.tokens.tolist() == full[:-1] and sample.num_prompt_tokens == len(prompt_ids)
        length = len(sample.tokens)
        logits, hiddens = counter.forward(sample.tokens[None], torch.arange(length)[None], counter.new_cache(1, length),
                                          hidden_layers=tuple(layers))
        for layer in layers:
            assert torch.equal(sample.hidden[layer], hiddens[layer][0].half()), (index, layer)
        assert torch.equal(sample.target_next, logits[0].argmax(-1)), index
        if decoding.greedy:  # a greedy answer is its own label row by row
            assert sample.target_next[len(prompt_ids) - 1 :].tolist() == full[len(prompt_ids) :]
    assert kinds == {True, False}


def test_prefill_groups_bound_the_every_row_logits():
    """32 prompts of 800 tokens with every row's logits over a 151,936-token vocabulary would be
    15.6 GB in one forward: the groups keep each forward's logits under the bound, cover every
    prompt once and in order, and never leave a prompt out even when it alone is over."""
    vocab = 151936
    lengths = [800] * 20 + [30, 3000, 40] + [800] * 9
    groups = loop._prefill_groups(lengths, vocab)
    assert [i for start, end in groups for i in range(start, end)] == list(range(len(lengths)))
    for start, end in groups:
        size = (end - start) * max(lengths[start:end]) * vocab * 4
        assert size <= loop.PREFILL_LOGITS_BYTES or end - start == 1, (start, end, size)
    assert (21, 22) in groups  # the 3000-token prompt is over the bound alone
    assert len(groups) < len(lengths)  # and the others share forwards
    assert loop._prefill_groups(lengths, 1) == [(0, len(lengths))]  # last-row logits only: one forward


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


def test_sampled_vocab_covers_labels_and_scores_like_the_full_head(counter, counter_data):
    from specdec.heads import FrozenTargetParts
    from specdec.train.trainer import SampledVocab

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


def test_data_stores_the_targets_top1_and_old_shards_are_upgraded(counter, counter_data, tmp_path):
    import shutil

    from safetensors.torch import save_file

    _, samples = load_samples(counter_data, [counter.num_layers], counter)
    sample = samples[0]
    logits, _ = counter.forward(sample.tokens[None], torch.arange(len(sample.tokens))[None], counter.new_cache(1, len(sample.tokens)))
    assert torch.equal(sample.target_next, logits[0].argmax(-1))
    # greedy answers: token t + 1 of the answer is the target's top-1 after t
    start = sample.num_prompt_tokens
    assert torch.equal(sample.target_next[start - 1 : -1], sample.tokens[start:])
    # a shard written before target_next existed: derived once from the top layer, written back
    old = tmp_path / "old"
    shutil.copytree(counter_data, old)
    shard = old / "shard-00000.safetensors"
    tensors = load_file(str(shard))
    save_file({k: v for k, v in tensors.items() if k != "target_next"}, str(shard))
    with pytest.raises(ValueError, match="no target given"):
        load_samples(old, [counter.num_layers])
    _, upgraded = load_samples(old, [counter.num_layers], counter)
    assert all(torch.equal(a.target_next, b.target_next) for a, b in zip(upgraded, samples))
    assert "target_next" in load_file(str(shard))


def test_label_rows_use_the_targets_choice_and_prompt_rows_widen_them():
    from specdec.train.trainer import Batch, label_rows

    tokens = torch.tensor([[5, 6, 7, 8, 9, 0]])  # one row: 5 tokens (prompt 5, 6, 7) + padding
    target_next = torch.tensor([[16, 17, 18, 19, 20, 0]])  # the target's top-1 after each position
    batch = Batch(tokens, torch.zeros(1, 6, 4), torch.arange(6)[None], torch.tensor([5]), torch.tensor([3]), target_next)
    rows, labels = label_rows(batch, num_positions=2)
    # head k at t labels position t + k + 1 in [3, 5): k=1: t=1,2; k=2: t=0,1 -> label target_next[t + k]
    assert rows.tolist() == [[0, 0, 1], [0, 0, 2], [1, 0, 0], [1, 0, 1]]
    assert labels.tolist() == [18, 19, 18, 19]
    rows, labels = label_rows(batch, num_positions=1, prompt_rows=True)  # label position 2 (a prompt token) too
    assert rows[:, 2].tolist() == [0, 1, 2] and labels.tolist() == [17, 18, 19]


def test_feature_loss_is_smooth_l1_to_the_targets_top_hidden(counter, counter_data):
    import torch.nn.functional as F

    from specdec.heads import FrozenTargetParts
    from specdec.train.trainer import heads_loss, label_rows, make_batch

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


# ---------------------------------------------------------------------------- checkpoints and drafters
def _proposal(drafter, target, prompt: list[int], budget: int, sampling=SamplingParams()):
    """begin + prefill hidden rows -> propose, as the loop would drive it (root = prompt[-1])."""
    cached = prompt[:-1]
    _, hiddens = target.forward(torch.tensor([cached]), torch.arange(len(cached))[None], target.new_cache(1, 64),
                                hidden_layers=drafter.hidden_layers)
    ctx = DraftContext(list(prompt), len(prompt) - 1, sampling, torch.Generator().manual_seed(7))
    ctx.new_hidden = {layer: h[0] for layer, h in hiddens.items()}
    drafter.begin(cached, target)
    drafter.on_verified(VerifyResult([prompt[-1]], 0, []), ctx)
    return drafter.propose(ctx, budget)


@pytest.mark.parametrize("kind", list(HEAD_SETUPS))
def test_save_load_gives_identical_proposals(counter, trained, kind):
    checkpoint, result, heads = trained[kind]
    loaded = drafter_for(kind, counter, checkpoint=checkpoint)
    in_memory = drafter_for(kind, counter, heads=heads, rank_acc=result.eval["rank_acc"])
    sampled = SamplingParams(temperature=1.0, seed=3)
    for prompt in ([5, 6, 7, 8], [20, 21, 22], [9, 4, 17, 3, 11]):
        for sampling in (SamplingParams(), sampled):
            a = _proposal(loaded, counter, prompt, 6, sampling)
            b = _proposal(in_memory, counter, prompt, 6, sampling)
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            assert (a.draft_probs is None) == (b.draft_probs is None)
            if a.draft_probs is not None:
                assert torch.equal(a.draft_probs, b.draft_probs)
    # the trained heads know the cycle: the first drafted token follows the root
    greedy = _proposal(loaded, counter, [5, 6, 7, 8], 3)
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


def _exact_token_marginals(target, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact target distributions of output tokens 2 and 3 at temperature 1: [V + 1] each, last = ended (EOS before)."""
    eos = target.eos_token_ids

    def next_probs(contexts: torch.Tensor) -> torch.Tensor:  # [n, T] -> [n, V]
        rows, width = contexts.shape
        logits, _ = target.forward(contexts, torch.arange(width).expand(rows, -1), target.new_cache(rows, width))
        return torch.softmax(logits[:, -1].double(), -1)

    first = next_probs(torch.tensor([prompt]))[0]  # [V]
    tokens = torch.arange(VOCAB)
    second = next_probs(torch.cat([torch.tensor(prompt).expand(VOCAB, -1), tokens[:, None]], 1))  # [V(x1), V]
    pairs = torch.cartesian_prod(tokens, tokens)  # [V*V, 2] (x1, x2)
    third = next_probs(torch.cat([torch.tensor(prompt).expand(VOCAB * VOCAB, -1), pairs], 1)).view(VOCAB, VOCAB, VOCAB)
    alive1 = first.clone()
    alive1[eos] = 0.0  # runs whose token 1 is EOS have no token 2
    marginal2 = torch.cat([alive1 @ second, first[eos].sum()[None]])  # [V + 1]
    joint12 = alive1[:, None] * second  # [V, V]
    ended = first[eos].sum() + joint12[:, eos].sum()
    joint12[:, eos] = 0.0
    marginal3 = torch.cat([torch.einsum("ab,abc->c", joint12, third), ended[None]])  # [V + 1]
    return marginal2, marginal3


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


def token_marginal_pvalues(target, prompt: list[int], results) -> list[float]:
    """Chi-square p-values of output tokens 2 and 3 of `results` (runs of `prompt` at temperature 1)
    against the target's exact marginals; an outcome impossible under the target gives p = 0."""
    pvalues = []
    for position, expected in zip((1, 2), _exact_token_marginals(target, prompt)):
        observed = torch.zeros(VOCAB + 1)
        for result in results:
            observed[result.tokens[position] if len(result.tokens) > position else VOCAB] += 1
        expected = expected.float() * len(results)
        if observed[expected == 0].sum() > 0:  # something impossible under the target appeared
            pvalues.append(0.0)
            continue
        big = expected >= 5  # merge rare outcomes into one bin so the chi-square test is valid
        rare = expected[~big].sum()
        obs = torch.cat([observed[big], observed[~big].sum()[None]]) if rare > 0 else observed[big]
        exp = torch.cat([expected[big], rare[None]]) if rare > 0 else expected[big]
        pvalues.append(float(chisquare(obs.numpy(), exp.numpy() * float(obs.sum()) / float(exp.sum())).pvalue))
    return pvalues


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
        draft = _proposal(small, counter, prompt, 4)
        proposed |= set(draft.tokens.tolist())
        plain = generate(counter, prompt, max_new_tokens=30)
        assert generate(counter, prompt, small, max_new_tokens=30).tokens == plain.tokens
    assert proposed and proposed <= allowed
    full = drafter_for(kind, counter, checkpoint=checkpoint, draft_vocab=0, **options)
    assert full.vocab.ids is None and small.vocab.rows == 6
    assert small.draft_cost_tokens() < full.draft_cost_tokens()
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
    train_args = ["train", "mtp", "--model", model_dir, "--data", data, "--out", ckpt, "--flavour", "parallel",
                  "--num-heads", "2", "--steps", "5", "--batch-size", "2", "--loss-rows", "32", "--no-progress"]
    assert main(train_args) == 0
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["head"]["kind"] == "mtp-parallel" and config["training"]["steps"] == 5
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


# ---------------------------------------------------------------------------- teacher-forced corpus data
def cycle_text(start: int, length: int) -> str:
    """`length` characters of the counter's greedy cycle from token `start` (token t is chr(30 + t))."""
    span = VOCAB - FIRST_CYCLE_TOKEN
    return "".join(chr(30 + FIRST_CYCLE_TOKEN + (start - FIRST_CYCLE_TOKEN + i) % span) for i in range(length))


def write_corpus(directory, seed: int = 0):
    """Text files in the counter's alphabet: runs of its greedy cycle broken by random characters."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(4):
        pieces = []
        for _ in range(6):
            pieces.append(cycle_text(rng.randrange(FIRST_CYCLE_TOKEN, VOCAB), rng.randrange(6, 14)))
            pieces.append("".join(chr(30 + rng.randrange(FIRST_CYCLE_TOKEN, VOCAB)) for _ in range(rng.randrange(1, 3))))
        (directory / f"part{index}.txt").write_text("".join(pieces))
    (directory / "image.bin").write_bytes(bytes(range(256)))  # not a text suffix: skipped
    return directory


def corpus_settings(**changes):
    from specdec.train import CorpusSettings

    return CorpusSettings(**{"chunk_tokens": 24, "shard_size": 3, "batch_size": 2, "instruction": "!!", **changes})


def test_corpus_data_is_the_targets_forward_over_the_text_and_resumes(counter, tmp_path):
    from specdec.train import build_corpus_dataset
    from specdec.train.trainer import split_samples

    corpus = write_corpus(tmp_path / "corpus")
    quiet = lambda _: None  # noqa: E731
    whole = build_corpus_dataset(counter, tmp_path / "whole", [corpus], corpus_settings(), progress=False, log=quiet)
    partial = build_corpus_dataset(counter, tmp_path / "resumed", [corpus], corpus_settings(), progress=False, log=quiet,
                                   stop_after_shards=1)
    assert len(partial["shards"]) == 1 and not partial["complete"]
    resumed = build_corpus_dataset(counter, tmp_path / "resumed", [corpus], corpus_settings(), progress=False, log=quiet)
    assert whole["complete"] and resumed["complete"] and whole["kind"] == "teacher-forced"
    _, first = _shard_tensors(tmp_path / "whole")
    _, again = _shard_tensors(tmp_path / "resumed")
    assert first.keys() == again.keys() and len(first) == whole["num_shards"] > 1
    assert all(torch.equal(first[s][name], again[s][name]) for s in first for name in first[s])
    assert whole["sources"]["corpus"]["licence"] and "4 text files" in whole["sources"]["corpus"]["description"]

    _, samples = load_samples(tmp_path / "whole", [counter.num_layers], counter)
    assert all(s.teacher_forced for s in samples) and len(samples) == whole["num_prompts"]
    prompt = counter.encode_prompt("!!")
    text = "".join((corpus / f"part{i}.txt").read_text() for i in range(4))
    for sample in samples[:4]:  # prompt + a piece of the corpus; hidden rows and top-1 from the target's own forward
        assert sample.tokens[: sample.num_prompt_tokens].tolist() == prompt
        piece = "".join(chr(30 + t) for t in sample.tokens[sample.num_prompt_tokens :].tolist())
        assert piece in text and 16 <= len(piece) <= 24
        logits, hiddens = counter.forward(sample.tokens[None], torch.arange(len(sample.tokens))[None],
                                          counter.new_cache(1, len(sample.tokens)), hidden_layers=(counter.num_layers,))
        assert_close_to_scale(sample.hidden[counter.num_layers].float(), hiddens[counter.num_layers][0], FLOAT16_REL,
                              "stored hidden")
        assert torch.equal(sample.target_next, logits[0].argmax(-1))
    # corpus samples train, never hold out (when self-distilled samples are there to hold out)
    for sample in samples[:5]:  # five stand in for the target's own answers
        sample.teacher_forced = False
    train_part, held_out = split_samples(samples, 0.1)
    assert not any(s.teacher_forced for s in held_out) and len(train_part) + len(held_out) == len(samples)


def test_corpus_data_bad_input_is_a_clear_error(counter, tmp_path):
    from specdec.train import build_corpus_dataset

    quiet = lambda _: None  # noqa: E731
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_corpus_dataset(counter, tmp_path / "out", [tmp_path / "missing"], corpus_settings(), progress=False, log=quiet)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="no text files"):
        build_corpus_dataset(counter, tmp_path / "out", [tmp_path / "empty"], corpus_settings(), progress=False, log=quiet)
    with pytest.raises(ValueError, match="chunk_tokens"):
        build_corpus_dataset(counter, tmp_path / "out", [tmp_path / "empty"], corpus_settings(chunk_tokens=4), progress=False,
                             log=quiet)
    assert not (tmp_path / "out").exists()  # nothing half-written
    corpus = write_corpus(tmp_path / "corpus")
    build_corpus_dataset(counter, tmp_path / "out", [corpus], corpus_settings(), progress=False, log=quiet, stop_after_shards=1)
    with pytest.raises(ValueError, match="other data"):  # another chunking cannot resume this directory
        build_corpus_dataset(counter, tmp_path / "out", [corpus], corpus_settings(chunk_tokens=20), progress=False, log=quiet)


def test_label_rows_keep_only_rows_on_the_targets_greedy_path():
    from specdec.train.trainer import Batch, label_rows

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


def test_heads_trained_on_corpus_text_only_agree_with_the_target_on_its_own_answers(counter, counter_data, tmp_path):
    from specdec.train import build_corpus_dataset
    from specdec.heads import FrozenTargetParts
    from specdec.train.trainer import evaluate

    corpus = write_corpus(tmp_path / "corpus", seed=1)
    quiet = lambda _: None  # noqa: E731
    build_corpus_dataset(counter, tmp_path / "data", [corpus], corpus_settings(shard_size=8), progress=False, log=quiet)
    heads = build_heads("medusa", counter, 2)
    _, corpus_samples = load_samples(tmp_path / "data", [heads.input_layer], counter)
    settings = TrainSettings(steps=150, lr=3e-3, batch_size=4, loss_rows=256, warmup_steps=10, eval_every=150)
    train(heads, counter, corpus_samples, tmp_path / "ckpt", settings, target_description(counter), progress=False, log=quiet)
    # judged on the target's own answers, which it never saw
    _, own = load_samples(counter_data, [heads.input_layer], counter)
    parts = FrozenTargetParts.from_target(counter).to(dtype=torch.float32)
    result = evaluate(heads, own, parts, settings, torch.device("cpu"))
    assert result["top1"][0] > AGREEMENT_LIMIT and result["top1"][1] > AGREEMENT_LIMIT, result["top1"]
    # on the corpus, rows whose context leaves the greedy path (after a random character) cannot be
    # predicted: the greedy-path agreement is what drafting sees, and clearly higher
    on_corpus = evaluate(heads, corpus_samples, parts, settings, torch.device("cpu"))
    assert on_corpus["top1_greedy_path"][0] > AGREEMENT_LIMIT, on_corpus
    assert on_corpus["top1_greedy_path"][0] > on_corpus["top1"][0] + 0.05, on_corpus


def test_train_dtype_auto_is_bf16_on_cuda_and_on_cpus_with_native_bf16():
    from specdec.kernels.build import cpu_flags
    from specdec.train.cli import default_train_dtype

    native = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    assert default_train_dtype("cpu") == ("bf16" if native else "fp32")
    assert default_train_dtype("cuda:0") == "bf16"


def test_crop_window_keeps_the_answer_rows():
    """A long prompt with a short answer is cropped to the answer and the prompt tokens right before
    it (a uniform window would often hold none of the answer: a step spent on rows that never count);
    a long answer gets windows inside it; `prompt_rows` (every row counts) keeps uniform windows."""
    from specdec.train.data import Sample
    from specdec.train.trainer import crop_start, make_batch

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
