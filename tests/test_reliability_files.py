"""Nothing of the user's is overwritten and every bad input is one line (issue 28): output
directories that are not specdec's, `--out` that is a file, text that is not Unicode, truncated
checkpoints, a cache that cannot be written, files that follow the umask, and a prompt supply that
never builds its whole list."""

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from specdec import generate
from specdec.cli import main
from specdec.cost import get_or_measure
from specdec.heads import build_heads, load_checkpoint, save_checkpoint, target_description
from specdec.heads.export import export_eagle3
from specdec.models import registry
from specdec.models.registry import ModelSpec
from specdec.train.data import DataSettings, build_dataset, load_samples
from specdec.train.prompts import PromptSupply

from test_registry import LocalParts, tiny_gguf  # noqa: F401  (tiny_gguf: a fixture)
from train_support import text_prompts

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda _: None  # noqa: E731


@pytest.fixture(scope="module")
def eagle3_checkpoint(counter, tmp_path_factory):
    """An (untrained) EAGLE-3 checkpoint for the counter, written by specdec."""
    directory = tmp_path_factory.mktemp("eagle3") / "ckpt"
    save_checkpoint(directory, build_heads("eagle3", counter, 2, draft_vocab_size=16), target_description(counter))
    return directory


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


def _error(lines: list[str]) -> str:
    errors = [line for line in lines if line.startswith("specdec: error:")]
    assert len(errors) == 1 and not any("Traceback" in line for line in lines), lines
    return errors[0]


def _users_model_dir(path: Path) -> dict[str, bytes]:
    """A directory holding the user's own HF model files; returns their bytes."""
    path.mkdir(parents=True)
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"the user's weights", "notes.txt": b"mine"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def _unchanged(path: Path, files: dict[str, bytes]) -> bool:
    return sorted(p.name for p in path.iterdir()) == sorted(files) and all(
        (path / name).read_bytes() == data for name, data in files.items())


# ---------------------------------------------------------------------------- 1. a directory that is not ours
def test_a_directory_that_is_not_specdecs_is_refused_by_every_writer_even_with_overwrite(tmp_path, capsys):
    user = tmp_path / "user-model"
    files = _users_model_dir(user)
    model = "no-such-model"  # a model load would fail on the name before any write: the check comes first
    commands = {
        "a specdec checkpoint": ["train", "medusa", "--model", model, "--data", str(tmp_path), "--out", str(user), "--overwrite"],
        "specdec training data": ["train", "data", "--model", model, "--out", str(user)],
        "a drafter export written by specdec": ["export", str(tmp_path), str(user), "--model", model, "--overwrite"],
        "specdec bench results": ["bench", "--target", model, "--out", str(user)],
        "a specdec datastore": ["datastore", "build", str(tmp_path), "-o", str(user), "--model", model],
    }
    for what, argv in commands.items():
        code, lines = _cli(capsys, *argv)
        assert code == 2 and _error(lines).endswith(f"{user} is not {what}; choose an empty or new directory"), argv
    assert _unchanged(user, files)


def test_python_writers_refuse_it_too_and_write_again_only_into_their_own(counter, tmp_path):
    user = tmp_path / "user-model"
    files = _users_model_dir(user)
    heads = build_heads("eagle3", counter, 2, draft_vocab_size=16)
    with pytest.raises(ValueError, match="is not a specdec checkpoint"):
        save_checkpoint(user, heads, target_description(counter))
    with pytest.raises(ValueError, match="is not a drafter export written by specdec"):
        export_eagle3(heads, user)
    with pytest.raises(ValueError, match="is not specdec training data"):
        build_dataset(counter, user, DataSettings(num_prompts=2, max_new_tokens=2), prompts=text_prompts(2, 0),
                      progress=False, log=QUIET)
    assert _unchanged(user, files)
    # a new path and an empty directory are fine; specdec's own directory is written again,
    # and a file the user put into it is left alone
    empty = tmp_path / "empty"
    empty.mkdir()
    for directory in (tmp_path / "new" / "ckpt", empty):
        save_checkpoint(directory, heads, target_description(counter))
        (directory / "my-notes.txt").write_text("keep")
        save_checkpoint(directory, heads, target_description(counter))
        assert (directory / "my-notes.txt").read_text() == "keep" and load_checkpoint(directory, counter)[1]["drafter"] == "eagle3"
    with pytest.raises(ValueError, match="holds a specdec checkpoint, not specdec training data"):
        build_dataset(counter, empty, DataSettings(num_prompts=2, max_new_tokens=2), prompts=text_prompts(2, 0),
                      progress=False, log=QUIET)


# ---------------------------------------------------------------------------- 6. --out that is a file
def test_out_that_is_a_file_is_one_line_before_anything_loads(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for argv in (["train", "data", "--out", str(afile)], ["bench", "--target", "no-such-model", "--out", str(afile)],
                 ["train", "dspark", "--data", str(tmp_path), "--out", str(afile)], ["export", str(tmp_path), str(afile)]):
        model = ["--model", "no-such-model"] if argv[0] == "train" or argv[0] == "export" else []
        code, lines = _cli(capsys, *argv, *model)  # a model load would fail on the name first
        flag = "OUT_DIR" if argv[0] == "export" else "--out"
        assert code == 2 and _error(lines).endswith(f"{flag} {afile} is a file, not a directory"), argv
    code, lines = _cli(capsys, "train", "data", "--model", "no-such-model", "--out", str(afile / "data"))
    assert code == 2 and _error(lines).endswith(f"--out {afile / 'data'}: {afile} is a file, not a directory")
    assert afile.read_text() == "mine"


# ---------------------------------------------------------------------------- 4. text that is not Unicode
def test_bytes_that_are_not_utf8_in_argv_are_the_servers_unicode_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", b"abc\xff\xfe\x80def", "--model", "no-such-model"],
                            capture_output=True, text=True, cwd=REPO, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"})
    assert result.returncode == 2, result.stderr
    assert _error(result.stderr.strip().splitlines()) == (
        "specdec: error: prompt is not valid Unicode: a lone surrogate (U+DCFF) at character 3")


def test_a_lone_surrogate_in_the_api_is_the_same_error(counter):
    for prompt in ("ab\ud800c", [{"role": "user", "content": "ab\ud800c"}]):
        with pytest.raises(ValueError, match=r"^prompt is not valid Unicode: a lone surrogate \(U\+D800\) at character 2$"):
            generate(counter, prompt, max_new_tokens=2)


# ---------------------------------------------------------------------------- 5. truncated or corrupt checkpoints
def _damage(weights: Path, how: str) -> None:
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) * 4 // 10] if how == "truncated" else data[:8] + b"#" * 24 + data[32:])


@pytest.mark.parametrize("how", ["truncated", "header"])
def test_a_damaged_checkpoint_names_its_file_for_every_reader(counter, eagle3_checkpoint, tmp_path, capsys, how):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(eagle3_checkpoint, checkpoint)
    weights = checkpoint / "model.safetensors"
    _damage(weights, how)
    expected = f"{weights} is truncated or corrupt"
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_checkpoint(checkpoint, counter)
    config = checkpoint / "config.json"
    text = config.read_text()
    config.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=f"^{config} is truncated or corrupt"):
        load_checkpoint(checkpoint, counter)
    config.write_text(text)
    code, lines = _cli(capsys, "export", str(checkpoint), str(tmp_path / "export"))
    assert code == 2 and expected in _error(lines)
    code, lines = _cli(capsys, "generate", "!#%'", "--model", str(counter.model_dir), "--drafter", "eagle3",
                       "--drafter-arg", f"checkpoint={checkpoint}", "--max-new-tokens", "4")
    assert code == 2 and expected in _error(lines)
    assert not (tmp_path / "export").exists()


def test_a_truncated_data_shard_names_its_file(counter, tmp_path):
    data = tmp_path / "data"
    build_dataset(counter, data, DataSettings(num_prompts=2, max_new_tokens=4, shard_size=2, sampled_fraction=0.0),
                  prompts=text_prompts(2, 0), progress=False, log=QUIET)
    _damage(data / "shard-00000.safetensors", "truncated")
    with pytest.raises(ValueError, match="shard-00000.safetensors is truncated or corrupt"):
        load_samples(data, [counter.num_layers], counter)


# ---------------------------------------------------------------------------- 3. a cache that cannot be written
@pytest.fixture()
def unwritable_cache(tmp_path, monkeypatch):
    """SPECDEC_CACHE at a directory no write into succeeds: read-only (chmod) for an ordinary user;
    as root, whom chmod does not stop, a path below a regular file (every mkdir fails, ENOTDIR)."""
    if os.geteuid() == 0:
        (tmp_path / "afile").write_text("")
        root = tmp_path / "afile" / "cache"
    else:
        root = tmp_path / "cache"
        root.mkdir()
        root.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    yield root
    if root.is_dir():
        root.chmod(stat.S_IRWXU)


def test_the_cost_table_is_used_in_memory_with_one_warning(counter, unwritable_cache, capsys):
    first = get_or_measure(counter, ks=(1, 2), repeats=1, progress=False)
    again = get_or_measure(counter, ks=(1, 2), repeats=1, progress=False)  # measured once per process
    assert again is first and first.k == [1, 2]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: cannot save the step-cost table to "), warnings
    assert str(unwritable_cache) in warnings[0] and "SPECDEC_CACHE" in warnings[0]
    code, lines = _cli(capsys, "generate", "!#%'", "--model", str(counter.model_dir), "--drafter", "pld", "--max-new-tokens", "4")
    assert code == 0 and not any(line.startswith("specdec: error") for line in lines)
    assert len([line for line in lines if line.startswith("warning: cannot save the step-cost table")]) == 1, lines


def test_models_fetch_into_it_names_the_cache_and_the_variable(tiny_gguf, unwritable_cache, monkeypatch, capsys):  # noqa: F811
    _, _, path = tiny_gguf
    data = path.read_bytes()
    parts = (path.with_name("ro.part1"), path.with_name("ro.part2"))
    parts[0].write_bytes(data[: len(data) // 2])
    parts[1].write_bytes(data[len(data) // 2 :])
    spec = ModelSpec("tiny-ro", "tiny", "llama", "0", (), LocalParts(parts), hashlib.sha256(data).hexdigest(), len(data))
    monkeypatch.setitem(registry.MODELS, "tiny-ro", spec)
    for argv in (["models", "fetch", "tiny-ro"], ["models", "fetch", "tiny-ro", "--force"]):
        code, lines = _cli(capsys, *argv)
        line = _error(lines)
        assert code == 2 and f"into the specdec cache {unwritable_cache} (" in line and "SPECDEC_CACHE" in line, line


# ---------------------------------------------------------------------------- 8. files follow the umask
@contextmanager
def _umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def test_written_files_follow_the_umask(counter, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    heads = build_heads("eagle3", counter, 2, draft_vocab_size=16)
    with _umask(0o022):
        save_checkpoint(tmp_path / "ckpt", heads, target_description(counter))
        export_eagle3(heads, tmp_path / "export")
        build_dataset(counter, tmp_path / "data", DataSettings(num_prompts=2, max_new_tokens=2, shard_size=2),
                      prompts=text_prompts(2, 0), progress=False, log=QUIET)
        get_or_measure(counter, ks=(1, 2), repeats=1, progress=False)
    written = [p for d in ("ckpt", "export", "data", "cache") for p in (tmp_path / d).rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"model.safetensors", "config.json", "shard-00000.safetensors", "manifest.json",
                                         "prompts.jsonl"}
    assert {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in written} == {
        str(p.relative_to(tmp_path)): "0o644" for p in written}


# ---------------------------------------------------------------------------- 2. the prompt supply is lazy
@contextmanager
def _deadline(seconds: int):
    """TimeoutError in the test's own thread after `seconds` (a supply that builds its whole list never returns)."""
    def expire(*_):
        raise TimeoutError(f"no first shard within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_trillion_prompts_start_their_first_shard_at_once(counter, tmp_path):
    settings = DataSettings(num_prompts=10**12, max_new_tokens=2, shard_size=2, sampled_fraction=0.0,
                            prompt_weights={"math": 1.0})
    with _deadline(60):
        manifest = build_dataset(counter, tmp_path / "data", settings, progress=False, log=QUIET, stop_after_shards=1)
    assert manifest["num_shards"] == 5 * 10**11 and list(manifest["shards"]) == ["0"]
    lines = (tmp_path / "data" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(line)["text"] for line in lines] == [p.text for p in PromptSupply({"math": 1.0}, 0).take(2)]
    assert manifest["sources"]["math"]["prompts"] == 2


def test_a_finite_mix_is_refused_with_its_bound_before_anything_is_written(counter, tmp_path):
    settings = DataSettings(num_prompts=100_000, max_new_tokens=2, prompt_weights={"self-instruct": 1.0})
    with pytest.raises(ValueError, match=r"asked for 100000 prompts but the mix self-instruct 100% holds only 480 distinct"):
        build_dataset(counter, tmp_path / "data", settings, progress=False, log=QUIET)
    assert not (tmp_path / "data").exists()


def test_a_lazily_supplied_job_killed_mid_append_resumes_to_the_same_bytes(counter, tmp_path):
    settings = lambda: DataSettings(num_prompts=6, max_new_tokens=4, shard_size=2, sampled_fraction=0.5,  # noqa: E731
                                    prompt_weights={"math": 1.0, "qa": 1.0})
    build_dataset(counter, tmp_path / "whole", settings(), progress=False, log=QUIET)
    build_dataset(counter, tmp_path / "resumed", settings(), progress=False, log=QUIET, stop_after_shards=1)
    with open(tmp_path / "resumed" / "prompts.jsonl", "a") as prompts:
        prompts.write('{"text": "half a li')  # killed while appending the next shard's prompts
    build_dataset(counter, tmp_path / "resumed", settings(), progress=False, log=QUIET)
    for name in ("prompts.jsonl", "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"):
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


@pytest.mark.slow
def test_train_data_of_a_trillion_prompts_on_smollm2_writes_its_first_shard_at_once(tmp_path):
    """The issue's own command: before, it printed nothing for 60 s while its RSS grew."""
    out = tmp_path / "data"
    argv = [sys.executable, "-m", "specdec.cli", "train", "data", "--model", "smollm2-135m", "--out", str(out),
            "--num-prompts", "1000000000000", "--max-new-tokens", "8", "--shard-size", "2", "--no-progress"]
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        deadline = time.monotonic() + 240
        while not (out / "shard-00000.safetensors").is_file() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (out / "shard-00000.safetensors").is_file(), process.stderr.read() if process.poll() is not None else "no shard"
        assert len((out / "prompts.jsonl").read_text().splitlines()) <= 4  # the shards begun, not the trillion
    finally:
        process.kill()
        process.wait()
