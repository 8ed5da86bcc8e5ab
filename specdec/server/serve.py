"""`specdec serve`: the command line -> one ServerConfig -> the app, under uvicorn.

Everything a user can get wrong is refused before the model loads: the settings (ServerConfig),
the drafter options, and the address (a port another process holds). SIGTERM drains with a bound:
in-flight generations run on for at most --shutdown-timeout seconds, then end with finish_reason
"abort" (their streams still get a last chunk and [DONE]) and the process exits.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

import uvicorn

from ..kv_cache import DEFAULT_KV_MEMORY_FRACTION
from ..models import add_weights_argument
from ..models.registry import DEFAULT_MODEL
from .config import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_MODEL_LEN, DEFAULT_SHUTDOWN_TIMEOUT_S, SHUTDOWN_GRACE_S, ServerConfig

log = logging.getLogger("specdec.server")


def add_serve_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, HF model directory, or .gguf file")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--drafter", default="auto",
                        help="drafter name (see `specdec drafters`); default auto: per request the method that earns the "
                             "most tokens/s here (plain, suffix, pld, hybrid); none = plain decoding")
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
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                        help="on SIGTERM, let in-flight requests run this long, then end them with finish_reason "
                             "'abort' and exit")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def check_port_free(host: str, port: int) -> None:
    """Bind-test every address uvicorn will listen on (asyncio's create_server: getaddrinfo with
    AI_PASSIVE, SO_REUSEADDR, IPv6 sockets v6-only, an address family the machine lacks skipped), so
    a port another process holds is one error line before the model loads, not uvicorn's log after."""
    try:
        addresses = set(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))
    except socket.gaierror as error:
        raise ValueError(f"--host {host}: cannot resolve the address ({error.strerror})") from None
    usable = 0
    for family, kind, proto, _, address in sorted(addresses, key=str):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
                usable += 1
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise ValueError(f"port {port} is in use on {address[0]}: stop what holds it or choose another "
                                     "--port") from None
                if error.errno != errno.EADDRNOTAVAIL:  # asyncio skips those (a family not enabled here)
                    raise ValueError(f"cannot listen on {address[0]} port {port}: {error.strerror}") from None
    if not usable:
        raise ValueError(f"cannot listen on {host} port {port}: no address of it is available on this machine")


class DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown with a bound: `drain_s` after SIGTERM the scheduler ends every
    generation still running ("abort"), so each stream gets its last chunk and [DONE] and the
    connections close. uvicorn's timeout_graceful_shutdown, SHUTDOWN_GRACE_S later, is the backstop
    for a step that does not end."""

    def __init__(self, config: uvicorn.Config, scheduler, drain_s: float):
        super().__init__(config)
        self.scheduler, self.drain_s = scheduler, drain_s

    async def shutdown(self, sockets=None):
        abort = asyncio.get_running_loop().call_later(self.drain_s, self._abort)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()

    def _abort(self) -> None:
        log.warning("shutdown timeout (%g s) reached: ending %d running and %d waiting requests with finish_reason "
                    "'abort'", self.drain_s, self.scheduler.running, self.scheduler.queue_length)
        self.scheduler.abort()


def run_serve(args) -> int:
    from ..api import load_target
    from ..drafters import drafter_options, make_drafter
    from .app import create_app

    config = ServerConfig.from_args(args)  # every setting checked once, here, before anything loads
    drafter_name = None if args.drafter == "none" else args.drafter
    options = drafter_options(drafter_name, args.drafter_arg) if drafter_name else {}
    if args.drafter_arg and not drafter_name:
        raise ValueError("--drafter-arg needs a drafter (--drafter none is plain decoding)")
    check_port_free(config.host, config.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    target = load_target(args.model, dtype=args.dtype, weights=args.weights)
    drafter = make_drafter(drafter_name, target, **options) if drafter_name else None
    app = create_app(target, drafter, config)
    log.info("serving %s (drafter %s, gamma %s) on http://%s:%d/v1", args.model, args.drafter, config.gamma,
             config.host, config.port)
    uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=args.log_level,
                                    timeout_graceful_shutdown=config.shutdown_timeout + SHUTDOWN_GRACE_S)
    DrainingServer(uvicorn_config, app.state.scheduler, config.shutdown_timeout).run()
    return 0
