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


def test_float_dir_of_a_float_model_is_the_model_itself(tmp_path, capsys):
    model_dir, _ = make_tiny_hf_dir(tmp_path / "tiny", "llama")
    assert not holds_gguf_blocks(model_dir)
    assert float_model_dir(str(model_dir), progress=False) == model_dir
    assert main(["peers", "float-dir", str(model_dir)]) == 0 and capsys.readouterr().out.strip() == str(model_dir)
    assert main(["peers", "float-dir", str(tmp_path / "missing")]) == 2
    assert "specdec: error: unknown model" in capsys.readouterr().err


@pytest.mark.slow
def test_float_dir_of_the_cached_gguf_model_has_no_blocks_and_the_same_config():
    from specdec.models.registry import fetch

    cached = fetch("smollm2-135m", progress=False)
    assert holds_gguf_blocks(cached)
    float_dir = float_model_dir("smollm2-135m", progress=False)
    assert float_dir == cached.with_name(cached.name + "-hf-float") and not holds_gguf_blocks(float_dir)
    assert json.loads((float_dir / "config.json").read_text()) == json.loads((cached / "config.json").read_text())
    assert float_model_dir("smollm2-135m", progress=False) == float_dir  # written once


@pytest.mark.slow
def test_float_dir_finds_the_registry_gguf_when_the_recorded_path_is_gone(tmp_path, monkeypatch):
    """The cache outlives the interpreter that installed the GGUF (CI keeps ~/.cache, not .venv, and
    checks out elsewhere): the recorded source path is stale, the registry locates the file again."""
    import shutil

    from specdec.models.registry import fetch, model_cache_dir

    cached = fetch("smollm2-135m", progress=False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    moved = model_cache_dir("smollm2-135m")
    shutil.copytree(cached, moved)
    marker = json.loads((moved / MARKER_FILE).read_text())
    marker["source_gguf"] = str(tmp_path / "an-old-venv" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    (moved / MARKER_FILE).write_text(json.dumps(marker))
    float_dir = float_model_dir("smollm2-135m", progress=False)
    assert float_dir == moved.with_name(moved.name + "-hf-float") and not holds_gguf_blocks(float_dir)
    assert json.loads((float_dir / MARKER_FILE).read_text())["source_sha256"] == marker["source_sha256"]


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


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    from train_support import make_counter_target

    return make_counter_target(tmp_path_factory.mktemp("counter") / "model", seed=0)


@pytest.mark.parametrize("kind, options, tokens", [
    ("eagle3", dict(draft_vocab_size=16), 3),
    ("dflash", dict(block_size=4, num_draft_layers=1), 3),
    ("dspark", dict(block_size=4, num_draft_layers=1, markov_rank=8), 4),
])
def test_speculators_format_wraps_the_layout_and_loads_back(counter, tmp_path, kind, options, tokens):
    """The keys vLLM's SpeculatorsConfig reads (speculators_config.proposal_methods / verifier,
    transformer_layer_config, the per-type fields), and specdec reads its own export back unchanged."""
    import torch

    from specdec.heads.export import (export_dflash, export_dspark, export_eagle3, load_dflash_export,
                                      load_dspark_export, load_eagle3_export, rewrite_as_speculators)
    from specdec.train import build_heads

    torch.manual_seed(0)
    module = build_heads(kind, counter, tokens, **options)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    writers = {"eagle3": (lambda out: export_eagle3(module, out, "float32"), load_eagle3_export),
               "dflash": (lambda out: export_dflash(module, out, "float32"), load_dflash_export),
               "dspark": (lambda out: export_dspark(module, counter, out, "float32"), load_dspark_export)}
    write, load = writers[kind]
    native = json.loads((write(tmp_path / "out") / "config.json").read_text())
    rewrite_as_speculators(tmp_path / "out", tokens, "/models/target", ["LlamaForCausalLM"])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_model_type"] == kind and config["transformer_layer_config"] == native
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == tokens
    assert spec["verifier"] == {"name_or_path": "/models/target", "architectures": ["LlamaForCausalLM"]}
    if kind == "eagle3":
        assert config["draft_vocab_size"] == 16 and config["norm_before_residual"] is False
    else:  # the format counts the embeddings as layer 0: aux ids = our 0-based target blocks + 1
        assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in module.target_layer_ids]
        assert config["mask_token_id"] == module.mask_token_id and config["sample_from_anchor"] == (kind == "dspark")
    loaded = load(tmp_path / "out", counter)
    for name, tensor in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_medusa_has_no_speculators_format(tmp_path, capsys):
    from specdec.heads.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CONFIG_FILE, WEIGHTS_FILE

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / CONFIG_FILE).write_text(json.dumps({"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_VERSION,
                                                      "head": {"kind": "medusa"}, "target": {"name": "x"}}))
    (checkpoint / WEIGHTS_FILE).write_bytes(b"")
    assert main(["export", str(checkpoint), str(tmp_path / "out"), "--format", "speculators"]) == 2
    assert "speculators has no Medusa type" in capsys.readouterr().err and not (tmp_path / "out" / "config.json").exists()


_GET_PERMITTED_FEATURES = ("import ctypes, sys; mask = ctypes.c_uint64(); "
                           "ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask)); sys.stdout.write(str(mask.value))")


def test_every_process_of_the_engine_venv_may_use_amx_tiles(tmp_path, monkeypatch):
    """The install writes the startup line; a fresh interpreter of the venv (as vLLM's spawned engine
    processes are) starts with the AMX tile permission where the CPU has AMX, and cleanly elsewhere;
    a venv installed before the line gets it on use."""
    import dataclasses
    import subprocess

    from specdec.kernels.build import cpu_flags
    from specdec.peers import envs

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    env = dataclasses.replace(envs.VLLM, import_check="import sys")
    monkeypatch.setattr(envs, "_run_step", _skip_pip(envs._run_step))
    monkeypatch.setitem(envs.ENGINES, "vllm", env)
    python = envs.install(env, progress=False)
    assert env.startup_file().read_text() == envs.AMX_PERMISSION_LINE + "\n"
    started = subprocess.run([str(python), "-c", _GET_PERMITTED_FEATURES], capture_output=True, text=True, check=True)
    assert started.stderr == ""  # the line itself never fails a start
    if "amx_tile" in cpu_flags():
        assert int(started.stdout) >> 18 & 1, "XTILEDATA not permitted in the venv's fresh process"
        bare = subprocess.run([str(python), "-S", "-c", _GET_PERMITTED_FEATURES], capture_output=True, text=True)
        assert not int(bare.stdout) >> 18 & 1  # without site (no .pth): not permitted, so the line is what grants it
    env.startup_file().unlink()
    assert envs.installed_python("vllm") == python and env.startup_file().is_file()  # repaired on use


def test_a_failed_install_step_is_one_line_with_pips_error(tmp_path, monkeypatch, capsys):
    """The failing step's own error line (pip's "ERROR: ..."), a user error of the CLI, and no marker."""
    import dataclasses

    from specdec.peers import envs

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    broken = dataclasses.replace(envs.VLLM, import_check="import sys; print('ERROR: vllm does not import'); sys.exit(3)")
    monkeypatch.setattr(envs, "_run_step", _skip_pip(envs._run_step))
    monkeypatch.setitem(envs.ENGINES, "vllm", broken)
    assert main(["peers", "install", "vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "specdec: error: checking that vllm imports failed (exit 3): ERROR: vllm does not import"
    assert broken.marker() is None and broken.status() == "incomplete (run install again)"  # the venv step ran for real


def _skip_pip(run_step):
    """The real step runner, but pip's steps replaced by a no-op command (no network in this test)."""
    import sys

    def run(description, command, progress):
        if "pip" in command:
            command = [sys.executable, "-c", "pass"]
        return run_step(description, command, progress)

    return run


def test_bench_reports_vllm_peers_na_with_how_to_install(tmp_path, monkeypatch):
    """Without the vLLM venv the vllm-* methods are n/a with the install command; the rest still run,
    and vllm-ngram's reference vllm-plain is added to the run."""
    from specdec.bench import BenchConfig, run_benchmark

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    model_dir, _ = make_tiny_hf_dir(tmp_path / "tiny", "llama")
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["abc"]}) + "\n")
    config = BenchConfig(methods=["plain", "vllm-ngram"], target=str(model_dir), questions_path=str(questions),
                         limit_per_kind=1, max_new_tokens=4, out_dir=str(tmp_path / "out"), progress=False, warmup=False)
    result = run_benchmark(config)
    status = {m["label"]: (m["status"], m["reason"]) for m in result.methods}
    assert list(status) == ["plain", "vllm-plain", "vllm-ngram"] and status["plain"][0] == "ok"
    for label in ("vllm-plain", "vllm-ngram"):
        assert status[label][0] == "n/a" and "specdec peers install vllm" in status[label][1]


# lines from a real vLLM 0.32 worker log (head_dim 32, bf16, AMX attention): a warning with a traceback
# comes first, the worker then dies in native code and the engine reports "cancelled"
DEAD_WORKER_LOG = """\
(MainProcess pid=19447) WARNING 12-03 03:18:21 [base.py:380] Chat template warmup failed
(MainProcess pid=19447) WARNING 12-03 03:18:21 [base.py:380] ValueError: Tokenizer not available when `skip_tokenizer_init=True`
(EngineCore pid=19459) ERROR 12-03 03:18:21 [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.
(EngineCore pid=19459) ERROR 12-03 03:18:21 [core.py:1512] EngineCore encountered a fatal error.
(EngineCore pid=19459) ERROR 12-03 03:18:21 [core.py:1512] RuntimeError: cancelled
"""
FAILED_START_LOG = """\
(EngineCore pid=7) WARNING 12-03 03:18:21 [cpu.py:224] Triton is not installed. triton-cpu is expected on x86 CPUs.
(EngineCore pid=7) ERROR 12-03 03:18:22 [core.py:900] ValueError: head_size 24 is not supported by CPU_ATTN
RuntimeError: Engine core initialization failed. See root cause above.
"""

# a real vLLM 0.32 log (Qwen2.5-Coder-1.5B, bf16, its default max_model_len): the worker raises, then the
# engine reports the worker's death; the exception is the cause
KV_CACHE_LOG = """\
(EngineCore pid=15519) ERROR 12-03 12:10:30 [core.py:1510]     raise ValueError(
(EngineCore pid=15519) ERROR 12-03 12:10:30 [core.py:1510] ValueError: To serve at least one request with the model's max seq len (32768), (0.88 GiB KV cache is needed, which is larger than the available KV cache memory (0.87 GiB).
(EngineCore pid=15519) ERROR 12-03 12:10:33 [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit code: 0), shutting down executor.
"""


@pytest.mark.parametrize("log, cause", [
    (DEAD_WORKER_LOG, "Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor."),
    (KV_CACHE_LOG, "ValueError: To serve at least one request with the model's max seq len (32768), (0.88 GiB KV cache "
                   "is needed, which is larger than the available KV cache memory (0.87 GiB)."),
    (FAILED_START_LOG, "ValueError: head_size 24 is not supported by CPU_ATTN"),
    ("", "no output"),
])
def test_a_vllm_failure_is_named_by_its_root_cause_not_a_warning(log, cause):
    from specdec.peers.vllm_client import root_cause

    assert root_cause(log) == cause
