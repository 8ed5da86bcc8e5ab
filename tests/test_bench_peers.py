"""Bench peers: the peer-runtime glue with the real bench code, and llama.cpp on SmolLM2 when installed.

The llama.cpp runs need llama-cpp-python (`pip install 'specdec[peers]'`, a source build); without
it they are skipped, and the rest checks what the bench does then.
"""

import json
import sys
from dataclasses import replace

import pytest

from specdec import generate
from specdec.bench import (BenchConfig, CallableMethod, PeerRuntime, PeerSource, register_method_factory, run_benchmark,
                           unregister_method)
from specdec.bench.peers import LLAMA_CPP, LLAMA_CPP_INSTALL, TRANSFORMERS, LlamaCppTarget, gguf_file_of
from specdec.bench.runner import resolve_method
from specdec.drafters import make_drafter
from specdec.models.registry import fetch_gguf

# copyable context, so that prompt lookup has something to draft from
QUESTION = {"question_id": 7, "category": "qa", "turns": [
    "Repeat this sentence exactly, then say nothing else: The quick brown fox jumps over the lazy dog."]}
MESSAGES = [{"role": "user", "content": QUESTION["turns"][0]}]


@pytest.fixture
def one_question(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps(QUESTION) + "\n")
    return str(path)


def _config(tmp_path, questions, methods, max_new_tokens=8, warmup=False):
    return BenchConfig(methods=methods, questions_path=questions, limit_per_kind=1, max_new_tokens=max_new_tokens,
                       out_dir=str(tmp_path / "out"), progress=False, warmup=warmup)


def _source(target) -> PeerSource:
    return PeerSource(name=str(target.name), model_dir=target.model_dir, tokenizer=target.tokenizer,
                      vocab_size=target.vocab_size, eos_token_ids=target.eos_token_ids)


@pytest.fixture
def llama_cpp():
    """llama-cpp-python, or a skip: not installed, or a build the bench refuses (LLAMA_CPP.missing says why)."""
    module = pytest.importorskip("llama_cpp")
    reason = LLAMA_CPP.missing()
    if reason:
        pytest.skip(reason)
    return module


@pytest.fixture
def without_llama_cpp(monkeypatch):
    """llama-cpp-python made unimportable (None in sys.modules: Python's own way to block an import)."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)


# ---------------------------------------------------------------------------- no llama.cpp needed


def test_peer_methods_resolve_to_their_runtime():
    assert resolve_method("hf-plain").runtime is TRANSFORMERS and resolve_method("hf-pld").reference == "plain"
    plain, lookup = resolve_method("llama-plain"), resolve_method("llama-lookup")
    assert plain.runtime is LLAMA_CPP and lookup.runtime is LLAMA_CPP and lookup.peer
    assert (plain.reference, lookup.reference) == ("plain", "llama-plain")
    assert resolve_method("plain").runtime is None and not resolve_method("plain").peer


def test_missing_llama_cpp_is_said_once_before_loading(without_llama_cpp, tmp_path, one_question, capsys):
    # the target does not exist: the missing-package line still comes first, before loading fails
    config = _config(tmp_path, one_question, ["plain", "llama-plain", "llama-lookup"])
    with pytest.raises(ValueError, match="/nonexistent"):
        run_benchmark(replace(config, target="/nonexistent"))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("n/a:")]
    assert lines == [f"n/a: llama-plain, llama-lookup: {LLAMA_CPP_INSTALL}"]
    assert "pip install 'specdec[peers]'" in LLAMA_CPP_INSTALL


def test_missing_llama_cpp_leaves_the_other_methods_running(without_llama_cpp, smollm2, tmp_path, one_question, capsys):
    # llama-lookup alone: its reference llama-plain is added to the run (and is n/a too)
    result = run_benchmark(_config(tmp_path, one_question, ["plain", "pld", "llama-lookup"], max_new_tokens=4),
                           target=smollm2)
    assert result.exit_code == 0
    status = {m["label"]: (m["status"], m["reason"]) for m in result.methods}
    assert list(status) == ["plain", "pld", "llama-plain", "llama-lookup"]  # report order: plain, specdec, peers
    assert status["plain"] == status["pld"] == ("ok", None)
    assert status["llama-plain"] == status["llama-lookup"] == ("n/a", LLAMA_CPP_INSTALL)
    assert {row["method"] for row in result.rows} == {"plain", "pld"}
    assert sum(line.startswith("n/a:") for line in capsys.readouterr().err.splitlines()) == 1
    assert f"| llama-lookup | n/a | n/a | n/a | n/a: {LLAMA_CPP_INSTALL} |" in result.markdown


def test_llama_target_gets_specdec_prompt_ids_and_the_registry_gguf(smollm2):
    llama_target = LLAMA_CPP.load(_source(smollm2), BenchConfig(progress=False))  # needs no llama_cpp import
    assert isinstance(llama_target, LlamaCppTarget)
    assert llama_target.gguf_path == fetch_gguf("smollm2-135m", progress=False)
    assert llama_target.gguf_path.read_bytes()[:4] == b"GGUF"
    ids = llama_target.encode_prompt(MESSAGES)
    assert ids == smollm2.encode_prompt(MESSAGES)  # the chat template, applied by specdec's tokenizer
    assert llama_target.decode(ids) == smollm2.decode(ids)
    assert llama_target.eos_token_ids == smollm2.eos_token_ids


def test_gguf_file_of_a_path_and_of_a_non_gguf_target(smollm2, tmp_path):
    from specdec.bench import MethodUnavailable

    gguf = fetch_gguf("smollm2-135m", progress=False)
    assert gguf_file_of(PeerSource(str(gguf), None, smollm2.tokenizer, smollm2.vocab_size, [])) == gguf
    with pytest.raises(MethodUnavailable, match="not a GGUF model"):
        gguf_file_of(PeerSource(str(tmp_path), tmp_path, smollm2.tokenizer, smollm2.vocab_size, []))


def test_a_method_is_compared_with_its_own_reference(smollm2, tmp_path, one_question, capsys):
    """The mechanism llama-lookup uses (reference llama-plain), with two real specdec callables."""
    def plain(target, prompt_ids, max_new_tokens, sampling):
        generation = generate(target, prompt_ids, None, max_new_tokens, sampling)
        return generation.tokens, None

    def changed(target, prompt_ids, max_new_tokens, sampling):
        tokens, _ = plain(target, prompt_ids, max_new_tokens, sampling)
        tokens[2] = (tokens[2] + 1) % target.vocab_size
        return tokens, None

    def factory(function):
        return lambda target, options, config: CallableMethod(function, target, True, function.__name__)

    register_method_factory("own-reference-test", factory(plain))
    register_method_factory("follows-reference-test", factory(changed), reference="own-reference-test")
    try:
        result = run_benchmark(_config(tmp_path, one_question, ["plain", "follows-reference-test"]), target=smollm2)
    finally:
        unregister_method("own-reference-test")
        unregister_method("follows-reference-test")
    assert [m["label"] for m in result.methods] == ["plain", "own-reference-test", "follows-reference-test"]
    rows = {row["method"]: row for row in result.rows}
    assert rows["own-reference-test"]["reference"] == "plain" and rows["own-reference-test"]["matches_plain"] is True
    assert rows["follows-reference-test"]["reference"] == "own-reference-test"
    assert rows["follows-reference-test"]["matches_plain"] is False and result.exit_code == 1
    reference_tokens = rows["own-reference-test"]["tokens"]
    assert result.mismatches == [dict(method="follows-reference-test", reference="own-reference-test",
                                      question_id=7, turn=1, position=2, plain=reference_tokens[2],
                                      got=(reference_tokens[2] + 1) % smollm2.vocab_size, exact=True)]
    assert "FAIL: 1/1 differ from own-reference-test" in result.markdown
    assert "first difference at output position 2: own-reference-test" in capsys.readouterr().err


class _OneEngineAtATime(PeerRuntime):
    """A runtime whose methods each hold an engine (as vLLM's do): the native target stands in for it."""

    name = "one-engine-test"
    methods_at_once = False

    def __init__(self, target):
        self.target = target

    def load(self, source, config):
        return self.target


def test_engine_per_method_runtimes_run_their_methods_one_at_a_time_reference_first(smollm2, tmp_path, one_question):
    alive, most_alive = set(), [0]

    class Engine(CallableMethod):
        def __init__(self, function, target):
            super().__init__(function, target, False, function.__name__)
            alive.add(self)
            most_alive[0] = max(most_alive[0], len(alive))

        def close(self):
            alive.discard(self)

    def engine_plain(target, prompt_ids, max_new_tokens, sampling):
        return generate(target, prompt_ids, None, max_new_tokens, sampling).tokens, None

    def engine_pld(target, prompt_ids, max_new_tokens, sampling):
        return generate(target, prompt_ids, make_drafter("pld", target), max_new_tokens, sampling).tokens, None

    runtime = _OneEngineAtATime(smollm2)
    register_method_factory("engine-plain-test", lambda target, options, config: Engine(engine_plain, target), runtime)
    register_method_factory("engine-pld-test", lambda target, options, config: Engine(engine_pld, target), runtime,
                            reference="engine-plain-test")
    try:  # listed after the method compared with it: the reference must still run first
        config = _config(tmp_path, one_question, ["plain", "engine-pld-test", "engine-plain-test"], max_new_tokens=16)
        result = run_benchmark(config, target=smollm2)
    finally:
        unregister_method("engine-plain-test")
        unregister_method("engine-pld-test")
    assert most_alive[0] == 1 and not alive  # never two engines at once, each closed
    rows = {row["method"]: row for row in result.rows}
    assert rows["engine-pld-test"]["reference"] == "engine-plain-test"
    assert rows["engine-pld-test"]["matches_plain"] is True  # compared: the reference's output was there
    assert result.exit_code == 0


class _BesideTarget(PeerRuntime):
    """A runtime whose copy of the target is held beside the bench's (as llama.cpp's): a second loaded SmolLM2."""

    name = "beside-test"
    beside_target = True

    def __init__(self):
        self.loaded = []

    def load(self, source, config):
        from specdec import load_target

        self.loaded.append(load_target("smollm2-135m", progress=False))
        return self.loaded[-1]


def test_peers_held_beside_the_target_run_interleaved_with_specdec_methods(smollm2, tmp_path, one_question):
    """Rounds alternate over specdec's methods AND these peers (the same work under the same swings),
    on the runtime's own copy; engine-per-method runtimes still run after them."""
    calls = []

    def logged(name):
        def run(target, prompt_ids, max_new_tokens, sampling):
            calls.append((name, target))
            return generate(target, prompt_ids, None, max_new_tokens, sampling).tokens, None
        run.__name__ = name
        return run

    def factory(name, exact):
        return lambda target, options, config: CallableMethod(logged(name), target, exact, name)

    beside, engine = _BesideTarget(), _OneEngineAtATime(smollm2)
    register_method_factory("specdec-logged-test", factory("specdec-logged-test", True))
    register_method_factory("beside-logged-test", factory("beside-logged-test", False), beside)
    register_method_factory("engine-logged-test", factory("engine-logged-test", False), engine)
    try:
        config = replace(_config(tmp_path, one_question, ["plain", "engine-logged-test", "beside-logged-test",
                                                          "specdec-logged-test"], max_new_tokens=6), repeats=2)
        result = run_benchmark(config, target=smollm2)
    finally:
        for name in ("specdec-logged-test", "beside-logged-test", "engine-logged-test"):
            unregister_method(name)
    assert [name for name, _ in calls] == ["specdec-logged-test", "beside-logged-test", "beside-logged-test",
                                           "specdec-logged-test", "engine-logged-test", "engine-logged-test"]
    assert len(beside.loaded) == 1 and beside.loaded[0] is not smollm2
    assert all(target is beside.loaded[0] for name, target in calls if name == "beside-logged-test")
    assert result.exit_code == 0 and all(row["matches_plain"] for row in result.rows)


# ---------------------------------------------------------------------------- llama.cpp (optional extra)


def test_llama_peers_on_smollm2(llama_cpp, smollm2, tmp_path, one_question):
    result = run_benchmark(_config(tmp_path, one_question, ["plain", "llama-plain", "llama-lookup"], warmup=True),
                           target=smollm2)
    assert result.exit_code == 0, result.methods  # a peer that differs only warns
    assert {m["label"]: m["status"] for m in result.methods} == {"plain": "ok", "llama-plain": "ok", "llama-lookup": "ok"}
    rows = {row["method"]: row for row in result.rows}
    eos = set(smollm2.eos_token_ids)
    for label in ("llama-plain", "llama-lookup"):
        row = rows[label]
        assert row["prompt_tokens"] == rows["plain"]["prompt_tokens"]  # the very same prompt ids
        assert 1 <= row["num_tokens"] <= 8 and row["seconds"] > 0
        assert not eos & set(row["tokens"][:-1])  # stops at specdec's EOS ids, EOS kept as the last token
        assert row["target_forwards"] >= 1
    # llama-plain: one eval call per token (the first also reads the prompt)
    assert rows["llama-plain"]["tau"] == pytest.approx(1.0)
    assert rows["llama-plain"]["reference"] == "plain"
    assert rows["llama-lookup"]["reference"] == "llama-plain"
    assert rows["llama-lookup"]["matches_plain"] == (rows["llama-lookup"]["tokens"] == rows["llama-plain"]["tokens"])
    summary = json.loads((tmp_path / "out" / "results.json").read_text())
    assert summary["config"]["llama_cpp"] == "0.3.36"
    assert "llama-lookup:" in result.markdown and "the tokens/s of its reference llama-plain" in result.markdown


def test_llama_cpp_tokenizer_agrees_with_specdec_on_the_templated_prompt(llama_cpp, smollm2):
    gguf = fetch_gguf("smollm2-135m", progress=False)
    vocab = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    text = smollm2.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert vocab.tokenize(text.encode(), add_bos=False, special=True) == smollm2.encode_prompt(MESSAGES)
    vocab.close()


def test_llama_method_checks_its_context_and_seeds_sampling(llama_cpp, smollm2):
    from specdec.bench.peers import _build_llama_plain
    from specdec.sampling import SamplingParams

    llama_target = LLAMA_CPP.load(_source(smollm2), BenchConfig(progress=False))
    prompt = llama_target.encode_prompt(MESSAGES)
    method = _build_llama_plain(llama_target, {"n_ctx": str(len(prompt) + 4)}, None)
    try:
        room = method.llama.n_ctx() - len(prompt)  # llama.cpp rounds the context up
        with pytest.raises(ValueError, match="n_ctx"):
            method.generate(prompt, room + 1, SamplingParams(0.0))
        sampled = [method.generate(prompt, 4, SamplingParams(1.0, 0, 1.0, seed)).tokens for seed in (3, 3)]
        assert sampled[0] == sampled[1] and 1 <= len(sampled[0]) <= 4
    finally:
        method.close()
    with pytest.raises(ValueError, match="no option 'bogus'"):
        _build_llama_plain(llama_target, {"bogus": "1"}, None)
