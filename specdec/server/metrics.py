"""Prometheus metrics in the text exposition format (hand-rolled: counters, gauges, histograms).

`ServerMetrics` holds everything `/metrics` shows. The scheduler thread and the HTTP handlers
both record into it, so every metric is guarded by one lock. Speculative figures (drafted /
accepted tokens, mean accepted length, acceptance per draft position) come from one merged
`SpecStats` of every finished request, so they agree with the per-request `usage` figures.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence

from ..stats import SpecStats

# seconds; time to first token spans a prefill (and queueing), per-token latency one step
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items()) + "}"


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()):
        self.name, self.help, self.labelnames = name, help_text, tuple(labelnames)

    def _key(self, labels: dict) -> tuple:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[name]) for name in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    """A monotonically increasing count per label combination."""

    kind = "counter"

    def __init__(self, name, help_text, labelnames=()):
        super().__init__(name, help_text, labelnames)
        self.values: dict[tuple, float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} can only increase, got {amount}")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels) -> float:
        return self.values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_format_labels(dict(zip(self.labelnames, key)))} {_format_value(value)}"
                for key, value in sorted(self.values.items())]


class Gauge(_Metric):
    """A value that goes up and down; either set explicitly or read from a function at render time."""

    kind = "gauge"

    def __init__(self, name, help_text, labelnames=(), read: Callable[[], Iterable[tuple[dict, float]]] | None = None):
        super().__init__(name, help_text, labelnames)
        self.values: dict[tuple, float] = {}
        self.read = read  # () -> [(labels, value)], evaluated on every render

    def set(self, value: float, **labels) -> None:
        self.values[self._key(labels)] = float(value)

    def samples(self) -> list[tuple[dict, float]]:
        if self.read is not None:
            return list(self.read())
        return [(dict(zip(self.labelnames, key)), value) for key, value in sorted(self.values.items())]

    def lines(self) -> list[str]:
        return [f"{self.name}{_format_labels(labels)} {_format_value(value)}" for labels, value in self.samples()]


class Histogram(_Metric):
    """Cumulative buckets plus _sum and _count (no labels: one distribution per metric)."""

    kind = "histogram"

    def __init__(self, name, help_text, buckets: Sequence[float]):
        super().__init__(name, help_text)
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"histogram buckets must be strictly increasing, got {buckets}")
        self.bounds = tuple(float(b) for b in buckets) + (math.inf,)
        self.counts = [0] * len(self.bounds)  # per bucket (not cumulative)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for index, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[index] += 1
                break
        self.total += value
        self.count += 1

    def lines(self) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip(self.bounds, self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_format_value(bound)}"}} {cumulative}')
        lines.append(f"{self.name}_sum {_format_value(self.total)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class ServerMetrics:
    """Every metric the server exports; thread-safe (one lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.read_queue_length: Callable[[], int] = lambda: 0  # set by watch(): the scheduler's live counts
        self.read_running: Callable[[], int] = lambda: 0
        self.finished_stats = SpecStats(sequences=0)  # merged stats of every finished request
        prefix = "specdec_"
        self.requests = Counter(prefix + "requests_total", "HTTP requests by route and status code", ("route", "status"))
        self.finished = Counter(prefix + "generations_total", "finished generations by finish reason", ("finish_reason",))
        self.prompt_tokens = Counter(prefix + "prompt_tokens_total", "prompt tokens of admitted requests")
        self.target_forwards = Counter(prefix + "target_forwards_total", "batched target forwards (prefills + verify steps)")
        self.ttft = Histogram(prefix + "time_to_first_token_seconds", "arrival to first generated token", TTFT_BUCKETS)
        self.token_latency = Histogram(prefix + "time_per_output_token_seconds",
                                       "per request: (finish - first token) / (completion tokens - 1)", TOKEN_LATENCY_BUCKETS)
        self.batch_size = Histogram(prefix + "step_batch_size", "running sequences per verify step", BATCH_SIZE_BUCKETS)
        stats = self.finished_stats
        self._metrics: list[_Metric] = [
            self.requests,
            self.finished,
            self.prompt_tokens,
            _StatsCounter(prefix + "completion_tokens_total", "generated tokens of finished requests", lambda: stats.generated_tokens),
            self.target_forwards,
            _StatsCounter(prefix + "drafted_tokens_total", "draft tokens sent to verification", lambda: stats.drafted_tokens),
            _StatsCounter(prefix + "accepted_tokens_total", "draft tokens accepted", lambda: stats.accepted_tokens),
            Gauge(prefix + "mean_accepted_length", "tokens per verify step (accepted + bonus), finished requests",
                  read=lambda: [({}, stats.tau)]),
            Gauge(prefix + "acceptance_rate", "accepted / drafted tokens, finished requests",
                  read=lambda: [({}, stats.acceptance_rate)]),
            Gauge(prefix + "acceptance_per_position", "P(draft position d accepted | drafted), finished requests",
                  ("position",), read=self._acceptance_per_position),
            self.ttft,
            self.token_latency,
            self.batch_size,
            Gauge(prefix + "queue_length", "requests waiting for a batch slot", read=lambda: [({}, self.read_queue_length())]),
            Gauge(prefix + "running_requests", "requests in the running batch", read=lambda: [({}, self.read_running())]),
        ]

    def watch(self, queue_length: Callable[[], int], running: Callable[[], int]) -> None:
        """Where the queue-length and running gauges read their live values."""
        self.read_queue_length, self.read_running = queue_length, running

    def _acceptance_per_position(self):
        rates = self.finished_stats.acceptance_per_position
        return [({"position": str(depth + 1)}, rate) for depth, rate in enumerate(rates) if rate is not None]

    # ------------------------------------------------------------------ recording
    def record_request(self, route: str, status: int) -> None:
        with self.lock:
            self.requests.inc(route=route, status=str(status))

    def record_admitted(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens.inc(prompt_tokens)

    def record_forward(self, batch_size: int, verify: bool) -> None:
        with self.lock:
            self.target_forwards.inc()
            if verify:
                self.batch_size.observe(batch_size)

    def record_first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def record_finished(self, stats: SpecStats, finish_reason: str, decode_seconds: float | None) -> None:
        """A generation ended: merge its stats, count its reason, observe its per-token latency."""
        with self.lock:
            self.finished_stats.merge(stats)
            self.finished.inc(finish_reason=finish_reason)
            if decode_seconds is not None and stats.generated_tokens > 1:
                self.token_latency.observe(decode_seconds / (stats.generated_tokens - 1))

    # ------------------------------------------------------------------ output
    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        with self.lock:
            lines = []
            for metric in self._metrics:
                lines += metric.header() + metric.lines()
        return "\n".join(lines) + "\n"


class _StatsCounter(Counter):
    """A counter whose value is read from the merged SpecStats at render time."""

    def __init__(self, name, help_text, read: Callable[[], float]):
        super().__init__(name, help_text)
        self.read = read

    def lines(self) -> list[str]:
        return [f"{self.name} {_format_value(self.read())}"]


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line (for tests and the load benchmark)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        samples[name] = float(value)
    return samples
