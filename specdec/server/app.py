"""The OpenAI-compatible HTTP app: `create_app(target, drafter, config)` (`specdec serve`: serve.py).

Routes: POST /v1/chat/completions, POST /v1/completions (both streaming via SSE or not),
GET /v1/models, GET /health, GET /metrics (Prometheus text). Every request runs through one
background `Scheduler` thread (continuous batching); handlers only parse, tokenise, queue and
format. Errors are OpenAI-style bodies: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..checks import check_text
from ..models.base import ContextLengthError
from ..sampling import SamplingParams, make_generator
from ..streaming import TextDeltas
from .config import SHUTDOWN_GRACE_S, ServerConfig
from .metrics import ServerMetrics
from .scheduler import FinishedEvent, GenerationRequest, QueueFullError, Scheduler, SchedulerStoppedError, TokensEvent
from .schemas import ChatCompletionRequest, CompletionRequest, describe_validation_error, error_body

log = logging.getLogger("specdec.server")

DISCONNECT_POLL_S = 0.25
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
OPEN_ROUTES = ("/health",)  # answered without the API key
RETRY_AFTER_S = 1  # what a 429 (queue full) asks clients to wait


class ApiError(Exception):
    """An error answered with an OpenAI-style body and an HTTP status."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param, self.code = status, message, error_type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.error_type, self.param, self.code), status_code=self.status,
                            headers=self.headers)


class _GuardMiddleware:
    """Pure ASGI middleware: API key, body size (Content-Length) and per-route status counting.

    Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass
    through untouched."""

    def __init__(self, app, config: ServerConfig, metrics: ServerMetrics):
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, config.api_key, config.max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status_seen = []

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
                self.metrics.record_request(route, message["status"])
            await send(message)

        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        rejection = self._reject(scope["path"], headers)
        if rejection is not None:
            return await rejection.response()(scope, receive, counting_send)
        await self.app(scope, receive, counting_send)

    def _reject(self, path: str, headers: dict) -> ApiError | None:
        # /health stays open: liveness probes cannot send a key (vLLM guards /v1/* the same way)
        if self.api_key is not None and path not in OPEN_ROUTES:
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                "authentication_error", code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return ApiError(400, f"invalid Content-Length header {length!r}")
            if int(length) > self.max_body_bytes:
                return ApiError(413, f"request body is {length} bytes; the limit is {self.max_body_bytes}",
                                code="request_too_large")
        return None


class _GenerationStream(StreamingResponse):
    """SSE response that cancels its generation however it ends (disconnect, error, never started)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _ChatFormat:
    """Bodies of /v1/chat/completions."""

    id_prefix, object_name, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(text: str, finish_reason: str) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    @staticmethod
    def chunk_choice(text: str | None, finish_reason: str | None, first: bool = False) -> dict:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


class _CompletionFormat:
    """Bodies of /v1/completions."""

    id_prefix, object_name, chunk_object = "cmpl-", "text_completion", "text_completion"

    @staticmethod
    def choice(text: str, finish_reason: str) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    @staticmethod
    def chunk_choice(text: str | None, finish_reason: str | None, first: bool = False) -> dict:
        return None if first else {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}


def usage_body(prompt_tokens: int, finished: FinishedEvent) -> dict:
    """OpenAI usage plus this request's speculative figures."""
    stats = finished.stats
    completion_tokens = len(finished.output_tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "mean_accepted_length": round(stats.tau, 4),  # tokens per verify step: accepted + bonus
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "target_forwards": stats.target_forwards,
    }


class _Server:
    """The state behind the routes: target, scheduler, limits, served model names."""

    def __init__(self, target, scheduler: Scheduler):
        self.target, self.scheduler, self.config = target, scheduler, scheduler.config
        self.model_names = self.config.served_names(target)
        self.max_body_bytes = self.config.max_body_bytes
        self.created = int(time.time())

    # ------------------------------------------------------------------ request parsing
    async def read_json(self, request: Request) -> dict:
        body = bytearray()
        async for piece in request.stream():  # chunked bodies have no Content-Length: count here too
            body += piece
            if len(body) > self.max_body_bytes:
                raise ApiError(413, f"request body is larger than the limit of {self.max_body_bytes} bytes",
                               code="request_too_large")
        try:
            data = json.loads(bytes(body))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ApiError(400, f"request body is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
        _check_unicode(data, "")
        return data

    @staticmethod
    def parse(schema, data: dict):
        try:
            return schema.model_validate(data)
        except ValidationError as error:
            message, param = describe_validation_error(error)
            raise ApiError(400, message, param=param) from None

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_names[0]!r}",
                           param="model", code="model_not_found")

    def limits(self, prompt_ids: list[int], requested: int | None) -> int:
        """max_tokens for this request (none given: --default-max-tokens, cut to the room the prompt
        leaves), or a 400 from the one size rule (Target.check_fits) against --max-model-len."""
        prompt_len, context = len(prompt_ids), self.scheduler.max_model_len
        room = max(context - prompt_len, 1)  # a prompt past the context is refused below, with its own words
        max_tokens = requested if requested is not None else min(self.config.default_max_tokens, room)
        try:
            self.target.check_fits(prompt_len, max_tokens, max_len=context, budget_name="max_tokens")
        except ContextLengthError as error:
            raise ApiError(400, str(error), param="messages" if error.prompt_too_long else "max_tokens",
                           code="context_length_exceeded") from None
        except ValueError as error:
            raise ApiError(400, str(error), param="max_tokens") from None
        return max_tokens

    @staticmethod
    def sampling(params) -> SamplingParams:
        try:
            sampling = SamplingParams(params.temperature, max(params.top_k, 0), params.top_p, params.seed)
            make_generator(sampling.seed)  # the scheduler builds one per sequence: fail here, not there
        except (ValueError, OverflowError, RuntimeError) as error:
            raise ApiError(400, str(error)) from None
        return sampling

    def encode(self, prompt) -> list[int]:
        try:
            if isinstance(prompt, str):  # /v1/completions: raw text, no chat template
                ids = list(self.target.tokenizer(prompt)["input_ids"])
                if not ids:
                    raise ValueError("prompt is empty")
                return self.target.encode_prompt(ids)
            return self.target.encode_prompt(prompt)
        except (ValueError, TypeError) as error:
            raise ApiError(400, str(error), param="prompt") from None

    # ------------------------------------------------------------------ serving one request
    async def serve(self, http_request: Request, params, prompt_ids: list[int], fmt):
        max_tokens = self.limits(prompt_ids, params.requested_max_tokens)
        job = GenerationRequest.create(prompt_ids, self.sampling(params), max_tokens, params.stop_strings)
        try:
            self.scheduler.submit(job)
        except QueueFullError as error:
            raise ApiError(429, str(error), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except SchedulerStoppedError as error:
            raise ApiError(503, str(error), "server_error") from None
        response_id = fmt.id_prefix + uuid.uuid4().hex[:24]
        model = params.model
        if params.stream:
            stream = self._stream(job, params, fmt, response_id, model)
            return _GenerationStream(stream, on_close=lambda: self.scheduler.cancel(job))
        try:
            finished = await self._wait_finished(job, http_request)
        finally:
            self.scheduler.cancel(job)  # no-op when it finished; frees the row when the handler was cancelled
        if finished.error is not None:
            raise ApiError(500, finished.error, "server_error")
        return JSONResponse({
            "id": response_id, "object": fmt.object_name, "created": int(time.time()), "model": model,
            "choices": [fmt.choice(finished.text, finished.finish_reason)],
            "usage": usage_body(len(prompt_ids), finished),
        })

    async def _wait_finished(self, job: GenerationRequest, http_request: Request) -> FinishedEvent:
        async def watch_disconnect():
            while not await http_request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            self.scheduler.cancel(job)  # the scheduler answers with a "cancelled" FinishedEvent

        watcher = asyncio.create_task(watch_disconnect())
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, FinishedEvent):
                    return event
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _stream(self, job: GenerationRequest, params, fmt, response_id: str, model: str):
        created = int(time.time())

        def chunk(choice, usage=None) -> str:
            body = {"id": response_id, "object": fmt.chunk_object, "created": created, "model": model,
                    "choices": [choice] if choice is not None else []}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        first = fmt.chunk_choice(None, None, first=True)
        if first is not None:
            yield chunk(first)
        deltas = TextDeltas(self.target.decode, params.stop_strings)
        while True:
            event = await job.events.get()
            if isinstance(event, TokensEvent):
                text = deltas.push(event.tokens)
                if text:
                    yield chunk(fmt.chunk_choice(text, None))
                continue
            if event.error is not None:
                yield f"data: {json.dumps(error_body(event.error, 'server_error'))}\n\n"
                return
            rest = deltas.finish(event.text)
            if rest:
                yield chunk(fmt.chunk_choice(rest, None))
            yield chunk(fmt.chunk_choice(None, event.finish_reason))
            if params.include_usage:
                yield chunk(None, usage_body(len(job.prompt_ids), event))
            yield "data: [DONE]\n\n"
            return


def create_app(target, drafter=None, config: ServerConfig | None = None, *, budget_policy=None, **settings) -> FastAPI:
    """A FastAPI app serving `target` (optionally speculating with `drafter`) under `config`, or under
    `ServerConfig(**settings)` when none is given (create_app(target, max_running=4, gamma="auto")).

    gamma None (drafter default), an int (fixed draft budget) or "auto" (load-aware cost model; drafts
    with confidences are cut across the batch by specdec.schedule.admit); or pass `budget_policy`
    directly. The scheduler thread starts with the app (lifespan) and stops with it.
    """
    if config is None:
        config = ServerConfig(**settings)
    elif settings:
        raise TypeError(f"give a ServerConfig or its settings, not both (got {sorted(settings)} beside the config)")
    metrics = ServerMetrics()
    scheduler = Scheduler(target, drafter, config, budget_policy, metrics)
    metrics.watch(queue_length=lambda: scheduler.queue_length, running=lambda: scheduler.running)
    server = _Server(target, scheduler)
    app = FastAPI(title="specdec", lifespan=_lifespan(scheduler))
    app.state.server, app.state.scheduler, app.state.metrics = server, scheduler, metrics
    app.add_middleware(_GuardMiddleware, config=config, metrics=metrics)
    _add_error_handlers(app)
    _add_routes(app, server, metrics)
    return app


def _lifespan(scheduler: Scheduler):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop, SHUTDOWN_GRACE_S)  # requests have ended: never waits long

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is an OpenAI-style body; an unexpected one is a 500 that names only its type."""

    @app.exception_handler(ApiError)
    async def _api_error(request, error: ApiError):
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(error.detail), kind), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request, error: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(error).__name__}", "server_error"), status_code=500)


def _add_routes(app: FastAPI, server: _Server, metrics: ServerMetrics) -> None:
    scheduler = server.scheduler

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        params = server.parse(ChatCompletionRequest, await server.read_json(request))
        server.check_model(params.model)
        try:
            messages = params.chat_messages()
        except ValueError as error:
            raise ApiError(400, str(error), param="messages") from None
        return await server.serve(request, params, server.encode(messages), _ChatFormat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        params = server.parse(CompletionRequest, await server.read_json(request))
        server.check_model(params.model)
        try:
            prompt = params.single_prompt()
        except ValueError as error:
            raise ApiError(400, str(error), param="prompt") from None
        return await server.serve(request, params, server.encode(prompt), _CompletionFormat)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(server.model_names[0], server.created)]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        server.check_model(name)
        return _model_card(name, server.created)

    @app.get("/health")
    async def health():
        ok = scheduler.alive
        body = {"status": "ok" if ok else "scheduler stopped", "running": scheduler.running, "waiting": scheduler.queue_length}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _check_unicode(value, path: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer can encode: a 400 naming the field."""
    if isinstance(value, str):
        try:
            check_text(path or "body", value)
        except ValueError as error:
            raise ApiError(400, str(error), param=path.split(".")[0].split("[")[0] or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_unicode(item, f"{path}[{index}]")


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "specdec"}
