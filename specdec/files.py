"""Writing files the user will keep: atomic writes that follow the umask, and output directories
that are specdec's own.

Every directory specdec writes results into (`train ... --out`, `export`, `bench --out`,
`datastore build -o`) is claimed with `open_output_dir`: a new path or an empty directory gets a
`specdec.json` marker saying what it holds, a directory with that marker (for the same contents)
is specdec's to write in again, anything else is refused, so no file of the user's is ever
replaced. Commands check with `check_output_dir` before they load a model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from .paths import MARKER_FILE, read_marker

# what an output directory holds -> how messages name it
OUTPUT_KINDS = {
    "checkpoint": "a specdec checkpoint",
    "training-data": "specdec training data",
    "export": "a drafter export written by specdec",
    "bench": "specdec bench results",
    "datastore": "a specdec datastore",
}


def file_mode() -> int:
    """0o666 less the process umask: the mode `open()` gives a new file (safetensors writes 0600)."""
    try:
        with open("/proc/self/status") as status:  # read without changing it (os.umask would, for every thread)
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """`write(temporary)` then rename it to `path`: a reader never sees half a file, and the file
    gets the umask's mode whatever the writer used. The temporary carries the pid (two writers of
    one path never share one)."""
    path = Path(path)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(temporary)
        os.chmod(temporary, file_mode())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_atomic(path, lambda temporary: temporary.write_text(text))


def save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict | None = None) -> Path:
    """A safetensors file written atomically with the umask's mode."""
    from safetensors.torch import save_file

    return write_atomic(path, lambda temporary: save_file(tensors, str(temporary), metadata=metadata))


def _marker_contents(directory: Path) -> str | None:
    """What specdec's marker in `directory` says it holds ("" for an unreadable marker or one of
    another kind, such as a converted model's), or None without a marker."""
    if not (directory / MARKER_FILE).exists():
        return None
    marker = read_marker(directory)
    return str(marker.get("contents", "")) if isinstance(marker, dict) else ""


def check_output_dir(directory: str | os.PathLike, contents: str, flag: str = "--out") -> Path:
    """May specdec write `contents` (a key of OUTPUT_KINDS) into `directory`? Yes for a new path,
    an empty directory, or one whose marker says it holds `contents`; otherwise one clear error.
    Writes nothing."""
    directory = Path(directory).expanduser()
    what = OUTPUT_KINDS[contents]
    existing = next((path for path in (directory, *directory.parents) if path.exists()), None)
    if existing is not None and not existing.is_dir():
        named = f"{flag} {directory}" if existing == directory else f"{flag} {directory}: {existing}"
        raise ValueError(f"{named} is a file, not a directory")
    if existing != directory or not any(directory.iterdir()):
        return directory
    found = _marker_contents(directory)
    if found == contents:
        return directory
    if found:
        raise ValueError(f"{directory} holds {OUTPUT_KINDS.get(found, found)}, not {what}; choose an empty or new directory")
    raise ValueError(f"{directory} is not {what}; choose an empty or new directory")


def open_output_dir(directory: str | os.PathLike, contents: str, flag: str = "--out") -> Path:
    """`check_output_dir`, then create the directory and mark it as specdec's (before any other
    file, so a job killed half-way leaves a directory its rerun may continue)."""
    directory = check_output_dir(directory, contents, flag)
    directory.mkdir(parents=True, exist_ok=True)
    if _marker_contents(directory) != contents:
        marker = {"written_by": "specdec", "contents": contents, "description": OUTPUT_KINDS[contents]}
        write_text_atomic(directory / MARKER_FILE, json.dumps(marker, indent=2) + "\n")
    return directory
