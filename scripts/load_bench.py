"""Load benchmark: per-user and total tokens/s at several concurrencies, with and without speculation.

For each configuration (plain decoding, then speculation with --drafter / --gamma) it starts
`specdec serve` on loopback itself, sends streaming chat requests from N concurrent users
(N = each --concurrency level; every user sends --requests-per-user requests back to back), and
records per request: time to first token, end-to-end time, completion tokens. It writes

    OUT/load_bench.json   one row per (configuration, concurrency) + the raw requests
    OUT/load_bench.png    per-user tokens/s (y) against total tokens/s (x), one line per configuration

    python scripts/load_bench.py --model smollm2-135m --drafter pld --concurrency 1,2,4,8 --max-tokens 128

A configuration `speculative:G` fixes that server's gamma (G = auto or an int) instead of --gamma, so one
run compares the same drafter at several gammas, e.g. `--configs plain,speculative:8,speculative:auto`.
At temperature 0 every request's text is compared with plain decoding's answer to the same prompt (the
plain configuration runs first; a mismatch is counted per row and makes the exit code 1).

Soak mode (`--soak-seconds S`): one server (the first of --configs), max(--concurrency) clients for S
seconds, each mixing full streams, streams it abandons after a few chunks, and non-streamed
requests; the server's RSS is sampled every few seconds. It writes OUT/soak.json (requests served,
cancelled, errors, RSS start / end / peak) and exits non-zero on any error or if the server died.

    python scripts/load_bench.py --soak-seconds 600 --concurrency 8 --configs speculative --max-tokens 64

The client side uses only the standard library (http.client), so the measurement does not depend
on the client package; the server's /metrics gives the speculative figures of each level.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import socket
import statistics
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PROMPTS = [
    "Rewrite this Python function with a docstring and type hints, keeping the code the same:\n\n"
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / len(values)\n",
    "Summarise this paragraph in two sentences: Speculative decoding lets a cheap drafter propose several tokens "
    "that the large model checks in one forward pass. Accepted tokens are kept, and the first rejected one is "
    "replaced by a token sampled from the corrected distribution, so the output distribution is unchanged.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain step by step how to make a cup of tea.",
    "List ten animals that live in the ocean, one per line, each with a one-line fact.",
    "Repeat the following sentence three times: the quick brown fox jumps over the lazy dog.",
    "Describe the water cycle for a ten-year-old.",
    "Write a JSON object describing a book with title, author, year and three keywords.",
]


@dataclass
class RequestResult:
    user: int
    prompt_index: int
    start_s: float
    first_token_s: float | None
    end_s: float
    completion_tokens: int
    status: int
    error: str | None = None
    text: str = ""

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.latency_s if self.latency_s > 0 else 0.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http_json(port: int, method: str, path: str, body=None, timeout: float = 600.0):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        connection.request(method, path, payload, {"Content-Type": "application/json"} if payload else {})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def config_gamma(config: str, default_gamma: str) -> str | None:
    """The gamma of a configuration: None for plain, G for `speculative:G`, --gamma for `speculative`."""
    kind, _, gamma = config.partition(":")
    return None if kind == "plain" else gamma or default_gamma


def start_server(args, config: str, port: int, log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "specdec.cli", "serve", "--model", args.model, "--port", str(port),
               "--max-running", str(max(args.concurrency)), "--max-model-len", str(args.max_model_len),
               "--log-level", "warning"]
    if args.weights:
        command += ["--weights", args.weights]
    gamma = config_gamma(config, args.gamma)
    if gamma is None:  # named: a server without --drafter runs auto (its default), not plain decoding
        command += ["--drafter", "none"]
    else:
        command += ["--drafter", args.drafter, "--gamma", gamma]
        for pair in args.drafter_arg:
            command += ["--drafter-arg", pair]
    log = open(log_path, "w")  # noqa: SIM115 - closed by the caller via process.log
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    process.log = log
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
        try:
            status, _ = http_json(port, "GET", "/health", timeout=5)
            if status == 200:
                return process
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(process)
    raise RuntimeError(f"the server did not become healthy in {args.startup_timeout}s; see {log_path}")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.log.close()


def stream_chat(port: int, model: str, prompt: str, max_tokens: int, temperature: float, user: int,
                prompt_index: int) -> RequestResult:
    """One streaming chat request; the usage chunk gives the completion token count."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first_token, tokens, status, error, pieces = None, 0, 0, None, []
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        response = connection.getresponse()
        status = response.status
        if status != 200:
            error = response.read().decode()[:500]
        else:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:"):])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    break
                content = "".join(c.get("delta", {}).get("content") or "" for c in chunk.get("choices", []))
                if first_token is None and content:
                    first_token = time.perf_counter()
                pieces.append(content)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except OSError as failure:
        error = f"{type(failure).__name__}: {failure}"
    finally:
        connection.close()
    return RequestResult(user, prompt_index, start, first_token, time.perf_counter(), tokens, status, error, "".join(pieces))


def abandoned_stream(port: int, model: str, prompt: str, max_tokens: int, chunks: int) -> str:
    """A streaming request whose client hangs up after `chunks` chunks: "cancelled", or an error text."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return f"HTTP {response.status}: {response.read().decode()[:200]}"
        seen = 0
        for raw in response:
            seen += raw.startswith(b"data:")
            if seen >= chunks:
                break
        return "cancelled"
    except OSError as failure:
        return f"{type(failure).__name__}: {failure}"
    finally:
        connection.close()  # mid-stream: the server must notice and free the row


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def soak(args, port: int, model: str, pid: int) -> dict:
    """max(--concurrency) clients for --soak-seconds: mixed full / abandoned / non-streamed requests."""
    deadline = time.monotonic() + args.soak_seconds
    rss, stop = [(0.0, rss_bytes(pid))], threading.Event()
    started = time.monotonic()

    def sample():
        while not stop.wait(args.rss_interval):
            rss.append((time.monotonic() - started, rss_bytes(pid)))

    def client(user: int) -> dict:
        rng = random.Random(user)
        counts = {"served": 0, "cancelled": 0, "errors": 0, "completion_tokens": 0, "error_samples": []}
        for turn in range(args.soak_max_requests):  # bounded even if the clock misbehaves
            if time.monotonic() >= deadline:
                break
            prompt = PROMPTS[rng.randrange(len(PROMPTS))]
            kind = rng.choice(("stream", "stream", "abandon", "plain"))
            if kind == "abandon":
                outcome = abandoned_stream(port, model, prompt, args.max_tokens, rng.randint(1, 6))
                error = None if outcome == "cancelled" else outcome
                counts["cancelled"] += error is None
            elif kind == "stream":
                result = stream_chat(port, model, prompt, args.max_tokens, args.temperature, user, turn)
                error = result.error or (None if result.status == 200 else f"HTTP {result.status}")
                counts["served"] += error is None
                counts["completion_tokens"] += result.completion_tokens if error is None else 0
            else:
                status, text = http_json(port, "POST", "/v1/chat/completions", {
                    "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
                    "temperature": args.temperature})
                error = None if status == 200 else f"HTTP {status}: {text[:200]}"
                counts["served"] += error is None
                counts["completion_tokens"] += json.loads(text)["usage"]["completion_tokens"] if error is None else 0
            if error is not None:
                counts["errors"] += 1
                counts["error_samples"] = (counts["error_samples"] + [error])[:3]
        return counts

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    users = max(args.concurrency)
    with concurrent.futures.ThreadPoolExecutor(users) as pool:
        per_user = list(pool.map(client, range(users)))
    stop.set()
    sampler.join()
    rss.append((time.monotonic() - started, rss_bytes(pid)))
    total = {key: sum(c[key] for c in per_user) for key in ("served", "cancelled", "errors", "completion_tokens")}
    status, _ = http_json(port, "GET", "/health", timeout=30)
    return {
        **total,
        "clients": users,
        "seconds": time.monotonic() - started,
        "health_after": status,
        "rss_start_mb": rss[0][1] / 1e6,
        "rss_end_mb": rss[-1][1] / 1e6,
        "rss_peak_mb": max(r for _, r in rss) / 1e6,
        "rss_samples": [(round(t, 1), round(r / 1e6, 1)) for t, r in rss],
        "error_samples": [e for c in per_user for e in c["error_samples"]][:10],
    }


def scrape(port: int) -> dict[str, float]:
    status, text = http_json(port, "GET", "/metrics")
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def count_mismatches(results: list[RequestResult], reference: dict[int, str]) -> tuple[int, int]:
    """(compared, differing): successful requests whose prompt has a reference answer, and those whose
    text is not that answer (greedy speculation must reproduce plain decoding exactly)."""
    compared = [r for r in results if r.error is None and r.prompt_index in reference]
    return len(compared), sum(r.text != reference[r.prompt_index] for r in compared)


def run_level(args, port: int, model: str, concurrency: int) -> tuple[dict, list[RequestResult]]:
    """`concurrency` users, each sending requests back to back; returns the summary row and raw results."""

    def user_session(user: int) -> list[RequestResult]:
        results = []
        for turn in range(args.requests_per_user):
            index = (user * args.requests_per_user + turn) % len(PROMPTS)
            results.append(stream_chat(port, model, PROMPTS[index], args.max_tokens, args.temperature, user, index))
        return results

    before = scrape(port)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        sessions = list(pool.map(user_session, range(concurrency)))
    wall = time.perf_counter() - started
    after = scrape(port)
    results = [r for session in sessions for r in session]
    good = [r for r in results if r.error is None]
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    steps = delta.get("specdec_step_batch_size_count", 0.0)
    per_user = [r.tokens_per_s for r in good]
    ttfts = [r.first_token_s - r.start_s for r in good if r.first_token_s is not None]
    row = {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(good),
        "completion_tokens": sum(r.completion_tokens for r in good),
        "wall_s": wall,
        "total_tokens_per_s": sum(r.completion_tokens for r in good) / wall if wall > 0 else 0.0,
        "per_user_tokens_per_s_mean": statistics.fmean(per_user) if per_user else 0.0,
        "per_user_tokens_per_s_median": statistics.median(per_user) if per_user else 0.0,
        "ttft_s_mean": statistics.fmean(ttfts) if ttfts else None,
        "drafted_tokens": delta.get("specdec_drafted_tokens_total", 0.0),
        "accepted_tokens": delta.get("specdec_accepted_tokens_total", 0.0),
        "verify_steps_batched": steps,
        "mean_batch_size": delta.get("specdec_step_batch_size_sum", 0.0) / steps if steps else None,
    }
    return row, results


def run_order(configs: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round index, configuration) in the order they run: plain first in round 1 (its answers are
    the reference), later rounds alternate the order, so slow drift of the machine's load does not
    always land on the same configuration."""
    first = sorted(configs, key=lambda c: c != "plain")
    return [(index, config) for index in range(rounds) for config in (first if index % 2 == 0 else first[::-1])]


def round_means(rows: list[dict]) -> list[str]:
    """Per configuration and concurrency: total tokens/s of each round, their mean, and the mean's
    ratio to plain's mean (when plain ran)."""
    totals: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        totals.setdefault((row["config"], row["concurrency"]), []).append(row["total_tokens_per_s"])
    lines = []
    for (config, concurrency), values in totals.items():
        mean = statistics.fmean(values)
        plain = totals.get(("plain", concurrency))
        ratio = f"  {mean / statistics.fmean(plain):.2f}x plain" if plain and config != "plain" else ""
        lines.append(f"mean {config:12s} c={concurrency:<3d} total {mean:7.2f} tok/s over {len(values)} rounds "
                     f"({', '.join(f'{v:.2f}' for v in values)}){ratio}")
    return lines


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.5, 4.5))
    several_rounds = any(row.get("round", 1) > 1 for row in rows)
    for config, round_number in dict.fromkeys((row["config"], row.get("round", 1)) for row in rows):
        points = sorted((r for r in rows if r["config"] == config and r.get("round", 1) == round_number),
                        key=lambda r: r["concurrency"])
        label = f"{config}, round {round_number}" if several_rounds else config
        xs = [r["total_tokens_per_s"] for r in points]
        ys = [r["per_user_tokens_per_s_mean"] for r in points]
        axes.plot(xs, ys, marker="o", label=label)
        for r, x, y in zip(points, xs, ys):
            axes.annotate(f"c={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes.set_xlabel("total throughput (tokens/s)")
    axes.set_ylabel("per-user speed (tokens/s)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def valid_config(config: str) -> bool:
    kind, sep, gamma = config.partition(":")
    if kind == "plain":
        return not sep
    return kind == "speculative" and (not sep or gamma == "auto" or (gamma.isdigit() and int(gamma) >= 1))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every configuration this many times, alternating their order from round to round "
                             "(prints each configuration's mean over the rounds)")
    parser.add_argument("--weights", choices=["gguf", "gguf-a8", "fp32"], default=None,
                        help="GGUF-sourced models: the server's --weights (default: the server's default)")
    parser.add_argument("--drafter", default="pld", help="drafter of the speculative configuration")
    parser.add_argument("--drafter-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--gamma", default="auto", help="'auto' (load-aware cost model) or a fixed int")
    parser.add_argument("--configs", default="plain,speculative",
                        help="comma list of: plain, speculative (at --gamma), speculative:GAMMA")
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma list of concurrent users")
    parser.add_argument("--requests-per-user", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to load the model (and measure costs)")
    parser.add_argument("--out", default="runs/load_bench", help="output directory")
    parser.add_argument("--soak-seconds", type=float, default=0, help="soak mode: run clients this long (see the doc)")
    parser.add_argument("--soak-max-requests", type=int, default=10_000, help="soak mode: requests per client at most")
    parser.add_argument("--rss-interval", type=float, default=5.0, help="soak mode: seconds between RSS samples")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        parser.error(f"--concurrency must be a comma list of integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency needs positive integers")
    args.configs = [c for c in args.configs.split(",") if c]
    if not args.configs or not all(valid_config(c) for c in args.configs):
        parser.error(f"--configs takes plain, speculative and speculative:GAMMA (GAMMA auto or an int >= 1), got {args.configs}")
    if len(set(args.configs)) != len(args.configs):
        parser.error(f"--configs lists a configuration twice: {args.configs}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.requests_per_user < 1 or args.max_tokens < 1:
        parser.error("--requests-per-user and --max-tokens must be >= 1")
    return args


def main_soak(args, out: Path) -> int:
    config = args.configs[0]
    port = free_port()
    process = start_server(args, config, port, out / f"server_soak_{config}.log")
    try:
        _, models = http_json(port, "GET", "/v1/models")
        model = json.loads(models)["data"][0]["id"]
        result = soak(args, port, model, process.pid)
        alive = process.poll() is None
    finally:
        stop_server(process)
    meta = {key: getattr(args, key) for key in ("model", "drafter", "gamma", "max_tokens", "temperature", "max_model_len",
                                                 "soak_seconds")}
    result = {"meta": {**meta, "config": config, "argv": sys.argv}, "server_alive_at_end": alive, **result}
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    print(f"soak {config}: {result['seconds']:.0f}s, {result['clients']} clients: served {result['served']}, "
          f"cancelled {result['cancelled']}, errors {result['errors']}, {result['completion_tokens']} tokens; "
          f"RSS {result['rss_start_mb']:.0f} -> {result['rss_end_mb']:.0f} MB (peak {result['rss_peak_mb']:.0f}); "
          f"wrote {out / 'soak.json'}")
    return 1 if result["errors"] or not alive or result["health_after"] != 200 else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.soak_seconds > 0:
        return main_soak(args, out)
    rows, raw = [], []
    reference: dict[int, str] = {}  # prompt index -> plain decoding's greedy answer
    for round_index, config in run_order(args.configs, args.rounds):
        port = free_port()
        log_name = f"server_{config}.log" if args.rounds == 1 else f"server_{config}_round{round_index + 1}.log"
        process = start_server(args, config, port, out / log_name)
        try:
            _, models = http_json(port, "GET", "/v1/models")
            model = json.loads(models)["data"][0]["id"]
            stream_chat(port, model, "Hello!", 8, 0.0, -1, -1)  # warm-up (first-call allocations)
            for concurrency in args.concurrency:
                row, results = run_level(args, port, model, concurrency)
                row["config"], row["round"] = config, round_index + 1
                if args.temperature == 0 and config == "plain" and round_index == 0:
                    reference.update({r.prompt_index: r.text for r in results if r.error is None})
                if args.temperature == 0 and config != "plain":
                    row["compared_with_plain"], row["differ_from_plain"] = count_mismatches(results, reference)
                rows.append(row)
                raw += [{"config": config, "concurrency": concurrency, **asdict(r)} for r in results]
                print(f"{'' if args.rounds == 1 else f'round {round_index + 1} '}{config:12s} c={concurrency:<3d} per-user {row['per_user_tokens_per_s_mean']:7.2f} tok/s  "
                      f"total {row['total_tokens_per_s']:7.2f} tok/s  ttft {row['ttft_s_mean'] or 0:.2f}s  "
                      f"errors {row['errors']}"
                      + (f"  differ from plain {row['differ_from_plain']}/{row['compared_with_plain']}"
                         if "differ_from_plain" in row else ""), flush=True)
        finally:
            stop_server(process)
    meta = {key: getattr(args, key) for key in ("model", "weights", "drafter", "drafter_arg", "gamma", "concurrency",
                                                 "requests_per_user", "max_tokens", "temperature", "max_model_len", "rounds")}
    meta["cpu_count"] = os.cpu_count()
    if args.rounds > 1:
        for line in round_means(rows):
            print(line)
    (out / "load_bench.json").write_text(json.dumps({"meta": meta, "results": rows, "requests": raw}, indent=2))
    plot(rows, out / "load_bench.png", f"{args.model}: plain vs {args.drafter}")
    print(f"wrote {out / 'load_bench.json'} and {out / 'load_bench.png'}")
    return 1 if any(row["errors"] or row.get("differ_from_plain") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
