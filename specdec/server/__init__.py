"""OpenAI-compatible HTTP server with continuous batching and load-aware speculation (`specdec serve`)."""

from .app import create_app
from ..streaming import TextDeltas
from .config import ServerConfig
from .scheduler import Scheduler

__all__ = ["Scheduler", "ServerConfig", "TextDeltas", "create_app"]
