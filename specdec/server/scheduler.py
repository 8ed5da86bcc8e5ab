"""Continuous batching: one background thread owns the target and the SpecBatch.

HTTP handlers never touch torch. They `submit()` a `GenerationRequest` and read its events
from an asyncio queue; the scheduler thread loops:

    1. drop cancelled requests (waiting: forget them; running: `batch.remove`, freeing the row)
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

from ..budget import FixedBudget
from ..loop import SpecBatch, kv_room
from ..sampling import SamplingParams
from ..stats import SpecStats
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
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
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
    cancelled: bool = False  # set from the event loop; read by the scheduler between steps
    sequence: object | None = None  # the SpecBatch sequence while admitted

    @classmethod
    def create(cls, prompt_ids, sampling, max_tokens, stop=()) -> GenerationRequest:
        """Build on the event loop that will read the events (captures the running loop)."""
        return cls(list(prompt_ids), sampling, max_tokens, tuple(stop), asyncio.get_running_loop(), asyncio.Queue())


def check_max_model_len(target, max_model_len: int) -> None:
    """A server never promises more positions than the model has (its context window)."""
    if max_model_len > target.context_window:
        raise ValueError(f"--max-model-len {max_model_len:,} exceeds {target.name}'s context window of "
                         f"{target.context_window:,} tokens (max_position_embeddings): use at most {target.context_window:,}")


class Scheduler:
    """Owns the target, the drafter and the SpecBatch; runs on its own thread."""

    def __init__(self, target, drafter=None, budget_policy=None, max_running: int = 8, max_queue: int = 64,
                 max_model_len: int = 2048, metrics: ServerMetrics | None = None, max_prefill_tokens: int = 4096,
                 kv_budget_tokens: int | None = None):
        """`kv_budget_tokens`: KV token slots the running batch may hold (rows x longest reservation); None = no cap."""
        if max_running < 1 or max_queue < 0 or max_model_len < 2 or max_prefill_tokens < 1:
            raise ValueError(f"need max_running >= 1, max_queue >= 0, max_model_len >= 2, max_prefill_tokens >= 1; "
                             f"got {max_running}, {max_queue}, {max_model_len}, {max_prefill_tokens}")
        check_max_model_len(target, max_model_len)
        self.target = target
        self.max_running, self.max_queue, self.max_model_len = max_running, max_queue, max_model_len
        # one admission prefill pads every prompt to the longest: cap rows x longest so a burst of long
        # prompts cannot stall the running sequences (or blow up attention memory) in one forward
        self.max_prefill_tokens = max_prefill_tokens
        self.metrics = metrics or ServerMetrics()
        policy = budget_policy or FixedBudget()
        # size the cache so any prompt + max_tokens <= max_model_len fits with the largest draft block
        longest = kv_room(policy, drafter, max_model_len, 0)  # a max-length request
        if kv_budget_tokens is not None and kv_budget_tokens < longest:
            per_token = target.kv_bytes_per_token
            raise ValueError(
                f"the KV memory budget holds {kv_budget_tokens:,} tokens ({kv_budget_tokens * per_token / 1e9:.2f} GB at "
                f"{per_token:,} B/token) but one sequence of --max-model-len {max_model_len:,} (+ draft room) needs "
                f"{longest:,} ({longest * per_token / 1e9:.2f} GB): raise --kv-memory or lower --max-model-len"
            )
        self.kv_budget_tokens = kv_budget_tokens
        self.batch = SpecBatch(target, drafter, policy, max_batch=max_running, max_len=longest,
                               kv_budget_tokens=kv_budget_tokens)
        self._reserved: dict[object, int] = {}  # running sequence -> KV slots it may grow to
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._running: dict[object, GenerationRequest] = {}  # SpecBatch sequence -> request
        self._wake = threading.Condition()
        self._stopping = False
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
            if not self.alive or self._stopping:
                raise SchedulerStoppedError("the generation scheduler is not running")
            if len(self._waiting) >= self.max_queue and len(self._running) + len(self._waiting) >= self.max_running:
                raise QueueFullError(f"server busy: {len(self._waiting)} requests already waiting (max {self.max_queue})")
            self._waiting.append(request)
            self._wake.notify_all()

    def cancel(self, request: GenerationRequest) -> None:
        """The client went away: the scheduler drops the request and frees its row before the next step."""
        with self._wake:
            request.cancelled = True
            self._wake.notify_all()

    # ------------------------------------------------------------------ the scheduler thread
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping:
                    break
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
        room = self.max_running - len(self._running)
        admitted: list[GenerationRequest] = []
        longest = 0
        widest = max(self._reserved.values(), default=0)
        while self._waiting and len(admitted) < room:
            head = self._waiting[0]
            if head.cancelled:  # it leaves in the next round without taking a row
                admitted.append(self._waiting.popleft())
                continue
            candidate = max(longest, len(head.prompt_ids))
            if admitted and (len(admitted) + 1) * candidate > self.max_prefill_tokens:
                break
            wider = max(widest, self._reservation(head))
            over_budget = self.kv_budget_tokens is not None and (len(self._running) + len(admitted) + 1) * wider > self.kv_budget_tokens
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
                self._finish(request, "cancelled")

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
        """Cancelled while still waiting: it never took a row."""
        stats = SpecStats()
        self.metrics.record_finished(stats, "cancelled", None)
        self._push(request, FinishedEvent("cancelled", "", [], stats))

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
