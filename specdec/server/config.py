"""The serving settings: one validated value, built once (from `specdec serve`'s arguments or by
`create_app(**settings)`) and passed down whole to the app, the scheduler and the uvicorn server.

Every setting is checked here and only here, before any model is loaded; the layers below trust
it. What needs the loaded target (--max-model-len against the context window, the KV budget in
tokens) is resolved once by `context_length` / `kv_budget`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from ..budget import parse_gamma
from ..checks import check_int
from ..kv_cache import DEFAULT_KV_MEMORY_FRACTION, kv_budget_tokens

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_MODEL_LEN = 2048  # tokens per request when the model's window is longer
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # SIGTERM: in-flight generations may run this long, then end with "abort"
SHUTDOWN_GRACE_S = 5.0  # after that: for the step in progress to end and the streams to flush (the backstop's wait)

# the command-line flag of each setting whose flag is not --<name with dashes>
_FLAGS = {"model_name": "--served-model-name", "kv_memory_gb": "--kv-memory"}


def flag(name: str) -> str:
    """The `specdec serve` flag of a setting (error messages name what the user typed)."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


@dataclass(frozen=True)
class ServerConfig:
    model_name: str | None = None  # the model id clients send (None: the target's name)
    gamma: int | str | None = None  # None (the drafter's default block), an int >= 0 or "auto"
    max_running: int = 8  # sequences in the running batch
    max_queue: int = 64  # waiting requests before answering 429
    max_model_len: int | None = None  # prompt + completion per request (None: the window, at most DEFAULT_MAX_MODEL_LEN)
    api_key: str | None = field(default=None, repr=False)  # 'Authorization: Bearer KEY' on all but /health
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = 512  # max_tokens of a request that gives none
    max_prefill_tokens: int = 4096  # rows x longest prompt of one admission prefill
    kv_memory_gb: float | None = None  # KV budget in GB (None: kv_memory_fraction of the memory available)
    kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S  # seconds a SIGTERM drain may take
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self):
        object.__setattr__(self, "gamma", parse_gamma(self.gamma))
        for name in ("max_running", "max_body_bytes", "default_max_tokens", "max_prefill_tokens"):
            check_int(flag(name), getattr(self, name), 1)
        check_int(flag("max_queue"), self.max_queue, 0)
        check_int(flag("port"), self.port, 0, 65535)
        if self.max_model_len is not None:
            check_int(flag("max_model_len"), self.max_model_len, 2)
        if self.kv_memory_gb is not None and not (math.isfinite(self.kv_memory_gb) and self.kv_memory_gb > 0):
            raise ValueError(f"--kv-memory must be a number of GB > 0, got {self.kv_memory_gb}")
        if not 0 < self.kv_memory_fraction <= 1:  # NaN fails this too
            raise ValueError(f"--kv-memory-fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if not (math.isfinite(self.shutdown_timeout) and self.shutdown_timeout >= 0):
            raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {self.shutdown_timeout}")
        if not self.host:
            raise ValueError("--host must not be empty")

    @classmethod
    def from_args(cls, args) -> ServerConfig:
        """The settings of a `specdec serve` command line (add_serve_arguments)."""
        renamed = {"model_name": args.served_model_name or args.model, "kv_memory_gb": args.kv_memory}
        return cls(**renamed, **{each.name: getattr(args, each.name) for each in fields(cls) if each.name not in renamed})

    def context_length(self, target) -> int:
        """Prompt + completion tokens per request: --max-model-len, never past the model's window."""
        window = target.context_window
        if self.max_model_len is None:
            return min(DEFAULT_MAX_MODEL_LEN, window)
        if self.max_model_len > window:
            raise ValueError(f"--max-model-len {self.max_model_len:,} exceeds {target.name}'s context window of "
                             f"{window:,} tokens (max_position_embeddings): use at most {window:,}")
        return self.max_model_len

    def kv_budget(self, target) -> tuple[int, str]:
        """KV token slots the running batch may hold, and where that number came from."""
        return kv_budget_tokens(target.kv_bytes_per_token, self.kv_memory_gb, self.kv_memory_fraction)

    def served_names(self, target) -> list[str]:
        """Model ids clients may send: --served-model-name first (listed by /v1/models), then the target's own."""
        first = self.model_name or target.name
        return [first] + ([target.name] if first != target.name else [])
