"""vLLM in its own process: run with the vLLM virtualenv's python (it imports nothing of specdec).

    <vllm venv>/bin/python vllm_worker.py '<settings JSON>'

settings: {"model": DIR, "speculative_config": {...} | null, "llm": {extra LLM(...) keyword arguments}}.
The worker builds `LLM(model, skip_tokenizer_init=True, disable_log_stats=False, ...)` once, writes
one JSON line {"ready": true, "vllm": version, "settings": {...}} and then answers one JSON line per
request line:

    request  {"prompt_ids": [...], "max_tokens": N, "stop_token_ids": [...], "temperature": 0.0,
              "top_k": 0, "top_p": 1.0, "seed": null}
    answer   {"tokens": [...], "drafts": n, "draft_tokens": n, "accepted_tokens": n,
              "accepted_per_position": [...]}     (this request's spec-decode counters)
    failure  {"error": "one line"}

The protocol has the process's original stdout to itself: everything else written to stdout
(vLLM's logging, its engine process) goes to stderr. EOF on stdin ends the worker.

If a process of vLLM's engine dies (the OOM killer, a native crash), `LLM.generate` can wait for it
forever; a watch thread then answers {"error": "EngineDeadError: ..."} and ends the worker.
"""

import json
import os
import signal
import sys
import threading

COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def protocol_channel():
    """The original stdout for answers; fd 1 (and so every library's print) then points at stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def spec_counters(llm) -> dict:
    """The engine's cumulative spec-decode counters (zeros without speculative decoding)."""
    totals = {key: 0 for key in COUNTERS}
    per_position: list[int] = []
    for metric in llm.get_metrics():
        for key, name in COUNTERS.items():
            if metric.name == name:
                totals[key] += int(metric.value)
        if metric.name == PER_POSITION:
            values = list(getattr(metric, "values", []))
            per_position = [int(v) + (per_position[i] if i < len(per_position) else 0) for i, v in enumerate(values)]
    totals["accepted_per_position"] = per_position
    return totals


def answer(llm, request: dict) -> dict:
    from vllm import SamplingParams, TokensPrompt

    greedy = float(request.get("temperature", 0.0)) == 0.0
    params = SamplingParams(
        max_tokens=int(request["max_tokens"]), temperature=0.0 if greedy else float(request["temperature"]),
        top_k=int(request.get("top_k") or 0) or -1, top_p=float(request.get("top_p", 1.0)), seed=request.get("seed"),
        stop_token_ids=list(request.get("stop_token_ids") or []), ignore_eos=False, detokenize=False,
    )
    before = spec_counters(llm)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(request["prompt_ids"]))], params, use_tqdm=False)
    after = spec_counters(llm)
    result = {"tokens": list(outputs[0].outputs[0].token_ids)}
    for key in COUNTERS:
        result[key] = after[key] - before[key]
    old = before["accepted_per_position"]
    result["accepted_per_position"] = [v - (old[i] if i < len(old) else 0) for i, v in enumerate(after["accepted_per_position"])]
    return result


ENGINE_WATCH_SECONDS = 1.0


class Channel:
    """The answer stream, written by the request loop and by the engine watch (one line at a time)."""

    def __init__(self, stream):
        self.stream, self.lock = stream, threading.Lock()

    def write(self, message: dict) -> None:
        with self.lock:
            self.stream.write(json.dumps(message) + "\n")
            self.stream.flush()


def watch_engine(channel: Channel, closing: threading.Event) -> None:
    """Answer and exit when a process vLLM started for its engine dies while the worker serves.

    Only the worker's own children (the engine core): theirs come and go (compile pools) or are the engine
    core's to watch (a dead model worker makes vLLM raise EngineDeadError itself)."""
    import psutil  # a vLLM dependency

    engine = [(process, process.name()) for process in psutil.Process().children()]

    def alive(process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def watch() -> None:
        while not closing.wait(ENGINE_WATCH_SECONDS):
            dead = [(process.pid, name) for process, name in engine if not alive(process)]
            if dead and not closing.is_set():
                pid, name = dead[0]
                channel.write({"error": f"EngineDeadError: vLLM's engine process {pid} ({name}) died"})
                os._exit(3)

    threading.Thread(target=watch, name="engine-watch", daemon=True).start()


def main() -> int:
    # SIGTERM as a normal exit, so that vLLM's own shutdown ends its engine processes instead of orphaning them
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    channel = Channel(protocol_channel())
    settings = json.loads(sys.argv[1])
    import vllm
    from vllm import LLM

    llm = LLM(model=settings["model"], skip_tokenizer_init=True, disable_log_stats=False,
              speculative_config=settings.get("speculative_config"), **(settings.get("llm") or {}))
    closing = threading.Event()
    watch_engine(channel, closing)
    channel.write({"ready": True, "vllm": vllm.__version__, "settings": settings})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            result = answer(llm, json.loads(line))
        except Exception as error:  # noqa: BLE001 - a bad request is answered, the engine stays up
            result = {"error": f"{type(error).__name__}: {' '.join(str(error).split())}"}
        channel.write(result)
    closing.set()  # EOF: vLLM's engine shuts down as the worker returns, which is not a death
    return 0


if __name__ == "__main__":  # LLM(...) starts its engine in a spawned process, which re-imports this file
    sys.exit(main())
