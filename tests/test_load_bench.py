"""scripts/load_bench.py: per-configuration gamma and the greedy-output check against plain decoding."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "load_bench.py"


@pytest.fixture(scope="module")
def load_bench():
    spec = importlib.util.spec_from_file_location("load_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_bench"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("load_bench", None)


def test_configs_carry_their_own_gamma(load_bench):
    args = load_bench.parse_args(["--configs", "plain,speculative:8,speculative:auto,speculative", "--gamma", "3"])
    assert [load_bench.config_gamma(c, args.gamma) for c in args.configs] == [None, "8", "auto", "3"]


@pytest.mark.parametrize("configs", ["speculative:0", "plain:4", "speculative:x", "eagle", "plain,plain", ""])
def test_bad_configs_are_refused(load_bench, configs, capsys):
    with pytest.raises(SystemExit):
        load_bench.parse_args(["--configs", configs])
    assert "--configs" in capsys.readouterr().err


def test_mismatches_count_only_requests_with_a_plain_answer(load_bench):
    def result(index, text, error=None):
        return load_bench.RequestResult(0, index, 0.0, None, 1.0, 4, 200, error, text)

    reference = {0: "a b", 1: "c d"}
    results = [result(0, "a b"), result(1, "c e"), result(2, "x"), result(1, "", error="boom")]
    assert load_bench.count_mismatches(results, reference) == (2, 1)


@pytest.mark.slow
def test_speculative_servers_reproduce_plain_answers(load_bench, tmp_path, monkeypatch, smollm2):
    """Two real servers on loopback (plain, then pld at a fixed gamma): every greedy answer is plain's."""
    monkeypatch.setattr(sys, "argv", ["load_bench.py"])
    code = load_bench.main(["--model", "smollm2-135m", "--drafter", "pld", "--configs", "speculative:3,plain",
                            "--concurrency", "2", "--requests-per-user", "2", "--max-tokens", "12",
                            "--out", str(tmp_path)])
    report = json.loads((tmp_path / "load_bench.json").read_text())
    rows = {row["config"]: row for row in report["results"]}
    assert code == 0
    assert rows["speculative:3"]["compared_with_plain"] == 4 and rows["speculative:3"]["differ_from_plain"] == 0
    assert "differ_from_plain" not in rows["plain"]
    assert rows["plain"]["drafted_tokens"] == 0  # the plain server decodes plainly (the server's default is auto)
    texts = [r["text"] for r in report["requests"]]
    assert all(texts) and rows["speculative:3"]["drafted_tokens"] > 0


def test_rounds_alternate_the_order_and_report_means_against_plain(load_bench):
    order = load_bench.run_order(["speculative:auto", "plain", "speculative:4"], 3)
    assert order == [(0, "plain"), (0, "speculative:auto"), (0, "speculative:4"),
                     (1, "speculative:4"), (1, "speculative:auto"), (1, "plain"),
                     (2, "plain"), (2, "speculative:auto"), (2, "speculative:4")]
    rows = [{"config": config, "concurrency": 4, "total_tokens_per_s": value}
            for config, value in [("plain", 30.0), ("speculative:auto", 36.0), ("speculative:auto", 24.0), ("plain", 10.0)]]
    lines = load_bench.round_means(rows)
    assert lines[0].startswith("mean plain") and "20.00 tok/s over 2 rounds (30.00, 10.00)" in lines[0]
    assert "30.00 tok/s over 2 rounds (36.00, 24.00)  1.50x plain" in lines[1]
    with pytest.raises(SystemExit):
        load_bench.parse_args(["--rounds", "0"])
