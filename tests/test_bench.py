"""`specdec bench`: question selection, summary math, a real SmolLM2 run, and a planted mismatch."""

import argparse
import importlib.util
import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from specdec import generate
from specdec.bench import BenchConfig, register_method, run_benchmark, unregister_method
from specdec.bench.questions import (
    MULTI_TURN,
    TASK_KINDS,
    default_questions_path,
    load_questions,
    select_questions,
)
from specdec.bench.environment import KERNEL_CPU_FEATURES, bench_command, describe_machine
from specdec.bench.report import PLOT_FILES, method_summary_rows
from specdec.bench.cli import add_bench_arguments, config_from_args
from specdec.bench.runner import MethodSpec

QUESTIONS = default_questions_path()  # package data: always there
RESULTS_PAGE = Path(__file__).resolve().parents[1] / "scripts" / "results_page.py"


def _write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def _drafter_name() -> str:
    from specdec.drafters import registered_drafters

    return "pld" if "pld" in registered_drafters() else "random"


# ---------------------------------------------------------------------------- no model needed


def test_method_spec_parsing():
    spec = MethodSpec.parse("small-model:draft_model=qwen2.5-coder-0.5b:gamma=3")
    assert (spec.name, spec.options, spec.label) == ("small-model", {"draft_model": "qwen2.5-coder-0.5b", "gamma": "3"},
                                                     "small-model:draft_model=qwen2.5-coder-0.5b:gamma=3")
    assert MethodSpec.parse("pld").options == {}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        MethodSpec.parse("pld:max_ngram")


def test_questions_grouped_by_kind_round_robin(tmp_path):
    records = [{"question_id": i, "category": c, "turns": [f"q{i}", f"follow-up {i}"]}
               for i, c in enumerate(["writing", "writing", "roleplay", "math", "coding"])]
    records += [{"question_id": 100 + i, "category": "qa", "turns": [f"qa {i}"]} for i in range(4)]
    questions = load_questions(_write_jsonl(tmp_path / "q.jsonl", records))
    picked = select_questions(questions, limit_per_kind=3)
    # multi-turn: one of each category first (writing, roleplay, math), then qa in file order
    assert [q.question_id for q in picked] == [0, 2, 3, 100, 101, 102]
    assert {q.task_kind for q in picked} == {MULTI_TURN, "qa"}
    assert [q.question_id for q in select_questions(questions, None, ["qa"])] == [100, 101, 102, 103]
    with pytest.raises(ValueError, match="unknown task kind"):
        select_questions(questions, 1, ["poetry"])
    with pytest.raises(ValueError, match=">= 1"):
        select_questions(questions, 0)


def test_load_questions_rejects_bad_lines(tmp_path):
    with pytest.raises(ValueError, match="unknown category"):
        load_questions(_write_jsonl(tmp_path / "a.jsonl", [{"question_id": 1, "category": "poems", "turns": ["x"]}]))
    with pytest.raises(ValueError, match="missing"):
        load_questions(_write_jsonl(tmp_path / "b.jsonl", [{"question_id": 1, "turns": ["x"]}]))
    with pytest.raises(FileNotFoundError, match="--questions"):
        load_questions(tmp_path / "none.jsonl")


def test_default_questions_cover_every_kind():
    picked = select_questions(load_questions(QUESTIONS), limit_per_kind=3)
    assert [q.task_kind for q in picked] == [kind for kind in TASK_KINDS for _ in range(3)]
    assert all(len(q.turns) == 2 for q in picked if q.task_kind == MULTI_TURN)


def _row(method, qid, kind, turn, tokens, seconds, steps=None, stats=None):
    return dict(method=method, question_id=qid, task_kind=kind, turn=turn, num_tokens=tokens, seconds=seconds,
                tau_steps=steps, tau_tokens=tokens if steps else None, stats=stats, matches_plain=True)


def test_summary_speedup_is_mean_tokens_per_second_ratio():
    rows = [
        _row("plain", 1, "qa", 1, 10, 1.0, 10), _row("plain", 2, "qa", 1, 10, 2.0, 10),  # 10 and 5 tok/s
        _row("plain", 3, "rag", 1, 8, 1.0, 8),
        _row("fast", 1, "qa", 1, 10, 0.5, 4), _row("fast", 2, "qa", 1, 10, 0.5, 6),  # 20 and 20 tok/s
        _row("fast", 3, "rag", 1, 8, 2.0, 8),
    ]
    methods = [dict(label=m, status="ok", reason=None, exact=True, peer=False, description="") for m in ("plain", "fast")]
    methods.append(dict(label="gone", status="n/a", reason="no draft model", exact=True, peer=False, description=""))
    summary = method_summary_rows(rows, methods, ["qa", "rag"])
    fast = summary["methods"]["fast"]
    assert fast["per_kind"]["qa"]["speedup"] == pytest.approx(20 / 7.5)
    assert fast["per_kind"]["qa"]["tau"] == pytest.approx(20 / 10)  # pooled: tokens / steps
    assert fast["per_kind"]["rag"]["speedup"] == pytest.approx(0.5)
    assert fast["overall"]["speedup"] == pytest.approx(((20 + 20 + 4) / 3) / ((10 + 5 + 8) / 3))
    assert summary["methods"]["plain"]["overall"]["speedup"] == pytest.approx(1.0)
    assert summary["methods"]["gone"]["status"] == "n/a" and "per_kind" not in summary["methods"]["gone"]


def test_summary_reports_the_draft_sizes_that_were_verified():
    from specdec.bench.report import markdown_table
    from specdec.stats import SpecStats

    chain, tree, plain = SpecStats(), SpecStats(), SpecStats()
    for drafted, accepted in ((4, 2), (0, 0), (4, 4)):  # a chain of 4, a plain step the cost model chose, a chain of 4
        chain.record_step(drafted, accepted)
    for _ in range(2):  # a 10-node tree of depth 4
        tree.record_step(10, 3, max_depth=4)
    for _ in range(5):
        plain.record_step(0, 0)
    rows = [_row("plain", 1, "qa", 1, 5, 1.0, 5, plain.to_dict()), _row("plain", 2, "rag", 1, 5, 1.0, 5, plain.to_dict()),
            _row("spec", 1, "qa", 1, 9, 1.0, 3, chain.to_dict()), _row("spec", 2, "rag", 1, 8, 1.0, 2, tree.to_dict())]
    methods = [dict(label=m, status="ok", reason=None, exact=True, peer=False, description="") for m in ("plain", "spec")]
    summary = method_summary_rows(rows, methods, ["qa", "rag"])
    spec = summary["methods"]["spec"]
    assert spec["per_kind"]["qa"]["nodes_per_drafting_step"] == pytest.approx(4.0)
    assert spec["per_kind"]["qa"]["drafting_share"] == pytest.approx(2 / 3)
    assert spec["per_kind"]["rag"]["nodes_per_drafting_step"] == pytest.approx(10.0)
    assert spec["per_kind"]["rag"]["depth_per_drafting_step"] == pytest.approx(4.0)
    assert spec["overall"]["nodes_per_drafting_step"] == pytest.approx(28 / 4)
    assert spec["overall"]["drafting_share"] == pytest.approx(4 / 5)
    assert summary["methods"]["plain"]["overall"]["drafting_share"] == 0.0
    markdown = markdown_table(summary, {"limit_per_kind": 1, "gamma": "auto"})
    assert "| spec | 4.0 / 4.0 (67 %) | 10.0 / 4.0 (100 %) | 7.0 / 4.0 (80 %) |" in markdown
    assert "| plain | 0" not in markdown  # a method that never drafted has no row


def test_summary_reports_which_source_drafted_what():
    from specdec.bench.report import markdown_table
    from specdec.stats import SpecStats

    first, second = SpecStats(), SpecStats()
    first.record_step(3, 2, max_depth=2)
    first.record_sources(("suffix", "suffix", "small-model"), [0, 1])
    second.record_step(2, 1)
    second.record_sources(("small-model", "small-model"), [0])
    rows = [_row("plain", 1, "qa", 1, 5, 1.0, 5), _row("hybrid", 1, "qa", 1, 3, 1.0, 1, first.to_dict()),
            _row("hybrid", 2, "rag", 1, 2, 1.0, 1, second.to_dict())]
    methods = [dict(label=m, status="ok", reason=None, exact=True, peer=False, description="") for m in ("plain", "hybrid")]
    summary = method_summary_rows(rows, methods, ["qa", "rag"])
    hybrid = summary["methods"]["hybrid"]
    assert hybrid["overall"]["by_source"] == {"small-model": [1, 3], "suffix": [2, 2]}
    assert summary["methods"]["plain"]["overall"]["by_source"] == {}
    markdown = markdown_table(summary, {"limit_per_kind": 1, "gamma": "auto"})
    assert "| hybrid | small-model 0/1, suffix 2/2 | small-model 1/2 | small-model 1/3, suffix 2/2 |" in markdown


def _config_of_command(command: str) -> BenchConfig:
    words = shlex.split(command)
    start = words.index("specdec")
    assert words[start + 1] == "bench", command
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return config_from_args(parser.parse_args(words[start + 2:]))


@pytest.mark.parametrize("config", [
    BenchConfig(),
    BenchConfig(methods=["plain", "pld:max_ngram=3", "hf-plain"], target="/models/my dir", draft_model="qwen2.5-coder-0.5b",
                task_kinds=["qa", "rag"], limit_per_kind=None, max_new_tokens=32, gamma=5, temperature=0.7, top_k=40,
                top_p=0.9, seed=3, dtype="bfloat16", weights="gguf-a8", out_dir="docs/results/x", warmup=False, repeats=3),
    BenchConfig(limit_per_kind=1, gamma="auto", questions_path="/data/q s.jsonl"),
])
def test_bench_command_reproduces_the_config(config, monkeypatch):
    for key in [k for k in os.environ if k.startswith("SPECDEC_")]:
        monkeypatch.delenv(key)
    command = bench_command(config)
    assert command.startswith("specdec bench --methods ")
    assert _config_of_command(command) == config  # progress is display only and stays at its default here
    monkeypatch.setenv("SPECDEC_KERNEL_ISA", "avx2")  # kernel settings change what is measured: they lead the command
    monkeypatch.setenv("SPECDEC_CACHE", "/tmp/elsewhere")  # where files are kept does not
    assert bench_command(config).startswith("SPECDEC_KERNEL_ISA=avx2 specdec bench ")


def test_machine_named_by_the_kernel_s_cpu_features():
    base = {"cpu": "AMD EPYC", "threads": 2}
    assert describe_machine({**base, "cpu_features": ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"]}) == \
        "AMD EPYC, AVX-512 VNNI/BF16, no AMX, 2 threads"
    assert describe_machine({**base, "cpu_features": ["avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"]}) == \
        "AMD EPYC, AVX-512 VNNI, AMX, 2 threads"
    assert describe_machine({**base, "cpu_features": ["avx2", "fma", "f16c"]}) == "AMD EPYC, AVX2, no AMX, 2 threads"
    # the kernel's own settings: tiles off, an AVX2 build on an AVX-512 CPU
    amx_cpu = {**base, "cpu_features": ["avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"]}
    assert describe_machine({**amx_cpu, "kernel_isa": "avx512", "kernel_amx": False}) == \
        "AMD EPYC, AVX-512 VNNI, AMX off (SPECDEC_KERNEL_AMX=0), 2 threads"
    assert describe_machine({**amx_cpu, "kernel_isa": "avx2", "kernel_amx": False}) == \
        "AMD EPYC, AVX-512 VNNI (kernel built for AVX2: SPECDEC_KERNEL_ISA=avx2), AMX unused, 2 threads"
    assert describe_machine({**amx_cpu, "kernel_isa": "avx2-vnni", "kernel_amx": False}) == \
        "AMD EPYC, AVX-512 VNNI (kernel built for AVX2 + AVX-VNNI: SPECDEC_KERNEL_ISA=avx2-vnni), AMX unused, 2 threads"
    # an AVX2 laptop with AVX-VNNI (Intel since Alder Lake)
    assert describe_machine({**base, "cpu": "Intel Core", "cpu_features": ["avx2", "fma", "f16c", "avx_vnni"]}) == \
        "Intel Core, AVX2 + AVX-VNNI, no AMX, 2 threads"


def test_machine_record_names_the_kernel_s_build_and_amx(monkeypatch):
    from specdec.bench.environment import machine_record
    from specdec.kernels.library import KernelUnavailable, load_library

    try:
        kernel = load_library()
    except KernelUnavailable as exc:
        pytest.skip(f"no kernel here: {exc}")
    record = machine_record("cpp")
    assert (record["kernel_isa"], record["kernel_amx"]) == (kernel.isa, kernel.amx)
    assert machine_record("torch")["kernel_isa"] is None


def test_unknown_method_fails_before_loading_anything(capsys):
    from specdec.cli import main

    assert main(["bench", "--methods", "plain,no-such-method", "--target", "/nonexistent"]) == 2
    assert "unknown method 'no-such-method'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_bench(smollm2, tmp_path_factory):
    """One real tiny bench run (one question per task kind, 16 tokens) in <tmp>/smollm2-tiny, the way
    `specdec bench --out docs/results/NAME` leaves a run: (its config, its folder)."""
    out_dir = tmp_path_factory.mktemp("results") / "smollm2-tiny"
    methods = ["plain", _drafter_name(), f"{_drafter_name()}:gamma=1", "hf-plain", "hf-assisted", "small-model"]
    config = BenchConfig(methods=methods, limit_per_kind=1, max_new_tokens=16, gamma=4, out_dir=str(out_dir),
                         progress=False, warmup=False)  # the warm-up path runs in the planted-mismatch test
    result = run_benchmark(config, target=smollm2)
    assert result.exit_code == 0, result.mismatches
    return config, out_dir


def test_bench_smollm2_every_kind(smollm2, smollm2_bench):
    config, out_dir = smollm2_bench
    drafter, methods = config.methods[1], config.methods

    data = json.loads((out_dir / "results.json").read_text())
    questions = select_questions(load_questions(QUESTIONS), 1)
    expected = {(q.question_id, turn) for q in questions for turn in range(1, len(q.turns) + 1)}
    assert len(expected) == len(TASK_KINDS) + 1  # the multi-turn question has two turns
    rows = {m: {(r["question_id"], r["turn"]): r for r in data["rows"] if r["method"] == m} for m in methods}
    for method in ("plain", drafter, "hf-plain"):
        assert set(rows[method]) == expected, method
        for row in rows[method].values():
            assert row["num_tokens"] >= 1 and row["seconds"] > 0 and row["tokens_per_s"] > 0
    # lossless: the drafter's tokens are plain's, question by question and turn by turn
    for key, row in rows[drafter].items():
        assert row["tokens"] == rows["plain"][key]["tokens"] and row["matches_plain"] is True
    # the same drafter at its own fixed length (gamma=1 beside the run's 4): as exact, one token per draft
    fixed = f"{drafter}:gamma=1"
    for key, row in rows[fixed].items():
        assert row["tokens"] == rows["plain"][key]["tokens"] and row["matches_plain"] is True
    assert all(row["stats"]["drafted_tokens"] <= row["stats"]["steps"] for row in rows[fixed].values())
    # turn 2 of the multi-turn question is asked after the model's own turn-1 answer
    multi = next(q for q in questions if q.task_kind == MULTI_TURN).question_id
    first, second = rows["plain"][(multi, 1)], rows["plain"][(multi, 2)]
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["num_tokens"] - 2

    summary = data["summary"]["methods"]
    assert summary["plain"]["overall"]["speedup"] == pytest.approx(1.0)
    assert summary["plain"]["overall"]["tau"] == pytest.approx(1.0)
    assert summary[drafter]["overall"]["tau"] >= 1.0
    assert summary["hf-plain"]["overall"]["tau"] == pytest.approx(1.0)  # one token per forward
    assert set(summary[drafter]["per_kind"]) == set(TASK_KINDS)
    for unavailable in ("hf-assisted", "small-model"):  # SmolLM2 has no same-tokenizer draft model
        assert summary[unavailable]["status"] == "n/a" and "draft model" in summary[unavailable]["reason"]

    markdown = (out_dir / "results.md").read_text()
    assert "| method | Multi-turn Conversation |" in markdown and f"| {drafter} |" in markdown
    assert "n/a: no draft model" in markdown
    for name in PLOT_FILES:
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    # what the results page needs: the command that reproduces the run, and the machine
    recorded = data["config"]
    assert replace(_config_of_command(recorded["command"]), progress=False) == config  # progress: display only
    assert recorded["cpu"] and recorded["threads"] >= 1 and recorded["linear_backend"] == smollm2.linear_backend
    with open("/proc/cpuinfo") as cpuinfo:
        flags = set(next(line for line in cpuinfo if line.startswith("flags")).split(":", 1)[1].split())
    assert set(recorded["cpu_features"]) == flags & set(KERNEL_CPU_FEATURES)


@pytest.fixture(scope="module")
def results_page():
    spec = importlib.util.spec_from_file_location("results_page", RESULTS_PAGE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["results_page"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("results_page", None)


def test_results_page_from_a_real_run(smollm2_bench, results_page, tmp_path, capsys):
    config, run_dir = smollm2_bench
    page_path = tmp_path / "docs" / "results.md"
    page_path.parent.mkdir()
    assert results_page.main(["--results", str(run_dir.parent), "--out", str(page_path)]) == 0
    page = page_path.read_text()
    data = json.loads((run_dir / "results.json").read_text())
    recorded, summary = data["config"], data["summary"]["methods"]
    assert f"Machine: {describe_machine(recorded)};" in page
    assert f"\n{recorded['command']}\n" in page  # the reproducing command, in a code block
    drafter = config.methods[1]
    for label in ("plain", drafter, "hf-plain"):  # each method's row: tokens/s and overall speedup with tau
        overall = summary[label]["overall"]
        row = next(line for line in page.splitlines() if line.startswith(f"| {label} |"))
        assert f"| {overall['tokens_per_s']:.2f} |" in row, row
        assert f"{overall['speedup']:.2f}x (τ {overall['tau']:.2f})" in row, row
    checked = summary[drafter]["checked"]
    assert checked == 7 and f"= plain ({checked} outputs)" in page  # the lossless check, every turn
    assert "n/a: no draft model" in page
    image = next(line for line in page.splitlines() if line.startswith("![speedup"))
    assert (page_path.parent / image[image.index("(") + 1:-1]).resolve() == (run_dir / "speedup.png").resolve()
    assert len(page.splitlines()) < 300
    (run_dir.parent / "broken").mkdir()
    (run_dir.parent / "broken" / "results.json").write_text("{not json")
    try:
        assert results_page.main(["--results", str(run_dir.parent), "--out", str(tmp_path / "other.md")]) == 2
    finally:
        (run_dir.parent / "broken" / "results.json").unlink()
    assert "specdec: error:" in capsys.readouterr().err and not (tmp_path / "other.md").exists()
    (tmp_path / "no-runs").mkdir()  # a folder without runs never replaces the page with one without numbers
    assert results_page.main(["--results", str(tmp_path / "no-runs"), "--out", str(page_path)]) == 2
    assert "no runs in" in capsys.readouterr().err and page_path.read_text() == page


def test_planted_mismatch_fails_the_run(smollm2, tmp_path, capsys):
    def lossy(target, prompt_ids, max_new_tokens, sampling):
        generation = generate(target, prompt_ids, None, max_new_tokens, sampling)
        tokens = list(generation.tokens)
        changed = min(3, len(tokens) - 1)
        tokens[changed] = (tokens[changed] + 1) % target.vocab_size
        return tokens, generation.stats

    register_method("lossy-test", lossy)
    try:
        config = BenchConfig(methods=["plain", "lossy-test"], task_kinds=["qa"], limit_per_kind=1, max_new_tokens=8,
                             out_dir=str(tmp_path), progress=False, warmup=True)
        result = run_benchmark(config, target=smollm2)
    finally:
        unregister_method("lossy-test")
    assert result.exit_code == 1
    question = select_questions(load_questions(QUESTIONS), 1, ["qa"])[0]
    plain_tokens = next(r["tokens"] for r in result.rows if r["method"] == "plain")
    position = min(3, len(plain_tokens) - 1)
    err = capsys.readouterr().err
    assert f"MISMATCH: method 'lossy-test' question {question.question_id} (qa) turn 1" in err
    assert f"first difference at output position {position}" in err
    data = json.loads((tmp_path / "results.json").read_text())  # results are written before failing
    assert data["mismatches"] == [dict(method="lossy-test", reference="plain", question_id=question.question_id, turn=1,
                                       position=position, plain=plain_tokens[position],
                                       got=(plain_tokens[position] + 1) % smollm2.vocab_size, exact=True)]
    assert "FAIL" in (tmp_path / "results.md").read_text()


def test_repeats_alternate_the_order_and_check_every_round(smollm2, tmp_path, capsys):
    """--repeats 3: rounds in order, reversed, in order; a row's seconds = the median of its rounds;
    an output that changes in a later round (here only the third) fails the run like any mismatch."""
    calls = []

    def plain_logged(target, prompt_ids, max_new_tokens, sampling):
        calls.append("plain-logged")
        return generate(target, prompt_ids, None, max_new_tokens, sampling).tokens, None

    def lossy_third(target, prompt_ids, max_new_tokens, sampling):
        calls.append("lossy-third")
        tokens = list(generate(target, prompt_ids, None, max_new_tokens, sampling).tokens)
        if calls.count("lossy-third") == 3:
            tokens[-1] = (tokens[-1] + 1) % target.vocab_size
        return tokens, None

    register_method("plain-logged", plain_logged)
    register_method("lossy-third", lossy_third)
    try:
        config = BenchConfig(methods=["plain", "plain-logged", "lossy-third"], task_kinds=["qa"], limit_per_kind=1,
                             max_new_tokens=4, out_dir=str(tmp_path), progress=False, warmup=False, repeats=3)
        result = run_benchmark(config, target=smollm2)
    finally:
        unregister_method("plain-logged")
        unregister_method("lossy-third")
    assert calls == ["plain-logged", "lossy-third", "lossy-third", "plain-logged", "plain-logged", "lossy-third"]
    assert result.exit_code == 1
    plain_tokens = next(r["tokens"] for r in result.rows if r["method"] == "plain")
    assert [(m["method"], m["position"]) for m in result.mismatches] == [("lossy-third", len(plain_tokens) - 1)]
    assert "MISMATCH: method 'lossy-third'" in capsys.readouterr().err
    for row in result.rows:
        assert len(row["seconds_per_round"]) == 3 and row["seconds"] == sorted(row["seconds_per_round"])[1]
        assert row["matches_plain"]  # the first round's output is the row's
    page = (tmp_path / "results.md").read_text()
    assert "median of 3 rounds" in page and "slowest / fastest round" in page
    spread = result.summary["methods"]["plain-logged"]["overall"]["round_spread"]
    turns = [r for r in result.rows if r["method"] == "plain-logged"]
    assert spread == max(turns[0]["seconds_per_round"]) / min(turns[0]["seconds_per_round"]) >= 1.0


def test_every_round_runs_a_fresh_method(smollm2, tmp_path):
    """A method that remembers the prompts it answered (as suffix decoding's tree remembers answers)
    answers a prompt it has seen differently: with --repeats every round runs a fresh instance, so
    no round sees the question twice and every round matches plain."""
    from specdec.bench import CallableMethod, register_method_factory

    built = []

    def answer(target, prompt_ids, max_new_tokens, sampling):
        return generate(target, prompt_ids, None, max_new_tokens, sampling).tokens, None

    class Remembering(CallableMethod):
        def __init__(self, target):
            super().__init__(answer, target, True, "remembers its prompts")
            self.seen = set()
            built.append(self)

        def generate(self, prompt_ids, max_new_tokens, sampling):
            output = super().generate(prompt_ids, max_new_tokens, sampling)
            if tuple(prompt_ids) in self.seen:  # planted: a repeat within one instance changes the answer
                output.tokens[-1] = (output.tokens[-1] + 1) % smollm2.vocab_size
            self.seen.add(tuple(prompt_ids))
            return output

    register_method_factory("remembering-test", lambda target, options, config: Remembering(target))
    try:
        config = BenchConfig(methods=["plain", "remembering-test"], task_kinds=["qa"], limit_per_kind=1,
                             max_new_tokens=4, out_dir=str(tmp_path), progress=False, warmup=False, repeats=3)
        result = run_benchmark(config, target=smollm2)
        assert result.exit_code == 0 and not result.mismatches
        assert len(built) == 1 + 3  # the first build, then one per round
        # the plant bites: one instance asked the same question twice answers differently
        remembering, prompt = Remembering(smollm2), result.rows[0]["tokens"][:3] or [1]
        first, second = (remembering.generate(prompt, 4, config.sampling()) for _ in range(2))
        assert first.tokens != second.tokens
    finally:
        unregister_method("remembering-test")


def test_a_method_that_raises_is_reported_and_fails_the_run(smollm2, tmp_path):
    def broken(target, prompt_ids, max_new_tokens, sampling):
        raise RuntimeError("planted failure")

    register_method("broken-test", broken)
    try:
        config = BenchConfig(methods=["plain", "broken-test"], task_kinds=["qa"], limit_per_kind=1, max_new_tokens=4,
                             out_dir=str(tmp_path), progress=False, warmup=False)
        result = run_benchmark(config, target=smollm2)
    finally:
        unregister_method("broken-test")
    assert result.exit_code == 1
    status = {m["label"]: (m["status"], m["reason"]) for m in result.methods}
    assert status == {"plain": ("ok", None), "broken-test": ("error", "RuntimeError: planted failure")}
    assert "error: RuntimeError: planted failure" in (tmp_path / "results.md").read_text()
