"""Where specdec keeps what it downloads, converts, measures and compiles."""

from __future__ import annotations

import json
import os
from pathlib import Path

CACHE_ENV_VAR = "SPECDEC_CACHE"
MARKER_FILE = "specdec.json"  # written last into a converted model dir; its presence = complete


def cache_root() -> Path:
    """Root of every cached artefact (models, cost tables, compiled kernels): $SPECDEC_CACHE, else ~/.cache/specdec."""
    configured = os.environ.get(CACHE_ENV_VAR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specdec"


def read_marker(model_dir: Path | str) -> dict | None:
    """A converted model dir's marker (registry name, source GGUF, converter version), None when absent or unreadable."""
    try:
        return json.loads((Path(model_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
