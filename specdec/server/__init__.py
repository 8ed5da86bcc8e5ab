"""OpenAI-compatible HTTP server with continuous batching and load-aware speculation (`specdec serve`)."""

from .app import create_app
from .scheduler import Scheduler, TextDeltas

__all__ = ["Scheduler", "TextDeltas", "create_app"]
