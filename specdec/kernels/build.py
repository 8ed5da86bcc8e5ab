"""Building the kernel at first use: the compiler, the instruction set and its flags, the cache.

The C++ source is csrc/ (a shared header, one .cpp per concern, see csrc/skinny_gemm.h). It is
compiled with the system C++ compiler into $SPECDEC_CACHE/kernels/skinny_gemm-<isa>-<digest>.so
(default ~/.cache/specdec/kernels), the parts in parallel; the digest covers every source file,
the flags and the compiler, so an edit, another ISA or another compiler builds afresh and a
library built once is only loaded after that.

Environment: SPECDEC_CXX names the compiler (SPECDEC_CXX=none: behave as if there were none);
SPECDEC_KERNEL_ISA=avx512|avx2-vnni|avx2 picks the build (default: the widest the CPU has).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..paths import cache_root

SOURCE_DIR = Path(__file__).parent / "csrc"
LIBRARY_NAME = "skinny_gemm"
ENV_COMPILER = "SPECDEC_CXX"
ENV_ISA = "SPECDEC_KERNEL_ISA"
NO_COMPILER = ("none", "0", "off", "false")
# F16C (fp16 scales of GGUF blocks) comes with every AVX2 CPU
# avx2-vnni: AVX2 CPUs with AVX-VNNI and no AVX-512 (Intel client CPUs since Alder Lake): the a8 integer dot
# products as 256-bit vpdpbusd / vpdpwssd, the same integers as the AVX2 maddubs sequence (same bits)
ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx2", "-mfma", "-mf16c"),
    "avx2-vnni": ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
}
# what the CPU must have for each build (/proc/cpuinfo flags), widest first
ISA_CPU_FLAGS = {
    "avx512": {"avx512f", "avx2", "fma", "f16c"},
    "avx2-vnni": {"avx_vnni", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
}
# AVX-512 CPUs with VNNI (+BW): the int8-activation (gguf-a8) dot products use vpdpbusd / vpdpwssd,
# K-quants 64 weights per zmm (same results as the AVX2 maddubs sequence, fewer instructions)
VNNI_FLAGS = ("-mavx512vnni", "-mavx512vl", "-mavx512bw")
VNNI_CPU_FLAGS = {"avx512_vnni", "avx512vl", "avx512bw"}
# ... and with AMX (Sapphire Rapids on): the multi-row a8 K-quant linears use int8 tiles (same bits);
# VBMI (every AMX CPU has it) for the byte permutes of the Q6_K tile decode
AMX_FLAGS = ("-mamx-tile", "-mamx-int8", "-mavx512vbmi")
AMX_CPU_FLAGS = {"amx_tile", "amx_int8", "avx512vbmi"}
# -ffp-contract=off: every float expression is rounded as written (the bitwise rules depend on it)
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-math-errno")
# ~30 s of CPU on a quiet machine (GGUF formats x tile shapes); a loaded shared machine needs more
BUILD_TIMEOUT_S = 900


class KernelUnavailable(RuntimeError):
    """The compiled kernel cannot be used here (no compiler, no AVX2/FMA/F16C, build failed)."""


def kernel_cache_dir() -> Path:
    """Where compiled kernels live: $SPECDEC_CACHE/kernels (default ~/.cache/specdec/kernels)."""
    return cache_root() / "kernels"


def source_files() -> list[Path]:
    """Every file of the kernel's source: the .cpp parts and the header they share."""
    return sorted(SOURCE_DIR.glob("*.cpp")) + sorted(SOURCE_DIR.glob("*.h"))


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty when unknown."""
    try:
        flags_line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(flags_line.split(":", 1)[1].split())


def isa_build_flags(isa: str, amx: bool = True) -> tuple[str, ...]:
    """Compiler flags for the `isa` build; the AVX-512 build adds VNNI (and AMX unless amx=False)
    where this CPU has it."""
    if isa != "avx512" or not VNNI_CPU_FLAGS <= cpu_flags():
        return ISA_FLAGS[isa]
    return ISA_FLAGS[isa] + VNNI_FLAGS + (AMX_FLAGS if amx and AMX_CPU_FLAGS <= cpu_flags() else ())


def cpu_isas() -> list[str]:
    """The kernel builds this CPU can run, widest first (empty when none or unknown)."""
    flags = cpu_flags()
    return [isa for isa, needs in ISA_CPU_FLAGS.items() if needs <= flags]


def cpu_isa() -> str | None:
    """The widest instruction set the kernel supports on this CPU ("avx512", "avx2-vnni", "avx2") or None."""
    isas = cpu_isas()
    return isas[0] if isas else None


def find_compiler(compiler: str | None = None) -> str | None:
    """The C++ compiler to build with: `compiler`, else $SPECDEC_CXX, else $CXX / g++ / c++ / clang++."""
    wanted = compiler if compiler is not None else (os.environ.get(ENV_COMPILER) or None)
    if wanted is not None:
        return None if wanted.strip().lower() in NO_COMPILER else shutil.which(wanted.strip())
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def require_compiler(compiler: str | None = None) -> str:
    """find_compiler's answer, or KernelUnavailable saying why there is none."""
    cxx = find_compiler(compiler)
    if cxx is not None:
        return cxx
    wanted = compiler if compiler is not None else os.environ.get(ENV_COMPILER)
    source = "the compiler argument" if compiler is not None else ENV_COMPILER
    if wanted and wanted.strip().lower() in NO_COMPILER:
        raise KernelUnavailable(f"the C++ compiler is turned off ({source} = {wanted!r})")
    if wanted:
        raise KernelUnavailable(f"the C++ compiler {wanted.strip()!r} ({source}) was not found")
    raise KernelUnavailable(f"no C++ compiler (set {ENV_COMPILER} or install g++)")


def resolve_isa(isa: str | None = None) -> str:
    """The build to use: `isa`, else $SPECDEC_KERNEL_ISA, else the widest this CPU has; ValueError
    for an unknown name, KernelUnavailable for one this CPU cannot run."""
    isa = isa or os.environ.get(ENV_ISA) or None
    if isa is not None and isa not in ISA_FLAGS:
        raise ValueError(f"isa ({ENV_ISA}) must be one of {sorted(ISA_FLAGS)} or unset, got {isa!r}")
    runnable = cpu_isas()
    if not runnable:
        raise KernelUnavailable("this CPU lacks AVX2+FMA+F16C")
    if isa is not None and isa not in runnable:
        raise KernelUnavailable(f"this CPU cannot run the {isa} kernel (it has {runnable[0]})")
    return isa or runnable[0]


def build_library(cxx: str, isa: str, cache_dir: Path) -> Path:
    """The compiled kernel for `isa` in `cache_dir`, built unless already there; KernelUnavailable
    when it cannot be built."""
    try:
        return _build(cxx, isa, cache_dir, isa_build_flags(isa))
    except KernelUnavailable:
        if isa_build_flags(isa, amx=False) == isa_build_flags(isa):
            raise
        # a compiler without AMX intrinsics (gcc < 11): the same kernel without the tiles
        return _build(cxx, isa, cache_dir, isa_build_flags(isa, amx=False))


def _build(cxx: str, isa: str, cache_dir: Path, isa_flags: tuple[str, ...]) -> Path:
    """Compile to <cache>/skinny_gemm-<isa>-<hash>.so unless it is already there (atomic rename)."""
    flags = (*COMMON_FLAGS, *isa_flags)
    sources = source_files()
    digest = hashlib.sha256()
    for path in sources:  # names and contents of every part and the header
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(flags).encode() + f"{cxx}:{os.stat(cxx).st_mtime_ns}".encode())
    target = cache_dir / f"{LIBRARY_NAME}-{isa}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        work_dir = Path(tempfile.mkdtemp(prefix=f".{LIBRARY_NAME}-", dir=cache_dir))
    except OSError as exc:
        raise KernelUnavailable(f"cannot write the kernel cache {cache_dir}: {exc}") from exc
    try:
        library = _compile(cxx, flags, [path for path in sources if path.suffix == ".cpp"], work_dir)
        # concurrent builders each rename a complete file; older builds stay (a few hundred KB
        # each) because another checkout may still be loading one
        os.replace(library, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"building {LIBRARY_NAME} with {cxx} failed: {exc}") from exc
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return target


def _compile(cxx: str, flags: tuple[str, ...], parts: list[Path], work_dir: Path) -> Path:
    """Each part to an object file (as many at once as there are cores), then one shared library."""

    def run(command: list[str], output: Path, what: str) -> Path:
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0 or not output.is_file() or output.stat().st_size == 0:
            raise KernelUnavailable(f"{cxx} failed to build {what}:\n{result.stderr[-2000:]}")
        return output

    def compile_part(part: Path) -> Path:
        obj = work_dir / f"{part.stem}.o"
        return run([cxx, *flags, "-c", str(part), "-o", str(obj)], obj, part.name)

    with ThreadPoolExecutor(max_workers=max(1, min(len(parts), os.cpu_count() or 1))) as pool:
        objects = list(pool.map(compile_part, parts))
    library = work_dir / f"{LIBRARY_NAME}.so"
    return run([cxx, *flags, "-shared", *map(str, objects), "-o", str(library)], library, f"{LIBRARY_NAME}.so")
