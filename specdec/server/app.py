"""The OpenAI-compatible HTTP server: `specdec serve` and `create_app(target, drafter, ...)`.

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

from ..budget import budget_policy_for, parse_gamma
from ..checks import check_text
from ..kv_cache import DEFAULT_KV_MEMORY_FRACTION, kv_budget_tokens
from ..models.registry import DEFAULT_MODEL
from ..sampling import SamplingParams, make_generator
from .metrics import ServerMetrics
from ..models import add_weights_argument
from ..streaming import TextDeltas
from .scheduler import (FinishedEvent, GenerationRequest, QueueFullError, Scheduler, SchedulerStoppedError, TokensEvent,
                        check_max_model_len)
from .schemas import ChatCompletionRequest, CompletionRequest, describe_validation_error, error_body

log = logging.getLogger("specdec.server")

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_MODEL_LEN = 2048  # tokens per request when the model's window is longer
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

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics):
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

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

    def __init__(self, target, scheduler: Scheduler, model_names: list[str], max_model_len: int,
                 default_max_tokens: int, max_body_bytes: int):
        self.target, self.scheduler = target, scheduler
        self.model_names = model_names
        self.max_model_len, self.default_max_tokens, self.max_body_bytes = max_model_len, default_max_tokens, max_body_bytes
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
        """max_tokens for this request, or a 400 saying which limit it breaks."""
        prompt_len, context = len(prompt_ids), self.max_model_len
        if requested is not None and requested < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {requested}", param="max_tokens")
        if requested is not None and requested > context:
            raise ApiError(400, f"max_tokens ({requested}) is larger than the context length ({context} tokens)",
                           param="max_tokens")
        if prompt_len >= context:
            raise ApiError(400, f"the prompt is {prompt_len} tokens; the context length is {context} tokens "
                                "(prompt + completion): shorten the prompt", param="messages", code="context_length_exceeded")
        max_tokens = requested if requested is not None else min(self.default_max_tokens, context - prompt_len)
        if prompt_len + max_tokens > context:
            raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
                                f"exceeds the context length of {context} tokens: shorten the prompt or lower max_tokens",
                           param="max_tokens", code="context_length_exceeded")
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


def create_app(target, drafter=None, *, gamma=None, budget_policy=None, model_name: str | None = None,
               max_running: int = 8, max_queue: int = 64, max_model_len: int | None = None, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, default_max_tokens: int = 512,
               max_prefill_tokens: int = 4096, kv_memory_gb: float | None = None,
               kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION) -> FastAPI:
    """A FastAPI app serving `target` (optionally speculating with `drafter`).

    gamma: None (drafter default), an int (fixed draft budget) or "auto" (load-aware cost model; drafts
    with confidences are cut across the batch by specdec.schedule.admit);
    or pass `budget_policy` directly. max_model_len: prompt + completion per request (default: the
    model's context window, at most DEFAULT_MAX_MODEL_LEN). KV memory: `kv_memory_gb`, else
    `kv_memory_fraction` of the memory available now; requests beyond it wait in the queue.
    The scheduler thread starts with the app (lifespan) and stops with it.
    """
    if default_max_tokens < 1 or max_body_bytes < 1:
        raise ValueError(f"default_max_tokens and max_body_bytes must be >= 1, got {default_max_tokens}, {max_body_bytes}")
    if max_model_len is None:
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, target.context_window)
    check_max_model_len(target, max_model_len)  # before the cost model measures anything
    kv_tokens, kv_source = kv_budget_tokens(target.kv_bytes_per_token, kv_memory_gb, kv_memory_fraction)
    metrics = ServerMetrics()
    policy = budget_policy or budget_policy_for(target, drafter, gamma)
    scheduler = Scheduler(target, drafter, policy, max_running, max_queue, max_model_len, metrics, max_prefill_tokens,
                          kv_budget_tokens=kv_tokens)
    log.info("KV budget: %s tokens (%s, %s B/token); max_model_len %s", f"{kv_tokens:,}", kv_source,
             f"{target.kv_bytes_per_token:,}", max_model_len)
    metrics.watch(queue_length=lambda: scheduler.queue_length, running=lambda: scheduler.running)
    names = [model_name or target.name] + ([target.name] if model_name and model_name != target.name else [])
    server = _Server(target, scheduler, names, max_model_len, default_max_tokens, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.server, app.state.scheduler, app.state.metrics = server, scheduler, metrics
    app.add_middleware(_GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)

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
        return {"object": "list", "data": [_model_card(name, server.created) for name in names[:1]]}

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

    return app


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


# ---------------------------------------------------------------------------- `specdec serve`


def add_serve_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, HF model directory, or .gguf file")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--drafter", default=None, help="drafter name (see `specdec drafters`); none = plain decoding")
    parser.add_argument("--drafter-arg", action="append", default=[], metavar="KEY=VALUE", help="drafter option")
    parser.add_argument("--gamma", default="auto", help="draft budget per step: an int (that block, verified whole), or 'auto' "
                        "(load-aware cost model; a drafter with confidences is cut by the scheduler across the batch)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_weights_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /metrics "
                                                        "(/health stays open for liveness probes)")
    parser.add_argument("--max-running", type=int, default=8, help="sequences in the running batch")
    parser.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help=f"prompt + completion tokens per request (default: the model's context window, at most "
                             f"{DEFAULT_MAX_MODEL_LEN}; never more than the window)")
    parser.add_argument("--kv-memory", type=float, default=None, metavar="GB",
                        help="KV cache memory budget in GB (default: --kv-memory-fraction of the memory available at "
                             "start-up); requests that do not fit wait in the queue")
    parser.add_argument("--kv-memory-fraction", type=float, default=DEFAULT_KV_MEMORY_FRACTION,
                        help="share of the available memory the KV cache may take when --kv-memory is not given")
    parser.add_argument("--default-max-tokens", type=int, default=512, help="max_tokens when a request gives none")
    parser.add_argument("--max-prefill-tokens", type=int, default=4096,
                        help="admit waiting requests while rows x longest prompt stays under this (one prefill)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="request body limit (413)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run_serve(args) -> int:
    import uvicorn

    from ..api import load_target
    from ..drafters import drafter_options, make_drafter

    gamma = parse_gamma(args.gamma)
    for name in ("max_running", "max_model_len", "default_max_tokens", "max_body_bytes", "max_prefill_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    options = drafter_options(args.drafter, args.drafter_arg) if args.drafter else {}
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    target = load_target(args.model, dtype=args.dtype, weights=args.weights)
    drafter = make_drafter(args.drafter, target, **options) if args.drafter else None
    app = create_app(target, drafter, gamma=gamma, model_name=args.served_model_name or args.model,
                     max_running=args.max_running, max_queue=args.max_queue, max_model_len=args.max_model_len,
                     api_key=args.api_key, max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
                     max_prefill_tokens=args.max_prefill_tokens, kv_memory_gb=args.kv_memory,
                     kv_memory_fraction=args.kv_memory_fraction)
    log.info("serving %s (drafter %s, gamma %s) on http://%s:%d/v1", args.model, args.drafter or "none", gamma,
             args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
