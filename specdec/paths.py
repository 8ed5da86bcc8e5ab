"""Where specdec keeps what it downloads, converts, measures and compiles."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "SPECDEC_CACHE"


def cache_root() -> Path:
    """Root of every cached artefact (models, cost tables, compiled kernels): $SPECDEC_CACHE, else ~/.cache/specdec."""
    configured = os.environ.get(CACHE_ENV_VAR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specdec"
