"""Continuous batching: one background thread owns the target and the SpecBatch.

HTTP handlers never touch torch. They `submit()` a `GenerationRequest` and read its events
from an asyncio queue; the scheduler thread loops:

    1. drop cancelled requests (waiting: forget them; running: `batch.remove`, freeing the row);
       after `abort()` (the bounded SIGTERM drain) every request ends this way, with "abort"
    2. admit waiting requests (FIFO) while the rows, the prefill budget and the KV budget allow
       (`batch.add`: one ragged prefill for all); the rest wait in the queue
    3. `batch.step()`: one draft -> verify over every running sequence; the budget policy sees
       the whole batch, so speculation shrinks as load grows (AutoBudget, load-aware)
    4. push each request's newly committed tokens (`seq.last_committed`) to its event loop with
       `call_soon_threadsafe`; a finished sequence gets its final text, reason and stats

Streaming text deltas (`TextDeltas`, specdec.streaming) are shared with `specdec.stream`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from ..budget import budget_policy_for
from ..loop import SpecBatch, kv_room
from ..sampling import SamplingParams
from ..stats import SpecStats
from .config import ServerConfig
from .metrics import ServerMetrics

log = logging.getLogger("specdec.server")


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queue (HTTP 429)."""


class SchedulerStoppedError(RuntimeError):
    """The scheduler is not running (server starting up or shutting down; HTTP 503)."""


@dataclass
class TokensEvent:
    tokens: list[int]  # tokens committed for this request in one step (prefill or verify)


@dataclass
class FinishedEvent:
    finish_reason: str  # "stop" | "length" | "cancelled" (the client left) | "abort" (the server ended it) | "error"
    text: str  # the whole output text (a matched stop string and what follows it cut off)
    output_tokens: list[int]
    stats: SpecStats
    error: str | None = None


_request_ids = itertools.count()


@dataclass(eq=False)
class GenerationRequest:
    """One request as the scheduler sees it; `events` lives on the handler's event loop."""

    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    request_id: int = field(default_factory=lambda: next(_request_ids))
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    end_reason: str | None = None  # set by cancel() from any thread; read by the scheduler between steps
    sequence: object | None = None  # the SpecBatch sequence while admitted

    @property
    def cancelled(self) -> bool:
        return self.end_reason is not None

    def cancel(self, reason: str) -> None:
        """End the request before its stop or length ("cancelled": the client left; "abort": the server
        ended it); the first reason given stays."""
        self.end_reason = self.end_reason or reason

    @classmethod
    def create(cls, prompt_ids, sampling, max_tokens, stop=()) -> GenerationRequest:
        """Build on the event loop that will read the events (captures the running loop)."""
        return cls(list(prompt_ids), sampling, max_tokens, tuple(stop), asyncio.get_running_loop(), asyncio.Queue())


class Scheduler:
    """Owns the target, the drafter and the SpecBatch; runs on its own thread."""

    def __init__(self, target, drafter=None, config: ServerConfig = ServerConfig(), budget_policy=None,
                 metrics: ServerMetrics | None = None):
        """Sizes from `config` (checked there): --max-model-len against the model's window first (before
        the cost model measures anything), then the budget policy, then the KV budget against one
        max-length sequence. `budget_policy`: None = the one config.gamma asks for."""
        self.target, self.config = target, config
        self.max_model_len = config.context_length(target)
        self.metrics = metrics or ServerMetrics()
        policy = budget_policy or budget_policy_for(target, drafter, config.gamma)
        # size the cache so any prompt + max_tokens <= max_model_len fits with the largest draft block
        longest = kv_room(policy, drafter, self.max_model_len, 0)  # a max-length request
        budget, source = config.kv_budget(target)
        per_token = target.kv_bytes_per_token
        if budget < longest:
            raise ValueError(
                f"the KV memory budget holds {budget:,} tokens ({budget * per_token / 1e9:.2f} GB at {per_token:,} "
                f"B/token) but one sequence of --max-model-len {self.max_model_len:,} (+ draft room) needs {longest:,} "
                f"({longest * per_token / 1e9:.2f} GB): raise --kv-memory or lower --max-model-len"
            )
        log.info("KV budget: %s tokens (%s, %s B/token); max_model_len %s", f"{budget:,}", source, f"{per_token:,}",
                 self.max_model_len)
        self.kv_budget_tokens = budget  # KV token slots the running batch may hold (rows x longest reservation)
        self.batch = SpecBatch(target, drafter, policy, max_batch=config.max_running, max_len=longest,
                               kv_budget_tokens=budget)
        self._reserved: dict[object, int] = {}  # running sequence -> KV slots it may grow to
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._running: dict[object, GenerationRequest] = {}  # SpecBatch sequence -> request
        self._wake = threading.Condition()
        self._stopping = False
        self._aborting = False  # abort(): end every request now ("abort"), admit nothing more
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ public, any thread
    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.alive:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdec-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; QueueFullError when --max-queue requests already wait."""
        with self._wake:
            if not self.alive or self._stopping or self._aborting:
                raise SchedulerStoppedError("the generation scheduler is not running (the server is starting or stopping)")
            max_queue = self.config.max_queue
            if len(self._waiting) >= max_queue and len(self._running) + len(self._waiting) >= self.config.max_running:
                raise QueueFullError(f"server busy: {len(self._waiting)} requests already waiting (max {max_queue})")
            self._waiting.append(request)
            self._wake.notify_all()

    def cancel(self, request: GenerationRequest) -> None:
        """The client went away: the scheduler drops the request and frees its row before the next step."""
        with self._wake:
            request.cancel("cancelled")
            self._wake.notify_all()

    def abort(self) -> None:
        """End every request now, running or waiting, with finish_reason "abort" (their text so far), and
        admit nothing more: the bounded SIGTERM drain (serve.py). Handled between steps."""
        with self._wake:
            self._aborting = True
            self._wake.notify_all()

    # ------------------------------------------------------------------ the scheduler thread
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping:
                    break
                if self._aborting:
                    for request in [*self._waiting, *self._running.values()]:
                        request.cancel("abort")
                cancelled_waiting = [r for r in self._waiting if r.cancelled]
                for request in cancelled_waiting:
                    self._waiting.remove(request)
            for request in cancelled_waiting:
                self._finish_unstarted(request)
            self._drop_cancelled()  # before admitting, so freed rows are reused at once
            with self._wake:
                admitted = self._pop_admissible()
            if admitted:
                self._guarded(lambda: self._admit(admitted), admitted)
            if self.batch.seqs:
                self._guarded(self._step, list(self._running.values()))
            self._drop_orphans()
        self._fail_all("the server is shutting down")

    def _reservation(self, request: GenerationRequest) -> int:
        return self.batch.room_needed(len(request.prompt_ids), request.max_tokens)

    def _pop_admissible(self) -> list[GenerationRequest]:
        """Waiting requests (FIFO) that fit the free rows, the padded prefill budget (at least one) and the
        KV budget. The cache is one rectangle, so the KV budget must hold rows x the longest reservation."""
        room = self.config.max_running - len(self._running)
        admitted: list[GenerationRequest] = []
        longest = 0
        widest = max(self._reserved.values(), default=0)
        while self._waiting and len(admitted) < room:
            head = self._waiting[0]
            if head.cancelled:  # it leaves in the next round without taking a row
                admitted.append(self._waiting.popleft())
                continue
            # one admission prefill pads every prompt to the longest: cap rows x longest so a burst of long
            # prompts cannot stall the running sequences (or blow up attention memory) in one forward
            candidate = max(longest, len(head.prompt_ids))
            if admitted and (len(admitted) + 1) * candidate > self.config.max_prefill_tokens:
                break
            wider = max(widest, self._reservation(head))
            over_budget = (len(self._running) + len(admitted) + 1) * wider > self.kv_budget_tokens
            if over_budget and (self._running or admitted):  # alone it always fits (checked at start-up)
                break  # waits until running sequences finish and free KV memory
            admitted.append(self._waiting.popleft())
            longest, widest = candidate, wider
        return admitted

    def _guarded(self, action, affected: list[GenerationRequest]) -> None:
        """Run one batch action; on an unexpected error fail the affected requests, keep serving."""
        try:
            action()
        except Exception as error:  # noqa: BLE001 - a bug must not kill the server thread
            log.exception("generation failed")
            for request in affected:
                self._finish_with_error(request, f"generation failed: {type(error).__name__}: {error}")

    def _admit(self, requests: list[GenerationRequest]) -> None:
        live = [r for r in requests if not r.cancelled]
        for request in requests:
            if request.cancelled:
                self._finish_unstarted(request)
        if not live:
            return
        seqs = self.batch.add([r.prompt_ids for r in live], [r.sampling for r in live],
                              [r.max_tokens for r in live], [r.stop for r in live])
        self.metrics.record_forward(len(live), verify=False)
        for request, seq in zip(live, seqs):
            request.sequence = seq
            self._running[seq] = request
            self._reserved[seq] = self._reservation(request)
            self.metrics.record_admitted(len(request.prompt_ids))
        self._deliver(seqs)

    def _step(self) -> None:
        ran = self.batch.step()
        self.metrics.record_forward(len(ran), verify=True)
        self._deliver(ran)

    def _deliver(self, seqs) -> None:
        now = time.perf_counter()
        for seq in seqs:
            request = self._running.get(seq)
            if request is None:
                continue
            if seq.last_committed:
                if request.first_token_at is None:
                    request.first_token_at = now
                    self.metrics.record_first_token(now - request.arrival)
                self._push(request, TokensEvent(list(seq.last_committed)))
            if seq.done:
                self._finish(request, seq.finish_reason)

    def _drop_cancelled(self) -> None:
        for seq, request in list(self._running.items()):
            if request.cancelled:
                if seq in self.batch.seqs:
                    self.batch.remove(seq)  # frees the cache row now
                self._finish(request, request.end_reason)

    def _drop_orphans(self) -> None:
        """A request whose sequence left the batch without being delivered (cannot happen) must not hang."""
        if len(self._running) != len(self.batch.seqs):
            for seq, request in list(self._running.items()):
                if seq not in self.batch.seqs:
                    self._finish(request, seq.finish_reason or "cancelled")

    def _finish(self, request: GenerationRequest, reason: str) -> None:
        seq = request.sequence
        self._running.pop(seq, None)
        self._reserved.pop(seq, None)
        output = list(seq.ctx.output_tokens)
        text = seq.output_text(self.target)
        decode_seconds = time.perf_counter() - request.first_token_at if request.first_token_at else None
        self.metrics.record_finished(seq.stats, reason, decode_seconds)
        self._push(request, FinishedEvent(reason, text, output, seq.stats))

    def _finish_unstarted(self, request: GenerationRequest) -> None:
        """Cancelled (or aborted) while still waiting: it never took a row."""
        stats = SpecStats()
        self.metrics.record_finished(stats, request.end_reason, None)
        self._push(request, FinishedEvent(request.end_reason, "", [], stats))

    def _finish_with_error(self, request: GenerationRequest, message: str) -> None:
        seq = request.sequence
        if seq is not None:
            self._running.pop(seq, None)
            self._reserved.pop(seq, None)
            if seq in self.batch.seqs:
                try:
                    self.batch.remove(seq)
                except Exception:  # noqa: BLE001 - the row is reset on the next add anyway
                    log.exception("could not free a cache row")
        stats = seq.stats if seq is not None else SpecStats()
        self.metrics.record_finished(stats, "error", None)
        self._push(request, FinishedEvent("error", "", [], stats, error=message))

    def _fail_all(self, message: str) -> None:
        with self._wake:
            waiting = list(self._waiting)
            self._waiting.clear()
        for request in waiting + list(self._running.values()):
            self._finish_with_error(request, message)

    @staticmethod
    def _push(request: GenerationRequest, event) -> None:
        try:
            request.loop.call_soon_threadsafe(request.events.put_nowait, event)
        except RuntimeError:  # the client's event loop is closed: nobody is listening
            pass
