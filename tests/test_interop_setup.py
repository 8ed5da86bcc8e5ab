"""The parts of the vLLM interop that run without vLLM: the engine registry and its CLI, the
float directory of a model, the vllm-* bench methods' options (tests/test_interop.py drives vLLM)."""

import json

import pytest
from conftest import make_tiny_hf_dir

from specdec.cli import main
from specdec.models.float_dir import float_model_dir, holds_gguf_blocks
from specdec.paths import MARKER_FILE
from specdec.peers.envs import VLLM, installed_python


def test_peers_lists_vllm_and_says_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert main(["peers", "list", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["name"] == "vllm" and row["version"] == "0.32.0" and row["status"] == "not installed"
    assert row["python"] == str(tmp_path / "peers" / "vllm-0.32.0" / "bin" / "python")
    with pytest.raises(ValueError, match="specdec peers install vllm"):
        installed_python("vllm")


def test_an_install_without_its_marker_is_incomplete(tmp_path, monkeypatch):
    """A killed install leaves the venv without the marker: not usable, and `install` redoes it."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    VLLM.python.parent.mkdir(parents=True)
    VLLM.python.write_text("")
    assert VLLM.status() == "incomplete (run install again)" and VLLM.marker() is None
    (VLLM.directory / MARKER_FILE).write_text(json.dumps({"engine": "vllm", "version": "0.31.0"}))
    assert VLLM.marker() is None  # another version's marker
    (VLLM.directory / MARKER_FILE).write_text(json.dumps({"engine": "vllm", "version": VLLM.version}))
    assert VLLM.status() == "installed" and installed_python("vllm") == VLLM.python


def test_peers_install_of_an_unknown_engine_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["peers", "install", "sglang-nope"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_float_dir_of_a_float_model_is_the_model_itself(tmp_path):
    model_dir, _ = make_tiny_hf_dir(tmp_path / "tiny", "llama")
    assert not holds_gguf_blocks(model_dir)
    assert float_model_dir(str(model_dir), progress=False) == model_dir


@pytest.mark.slow
def test_float_dir_of_the_cached_gguf_model_has_no_blocks_and_the_same_config():
    from specdec.models.registry import fetch

    cached = fetch("smollm2-135m", progress=False)
    assert holds_gguf_blocks(cached)
    float_dir = float_model_dir("smollm2-135m", progress=False)
    assert float_dir == cached.with_name(cached.name + "-hf-float") and not holds_gguf_blocks(float_dir)
    assert json.loads((float_dir / "config.json").read_text()) == json.loads((cached / "config.json").read_text())
    assert float_model_dir("smollm2-135m", progress=False) == float_dir  # written once


@pytest.mark.parametrize("method, options, message", [
    ("vllm-eagle3", {}, "needs checkpoint=DIR"),
    ("vllm-ngram", {"bogus": "1"}, "has no option 'bogus'"),
    ("vllm-plain", {"num_speculative_tokens": "3"}, "has no option 'num_speculative_tokens'"),
])
def test_vllm_methods_check_their_options_before_starting_vllm(tmp_path, monkeypatch, method, options, message):
    from specdec.bench.methods import METHODS
    from specdec.bench.runner import BenchConfig

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=message):
        METHODS[method].build(None, options, BenchConfig())
