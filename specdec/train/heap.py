"""Handing a training process's freed heap pages back to the OS between steps (glibc)."""

from __future__ import annotations

import ctypes
import ctypes.util


def _glibc_malloc_trim():
    """glibc's malloc_trim, or None where the C library is not glibc."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _glibc_malloc_trim()


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS (glibc). A step's activations differ in shape from
    step to step (the loss rows are random), and glibc keeps the freed chunks below its mmap
    threshold (up to 32 MiB) in fragmented arenas: an EAGLE-3 run on the 1.5B grew from 4.8 to
    14.6 GB in 30 steps without this, and stays at 6-8.5 GB with it, for ~0.3 s per step."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
