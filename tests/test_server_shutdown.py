"""SIGTERM drains with a bound: a real `specdec serve` process on loopback, a real streaming client."""

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EXIT_MARGIN_S = 10.0  # the step in progress, flushing the stream, uvicorn's 0.1 s polls, interpreter exit


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serving(*options: str, port: int | None = None, env: dict | None = None, max_model_len: int = 2048):
    """`specdec serve` (the default model, SmolLM2) in a subprocess; yields (process, base URL) once healthy."""
    port = port or free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), "--max-model-len", str(max_model_len),
         "--log-level", "warning", *options],
        cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a start with an empty cache compiles the kernel and measures costs
        while True:
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_sigterm_ends_a_long_stream_with_abort_within_the_shutdown_timeout():
    drain_s = 3.0
    # counting goes on for far longer than the drain: only the bound can end this stream early
    body = {"model": "smollm2-135m", "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 1500,
            "temperature": 0, "stream": True}
    with serving("--shutdown-timeout", str(drain_s)) as (process, url), concurrent.futures.ThreadPoolExecutor(1) as pool:
        events, sent_at = [], None
        # a non-streaming request in flight too: it gets its whole answer, ended the same way
        waiting = pool.submit(httpx.post, url + "/v1/completions", json={**body, "stream": False}, timeout=120)
        with httpx.Client(timeout=120) as http, http.stream("POST", url + "/v1/completions", json=body) as stream:
            for line in stream.iter_lines():
                if line.startswith("data:"):
                    events.append(line.removeprefix("data:").strip())
                if len(events) == 3 and sent_at is None:  # streaming: now the server is told to stop
                    process.send_signal(signal.SIGTERM)
                    sent_at = time.monotonic()
        ended_at = time.monotonic()
        code = process.wait(timeout=drain_s + 60)
        exited_at = time.monotonic()
        answer = waiting.result(timeout=60)
    # a proper end of stream: a last chunk with the finish reason, then [DONE]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    reasons = [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]]
    assert reasons[-1] == "abort" and set(reasons[:-1]) == {None}
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks[3:]).strip()  # it ran on during the drain ...
    assert ended_at - sent_at >= drain_s - 0.5  # ... for the drain ...
    assert exited_at - sent_at < drain_s + EXIT_MARGIN_S  # ... and no longer
    assert code == -signal.SIGTERM  # uvicorn re-raises the signal once drained: the exit status says why
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "abort"
    assert answer.json()["choices"][0]["text"].startswith(" 11, 12,")
