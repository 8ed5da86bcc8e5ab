"""Where specdec keeps what it downloads, converts, measures and compiles."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

CACHE_ENV_VAR = "SPECDEC_CACHE"
# in a directory specdec wrote: a converted model in the cache (written last: its presence = complete),
# or an output directory (specdec.files: what it holds)
MARKER_FILE = "specdec.json"
# a write that fails for one of these means the cache directory itself cannot be written
_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENOSPC, errno.EDQUOT}


class CacheNotWritable(OSError):
    """specdec needs to write under its cache directory and cannot."""


def cache_root() -> Path:
    """Root of every cached artefact (models, cost tables, compiled kernels): $SPECDEC_CACHE, else ~/.cache/specdec."""
    configured = os.environ.get(CACHE_ENV_VAR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specdec"


def read_marker(model_dir: Path | str) -> dict | None:
    """The specdec.json marker of a directory specdec wrote (a converted model's: registry name, source GGUF,
    converter version; an output directory's: what it holds), None when absent or unreadable."""
    try:
        return json.loads((Path(model_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def writing_cache(what: str):
    """Around a write that must go into the cache: a failure because the cache cannot be written
    becomes one error naming the cache directory and SPECDEC_CACHE instead of a bare errno."""
    try:
        yield
    except CacheNotWritable:
        raise
    except OSError as error:
        if error.errno not in _NOT_WRITABLE:
            raise
        raise CacheNotWritable(
            f"cannot write {what} into the specdec cache {cache_root()} ({error.strerror}: {error.filename}); "
            f"make it writable or point {CACHE_ENV_VAR} at a writable directory"
        ) from error
