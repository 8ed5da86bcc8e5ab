"""The project's side of `vllm_worker.py`: start vLLM in its own virtualenv and process, send it
prompt ids, read back tokens and its spec-decode counters (JSON lines over stdin / stdout)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .envs import installed_python

WORKER_SCRIPT = Path(__file__).with_name("vllm_worker.py")
STDERR_TAIL_CHARS = 4000  # of the worker's log, for the error message when it dies


@dataclass
class VllmAnswer:
    tokens: list[int]
    drafts: int = 0  # spec-decode steps that proposed tokens (vllm:spec_decode_num_drafts)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def target_forwards(self) -> int:
        """Each forward emits its accepted draft tokens + one: forwards = tokens - accepted (prefill included)."""
        return max(1, len(self.tokens) - self.accepted_tokens)


class VllmError(RuntimeError):
    """vLLM could not start or answer; the message carries its own error line."""


# a log line's exception: "ValueError: ...", also after vLLM's "(VllmWorker-0 pid=1) ERROR ... [file:line]" prefix
EXCEPTION_LINE = re.compile(r"(?:^|\] |\s)((?:[A-Za-z_.]+)?(?:Error|Exception): .+)$")
GENERIC_FAILURES = ("Engine core initialization failed",)  # vLLM's wrapper: the root cause is logged before it
ENGINE_DEAD = "EngineDeadError"  # the worker's one-line answer once vLLM's engine has died (a bad request keeps it up)
# a worker killed by a native crash leaves no exception of its own, only this line (and "cancelled" after it)
DEAD_WORKER = re.compile(r"Worker proc \S+ died unexpectedly.*$")


def logged_failure(log: str) -> str | None:
    """The worker log's first failure: an exception that is not vLLM's generic wrapper or a warning, or
    the dead-worker line, whichever comes first; None when it logged neither. (A worker that raised
    also ends in the dead-worker line: its exception, e.g. a KV cache that does not fit, is the cause;
    after a native crash vLLM's own "cancelled" comes after the line.)"""
    lines = [line.strip() for line in log.splitlines() if line.strip() and " WARNING " not in line]
    for index, line in enumerate(lines):
        if dead := DEAD_WORKER.search(line):
            return dead.group(0)[:600]
        match = EXCEPTION_LINE.search(line)
        if match and not any(generic in line for generic in GENERIC_FAILURES):
            cause = match.group(1)
            if "validation error" in cause and index + 1 < len(lines):  # pydantic: the reason is on the next line
                cause += ": " + lines[index + 1].split(" [type=", 1)[0]
            return cause[:600]
    return None


def root_cause(log: str) -> str:
    """What the worker's log says went wrong: its logged failure, else its last line that is not a warning."""
    lines = [line.strip() for line in log.splitlines() if line.strip() and " WARNING " not in line]
    return logged_failure(log) or (lines[-1][:600] if lines else "no output")


class VllmWorker:
    """One `LLM(...)` in a worker process; `generate()` per prompt, `close()` ends it."""

    def __init__(self, model_dir: str | Path, speculative_config: dict | None = None, llm_kwargs: dict | None = None,
                 env: dict | None = None):
        self.settings = {"model": str(model_dir), "speculative_config": speculative_config, "llm": dict(llm_kwargs or {})}
        python = installed_python("vllm")
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specdec-vllm-", suffix=".log", delete=False)
        process_env = {**os.environ, **(env or {})}
        process_env.pop("PYTHONPATH", None)  # the project's modules must not shadow the venv's
        self.process = subprocess.Popen([str(python), str(WORKER_SCRIPT), json.dumps(self.settings)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        env=process_env, cwd=tempfile.gettempdir())
        self.ready = self._read("starting vLLM")
        self.version = self.ready.get("vllm", "")

    def _read(self, doing: str) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise VllmError(f"vLLM exited while {doing} (exit {self.process.returncode}): {root_cause(self.log_text())}")
        reply = json.loads(line)
        if "error" in reply:
            error = reply["error"]
            if error.startswith(ENGINE_DEAD) and (cause := logged_failure(self.log_text())):  # vLLM's says "see stack trace above"
                error += f" (log: {cause})"
            raise VllmError(f"vLLM failed while {doing}: {error}")
        return reply

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-STDERR_TAIL_CHARS * 4:]

    def generate(self, prompt_ids: list[int], max_tokens: int, stop_token_ids: list[int], temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> VllmAnswer:
        request = {"prompt_ids": [int(t) for t in prompt_ids], "max_tokens": int(max_tokens),
                   "stop_token_ids": [int(t) for t in stop_token_ids], "temperature": temperature, "top_k": top_k,
                   "top_p": top_p, "seed": seed}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:  # the worker has exited: its last line says why (an engine death), else its log
            pass
        reply = self._read("generating")
        return VllmAnswer(tokens=[int(t) for t in reply["tokens"]], drafts=reply["drafts"], draft_tokens=reply["draft_tokens"],
                          accepted_tokens=reply["accepted_tokens"], accepted_per_position=reply["accepted_per_position"])

    def close(self) -> None:
        process, self.process = getattr(self, "process", None), None
        if process is not None and process.poll() is None:
            process.stdin.close()  # EOF: the worker returns and vLLM shuts its engine down
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if getattr(self, "log", None) is not None:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
            self.log = None

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
