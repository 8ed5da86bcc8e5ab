"""Batch-invariant skinny GEMM for `nn.Linear` on CPU: verifying k tokens ~ the cost of decoding one.

Decode is memory-bound: a forward over k <= ~10 new tokens should cost about one weight
stream, like a 1-token step. MKL's fp32 GEMM does not deliver that on small CPUs (2.3-2.9x
at k = 8) and, summing in a different order for 1 row than for 8, can flip a greedy argmax
on a near-tie. The C++ kernel in `csrc/skinny_gemm.cpp` reads each weight row once for all
rows and computes every output with the same instruction sequence whatever the row count,
so row i of a k-row call is bitwise equal to that row run alone.

Backends (a registry, looked up by name):

    "cpp"      the C++ kernel (fp32, AVX-512 or AVX2+FMA); built with the system C++ compiler
               at first use into $SPECDEC_CACHE/kernels (default ~/.cache/specdec/kernels),
               a few seconds, then cached. Other dtypes (bf16) go through F.linear.
    "torch"    F.linear: exactly the plain nn.Linear behaviour (fast, not batch invariant).
    "rowwise"  F.linear one row at a time: batch invariant in pure PyTorch, but k rows cost k
               single-row calls (no use for speculative verification; a reference).
    "int8"     opt-in, LOSSY vs fp32: weight-only int8 (per-row scales) in the same kernel; 4x
               fewer weight bytes, so plain decoding gets faster too. Same batch invariance.
    "auto"     $SPECDEC_LINEAR if set, else "cpp" when it can be built here, else "torch".

Environment: SPECDEC_LINEAR=torch turns the fast path off for "auto" callers;
SPECDEC_CXX names the compiler (SPECDEC_CXX=none: behave as if there were none);
SPECDEC_KERNEL_SPIN_US sets how long kernel threads spin-wait between calls (default 50);
SPECDEC_KERNEL_ISA=avx2|avx512 picks the build (default: the widest the CPU has);
SPECDEC_KERNEL_AMX=0 keeps the int8-activation K-quant linears off AMX tiles (same bits, for A/Bs).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..paths import cache_root

SOURCE_PATH = Path(__file__).parent / "csrc" / "skinny_gemm.cpp"
ENV_BACKEND = "SPECDEC_LINEAR"
ENV_COMPILER = "SPECDEC_CXX"
ENV_SPIN_US = "SPECDEC_KERNEL_SPIN_US"
ENV_ISA = "SPECDEC_KERNEL_ISA"
ENV_AMX = "SPECDEC_KERNEL_AMX"
NO_COMPILER = ("none", "0", "off", "false")
# F16C (fp16 scales of GGUF blocks) comes with every AVX2 CPU
ISA_FLAGS = {"avx512": ("-mavx512f", "-mavx2", "-mfma", "-mf16c"), "avx2": ("-mavx2", "-mfma", "-mf16c")}
# AVX-512 CPUs with VNNI (+BW): the int8-activation (gguf-a8) dot products use vpdpbusd / vpdpwssd,
# K-quants 64 weights per zmm (same results as the AVX2 maddubs sequence, fewer instructions)
VNNI_FLAGS = ("-mavx512vnni", "-mavx512vl", "-mavx512bw")
VNNI_CPU_FLAGS = {"avx512_vnni", "avx512vl", "avx512bw"}
# ... and with AMX (Sapphire Rapids on): the multi-row a8 K-quant linears use int8 tiles (same bits);
# VBMI (every AMX CPU has it) for the byte permutes of the Q6_K tile decode
AMX_FLAGS = ("-mamx-tile", "-mamx-int8", "-mavx512vbmi")
AMX_CPU_FLAGS = {"amx_tile", "amx_int8", "avx512vbmi"}
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-math-errno")
DEFAULT_SPIN_US = 50
_FP32 = torch.float32


class KernelUnavailable(RuntimeError):
    """The compiled kernel cannot be used here (no compiler, no AVX2/FMA/F16C, build failed)."""


def kernel_cache_dir() -> Path:
    """Where compiled kernels live: $SPECDEC_CACHE/kernels (default ~/.cache/specdec/kernels)."""
    return cache_root() / "kernels"


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


def cpu_isa() -> str | None:
    """The widest instruction set the kernel supports on this CPU ("avx512", "avx2") or None."""
    flags = cpu_flags()
    if not flags:
        return None
    if {"avx512f", "avx2", "fma", "f16c"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return None


def find_compiler(compiler: str | None = None) -> str | None:
    """The C++ compiler to build with: `compiler`, else $SPECDEC_CXX, else $CXX / g++ / c++ / clang++."""
    wanted = compiler if compiler is not None else (os.environ.get(ENV_COMPILER) or None)
    if wanted is not None:
        return None if wanted.strip().lower() in NO_COMPILER else shutil.which(wanted.strip())
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


class SkinnyGemmLibrary:
    """The compiled kernel (ctypes). Use `load_library()`, which builds and caches it."""

    def __init__(self, path: Path, isa: str):
        self.path = path
        self.isa = isa
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise KernelUnavailable(f"cannot load {path}: {exc}") from exc
        lib.sg_isa.restype = ctypes.c_char_p
        lib.sg_vector_width.restype = ctypes.c_int
        lib.sg_set_spin_us.argtypes = [ctypes.c_int64]
        lib.sg_linear_f32.restype = ctypes.c_int
        lib.sg_linear_f32.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # x, M, K
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # w, N, bias
            ctypes.c_void_p, ctypes.c_int,  # y, threads
        ]  # fmt: skip
        lib.sg_linear_i8.restype = ctypes.c_int
        lib.sg_linear_i8.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # x, M, K
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,  # q, N, scale, bias
            ctypes.c_void_p, ctypes.c_int,  # y, threads
        ]  # fmt: skip
        lib.sg_linear_gguf.restype = ctypes.c_int
        lib.sg_linear_gguf.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # x, M, K
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,  # blocks, N, ggml type, bias
            ctypes.c_void_p, ctypes.c_int,  # y, threads
        ]  # fmt: skip
        lib.sg_linear_gguf_a8.restype = ctypes.c_int
        lib.sg_linear_gguf_a8.argtypes = lib.sg_linear_gguf.argtypes
        lib.sg_a8_row_bytes.restype = ctypes.c_int64
        lib.sg_a8_row_bytes.argtypes = [ctypes.c_int64]
        lib.sg_quantize_a8.restype = ctypes.c_int
        lib.sg_quantize_a8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
        lib.sg_a8_block.argtypes = [ctypes.c_int]
        lib.sg_a8_vnni.restype = ctypes.c_int
        lib.sg_set_amx.restype = ctypes.c_int
        lib.sg_set_amx.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.sg_amx.restype = ctypes.c_int
        lib.sg_dequantize_rows.restype = ctypes.c_int
        lib.sg_dequantize_rows.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,  # blocks, K, ggml type
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # row ids (int64), count, out
        ]  # fmt: skip
        lib.sg_attention.restype = ctypes.c_int
        lib.sg_attention.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # q, k, v, kv strides
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # mask, B, H, Hkv
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,  # T, S, D, scale
            ctypes.c_void_p, ctypes.c_int,  # out, threads
        ]  # fmt: skip
        lib.sg_rotary.restype = ctypes.c_int
        lib.sg_rotary.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # x, cos, sin
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,  # B, T, H, D, out
        ]  # fmt: skip
        lib.sg_block_size.argtypes = lib.sg_block_bytes.argtypes = [ctypes.c_int]
        lib.sg_block_size.restype = lib.sg_block_bytes.restype = ctypes.c_int
        self._lib = lib
        self._linear = lib.sg_linear_f32
        self._linear_gguf = lib.sg_linear_gguf
        self._linear_i8 = lib.sg_linear_i8
        self._attention = lib.sg_attention
        self.vector_width = int(lib.sg_vector_width())
        if lib.sg_isa().decode() != isa:
            raise KernelUnavailable(f"{path} was built for {lib.sg_isa().decode()}, expected {isa}")
        self.set_amx(os.environ.get(ENV_AMX, "1").strip().lower() not in ("0", "off", "false", "no"))
        spin = os.environ.get(ENV_SPIN_US, str(DEFAULT_SPIN_US))
        try:
            lib.sg_set_spin_us(max(0, int(spin)))
        except ValueError:
            raise ValueError(f"{ENV_SPIN_US} must be a whole number of microseconds, got {spin!r}") from None

    def linear_f32(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_threads: int
    ) -> torch.Tensor:
        """x [..., K], weight [N, K], bias [N] or None: contiguous fp32 CPU tensors -> [..., N].

        No checks here (the caller's job); kept lean because a 0.5B model makes ~170 calls per token."""
        in_features = weight.shape[1]
        out = torch.empty(x.shape[:-1] + (weight.shape[0],), dtype=torch.float32)  # [..., N]
        status = self._linear(
            x.data_ptr(), x.numel() // in_features, in_features, weight.data_ptr(), weight.shape[0],
            None if bias is None else bias.data_ptr(), out.data_ptr(), num_threads,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"skinny GEMM kernel rejected shapes x {tuple(x.shape)} w {tuple(weight.shape)}")
        return out

    def linear_int8(
        self, x: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, num_threads: int
    ) -> torch.Tensor:
        """x [..., K] fp32, quantized [N, K] int8, scale [N] fp32 -> x @ (quantized * scale[:, None]).T + bias."""
        in_features = quantized.shape[1]
        out = torch.empty(x.shape[:-1] + (quantized.shape[0],), dtype=torch.float32)  # [..., N]
        status = self._linear_i8(
            x.data_ptr(), x.numel() // in_features, in_features, quantized.data_ptr(), quantized.shape[0],
            scale.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), num_threads,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"int8 kernel rejected shapes x {tuple(x.shape)} q {tuple(quantized.shape)}")
        return out


    def block_layout(self, ggml_type: int) -> tuple[int, int] | None:
        """(weights, bytes) per block of a GGUF type the kernel computes on, else None."""
        size = int(self._lib.sg_block_size(int(ggml_type)))
        return (size, int(self._lib.sg_block_bytes(int(ggml_type)))) if size else None

    def linear_gguf(
        self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None, num_threads: int
    ) -> torch.Tensor:
        """x [..., K] fp32, blocks [N, K / block * bytes] uint8 (GGUF rows) -> x @ dequantize(blocks).T + bias."""
        in_features = x.shape[-1]
        out = torch.empty(x.shape[:-1] + (blocks.shape[0],), dtype=torch.float32)  # [..., N]
        status = self._linear_gguf(
            x.data_ptr(), x.numel() // in_features, in_features, blocks.data_ptr(), blocks.shape[0], ggml_type,
            None if bias is None else bias.data_ptr(), out.data_ptr(), num_threads,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"GGUF kernel rejected x {tuple(x.shape)}, blocks {tuple(blocks.shape)} of type {ggml_type}")
        return out

    def linear_gguf_a8(
        self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None, num_threads: int
    ) -> torch.Tensor:
        """As linear_gguf with x quantized to int8 per block of 32 (`quantize_a8`) and integer dot
        products: the int8-activation mode, lossy vs fp32 activations, batch invariant."""
        in_features = x.shape[-1]
        out = torch.empty(x.shape[:-1] + (blocks.shape[0],), dtype=torch.float32)  # [..., N]
        status = self._lib.sg_linear_gguf_a8(
            x.data_ptr(), x.numel() // in_features, in_features, blocks.data_ptr(), blocks.shape[0], ggml_type,
            None if bias is None else bias.data_ptr(), out.data_ptr(), num_threads,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"GGUF a8 kernel rejected x {tuple(x.shape)}, blocks {tuple(blocks.shape)} of type {ggml_type}")
        return out

    @property
    def a8_vnni(self) -> bool:
        """Whether the int8-activation dot products use VNNI here (results are the same either way)."""
        return bool(self._lib.sg_a8_vnni())

    def set_amx(self, enabled: bool, min_rows: int = 0) -> bool:
        """Turn AMX int8 tiles for the multi-row a8 K-quant linears on or off (on by default unless
        SPECDEC_KERNEL_AMX=0); returns whether they are on: False where the build, the CPU or
        Linux (the tile-state request) lacks them. The results are bitwise the same either way.
        min_rows > 0 uses AMX from that many activation rows instead of the measured thresholds
        (3, Q6_K 5), so tests can run every tile path."""
        return bool(self._lib.sg_set_amx(int(bool(enabled)), max(0, int(min_rows))))

    @property
    def amx(self) -> bool:
        """Whether the multi-row a8 K-quant linears run on AMX tiles now."""
        return bool(self._lib.sg_amx())

    def a8_block(self, ggml_type: int) -> int:
        """Activation block of the int8 mode for weights of `ggml_type`: 32 (Q4_0 ... Q8_0, as
        llama.cpp's q8_0) or 256 (K-quants, as q8_K); 0 for a type the kernel does not know."""
        return int(self._lib.sg_a8_block(int(ggml_type)))

    def quantize_a8(self, x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] fp32 (K a multiple of `block`, 32 or 256) -> the a8 kernel's activation
        blocks: q [M, K] int8 and d [M, K / block] fp32, x ~ q * d per block."""
        x = x.detach().to(torch.float32).contiguous()
        rows, in_features = x.shape
        row_bytes = int(self._lib.sg_a8_row_bytes(in_features))
        if row_bytes == 0 or block not in (32, 256) or in_features % block:
            raise ValueError(f"int8 activation blocks of {block} (32 or 256) need K a multiple of it, got {in_features}")
        out = torch.empty((rows, row_bytes), dtype=torch.uint8)  # [M, K + 10 K / 32]
        if self._lib.sg_quantize_a8(x.data_ptr(), rows, in_features, block, out.data_ptr()) != 0:
            raise RuntimeError(f"cannot quantize x {tuple(x.shape)}")
        scales = out[:, in_features : in_features + 4 * (in_features // 32)].contiguous().view(torch.float32)  # [M, K / 32]
        return out[:, :in_features].contiguous().view(torch.int8), scales[:, : in_features // block]

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Batch-invariant attention with the default 1/sqrt(D) scale: q [B, H, T, D]; keys, values
        [B, H_kv, S, D] (rows of D contiguous: views of a KV cache are fine); mask [B, 1, T, S] bool
        (True = may attend) or None -> [B, H, T, D]. Each query row is computed alone over the slots
        it sees, in slot order (see sg_attention), so its bits do not depend on the other rows."""
        batch, heads, num_new, head_dim = q.shape
        kv_heads, span = keys.shape[1], keys.shape[2]
        if keys.stride() != values.stride() or keys.stride()[2:] != (head_dim, 1):
            keys, values = keys.contiguous(), values.contiguous()
        q = q.contiguous()
        if mask is not None and (mask.shape != (batch, 1, num_new, span) or not mask.is_contiguous()):
            mask = mask.expand(batch, 1, num_new, span).contiguous()
        # mask: bool [B, 1, T, S] contiguous, i.e. the [B, T, S] bytes (0 or 1) the kernel reads; the
        # model's mask is already that, so no op per layer
        out = torch.empty_like(q)  # [B, H, T, D]
        status = self._attention(
            q.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1),
            None if mask is None else mask.data_ptr(), batch, heads, kv_heads, num_new, span, head_dim,
            head_dim**-0.5, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"attention kernel rejected q {tuple(q.shape)} keys {tuple(keys.shape)}")
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H, D] fp32, cos / sin [B, 1, T, D] fp32 -> x * cos + rotate_half(x) * sin as
        [B, H, T, D] contiguous: torch's expression element by element (two products and a sum,
        each rounded once), so the same bits, in one pass instead of ~8 ops and a copy."""
        batch, num_new, heads, head_dim = x.shape
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty((batch, heads, num_new, head_dim), dtype=torch.float32)  # [B, H, T, D]
        status = self._lib.sg_rotary(
            x.data_ptr(), cos.data_ptr(), sin.data_ptr(), batch, num_new, heads, head_dim, out.data_ptr()
        )
        if status != 0:
            raise RuntimeError(f"rotary kernel rejected x {tuple(x.shape)} cos {tuple(cos.shape)}")
        return out

    def dequantize_rows(self, blocks: torch.Tensor, ggml_type: int, in_features: int, rows: torch.Tensor) -> torch.Tensor:
        """rows [...] int64 (checked in range by the caller) -> dequantized weight rows [..., K] fp32."""
        rows = rows.contiguous()
        out = torch.empty(rows.shape + (in_features,), dtype=torch.float32)  # [..., K]
        status = self._lib.sg_dequantize_rows(
            blocks.data_ptr(), in_features, ggml_type, rows.data_ptr(), rows.numel(), out.data_ptr()
        )
        if status != 0:
            raise RuntimeError(f"GGUF kernel cannot dequantize type {ggml_type} rows of {in_features}")
        return out


_LIBRARIES: dict[tuple, SkinnyGemmLibrary] = {}  # loaded .so files, one per (compiler, isa, dir)
_BUILD_LOCK = threading.Lock()


def load_library(
    compiler: str | None = None, isa: str | None = None, cache_dir: Path | None = None
) -> SkinnyGemmLibrary:
    """Build (once, cached on disk) and load the kernel; raises KernelUnavailable with the reason.

    `isa`: "avx2" or "avx512"; None = $SPECDEC_KERNEL_ISA, else the widest this CPU has. Results
    are bitwise reproducible per ISA (the two sum in different orders)."""
    isa = isa or os.environ.get(ENV_ISA) or None
    if isa is not None and isa not in ISA_FLAGS:
        raise ValueError(f"isa ({ENV_ISA}) must be one of {sorted(ISA_FLAGS)} or unset, got {isa!r}")
    cxx = find_compiler(compiler)
    if cxx is None:
        raise KernelUnavailable(f"no C++ compiler (set {ENV_COMPILER} or install g++)")
    native_isa = cpu_isa()
    if native_isa is None:
        raise KernelUnavailable("this CPU lacks AVX2+FMA+F16C")
    isa = isa or native_isa
    if isa == "avx512" and native_isa != "avx512":
        raise KernelUnavailable(f"this CPU cannot run the avx512 kernel (it has {native_isa})")
    cache_dir = Path(cache_dir) if cache_dir is not None else kernel_cache_dir()
    key = (cxx, isa, str(cache_dir))
    with _BUILD_LOCK:
        if key not in _LIBRARIES:
            try:
                path = _build(cxx, isa, cache_dir, isa_build_flags(isa))
            except KernelUnavailable:
                if isa_build_flags(isa, amx=False) == isa_build_flags(isa):
                    raise
                # a compiler without AMX intrinsics (gcc < 11): the same kernel without the tiles
                path = _build(cxx, isa, cache_dir, isa_build_flags(isa, amx=False))
            try:
                _LIBRARIES[key] = SkinnyGemmLibrary(path, isa)
            except KernelUnavailable:
                path.unlink(missing_ok=True)  # a damaged cache entry: rebuild next time
                raise
        return _LIBRARIES[key]


def _build(cxx: str, isa: str, cache_dir: Path, isa_flags: tuple[str, ...]) -> Path:
    """Compile to <cache>/skinny_gemm-<isa>-<hash>.so unless it is already there (atomic rename)."""
    flags = (*COMMON_FLAGS, *isa_flags)
    source = SOURCE_PATH.read_bytes()
    compiler_stamp = f"{cxx}:{os.stat(cxx).st_mtime_ns}"
    digest = hashlib.sha256(source + " ".join(flags).encode() + compiler_stamp.encode()).hexdigest()[:16]
    target = cache_dir / f"skinny_gemm-{isa}-{digest}.so"
    if target.exists():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
    except OSError as exc:
        raise KernelUnavailable(f"cannot write the kernel cache {cache_dir}: {exc}") from exc
    try:
        command = [cxx, *flags, str(SOURCE_PATH), "-o", tmp_name]
        # ~30 s of CPU on a quiet machine (GGUF formats x tile shapes); a loaded shared machine needs more
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if result.returncode != 0 or os.path.getsize(tmp_name) == 0:
            raise KernelUnavailable(f"{cxx} failed to build {SOURCE_PATH.name}:\n{result.stderr[-2000:]}")
        # concurrent builders each rename a complete file; older builds stay (tens of KB each)
        # because another checkout may still be loading one
        os.replace(tmp_name, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"building {SOURCE_PATH.name} with {cxx} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target


# ---------------------------------------------------------------- backends


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: x [B, T, H, D], cos / sin [B, 1, T, D] -> [B, H, T, D] (a transposed view's result)."""
    x = x.transpose(1, 2)  # [B, H, T, D]
    return x * cos + rotate_half(x) * sin


def sdpa_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """torch's attention: q [B, H, T, D], keys / values [B, H_kv, S, D], mask [B, 1, T, S] bool or
    None -> [B, H, T, D]. Fast; a row's bits depend on how many query rows share the call."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


class TorchLinear:
    """F.linear: plain nn.Linear behaviour (MKL/oneDNN). Fast, not batch invariant."""

    name = "torch"

    def __init__(self, compiler: str | None = None):
        pass  # nothing to build; same constructor as every backend

    def batch_invariant(self, dtype: torch.dtype) -> bool:
        return False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    attention = staticmethod(sdpa_attention)
    rotary = staticmethod(torch_rotary)


class RowwiseTorchLinear:
    """Each row through its own 1-row F.linear: batch invariant without a compiler, k rows cost ~k x."""

    name = "rowwise"
    attention = staticmethod(sdpa_attention)
    rotary = staticmethod(torch_rotary)

    def __init__(self, compiler: str | None = None):
        pass

    def batch_invariant(self, dtype: torch.dtype) -> bool:
        return True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])  # [M, K]
        rows = [F.linear(x2d[i : i + 1], weight, bias) for i in range(x2d.shape[0])]  # M x [1, N]
        out = torch.cat(rows) if rows else x2d.new_empty((0, weight.shape[0]))  # [M, N]
        return out.reshape(*x.shape[:-1], weight.shape[0])


class _CompiledBackend:
    """Shared by the compiled backends: one loaded library, shared (not copied) by deepcopy and
    rebuilt from its options when unpickled (ctypes handles cannot be copied or pickled)."""

    def __init__(self, compiler: str | None = None, isa: str | None = None, cache_dir: Path | None = None):
        self.library = load_library(compiler, isa, cache_dir)
        self._options = (compiler, self.library.isa, cache_dir)

    def __deepcopy__(self, memo):
        return self

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The kernel's batch-invariant attention for fp32 CPU inference (shapes as sdpa_attention);
        anything else (other dtypes, autograd) -> torch's."""
        if not (q.dtype is _FP32 and keys.dtype is _FP32 and q.is_cpu and keys.is_cpu) or (
            torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad or values.requires_grad)
        ):
            return sdpa_attention(q, keys, values, mask)
        return self.library.attention(q, keys, values, mask)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """torch_rotary's result (bitwise) in one kernel pass for fp32 CPU inference, contiguous."""
        if not (x.dtype is _FP32 and cos.dtype is _FP32 and sin.dtype is _FP32 and x.is_cpu) or (
            torch.is_grad_enabled() and x.requires_grad
        ) or x.shape[-1] % 2 or cos.shape != (x.shape[0], 1, x.shape[1], x.shape[3]) or sin.shape != cos.shape:
            return torch_rotary(x, cos, sin)
        return self.library.rotary(x, cos, sin)

    def __reduce__(self):
        return (type(self), self._options)


class CppSkinnyLinear(_CompiledBackend):
    """The compiled batch-invariant kernel for fp32 CPU inference; anything else -> F.linear.

    The fallback covers other dtypes (bf16: correct, not batch invariant), non-CPU tensors,
    non-contiguous weights and autograd (the kernel has no backward)."""

    name = "cpp"

    def batch_invariant(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self._kernel_applies(x, weight, bias):
            return F.linear(x, weight, bias)
        if not x.is_contiguous():
            x = x.contiguous()
        return self.library.linear_f32(x, weight, bias, torch.get_num_threads())  # [..., N]

    @staticmethod
    def _kernel_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """fp32 CPU inference with a contiguous weight; cheap attribute checks only (hot path)."""
        if not (x.dtype is _FP32 and weight.dtype is _FP32 and x.is_cpu and weight.is_cpu and weight.is_contiguous()):
            return False
        if bias is not None and not (bias.dtype is _FP32 and bias.is_cpu and bias.is_contiguous()):
            return False
        if torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        ):
            return False  # the kernel has no backward
        # let F.linear raise its usual shape error / handle empty inputs
        return x.shape[-1] == weight.shape[1] and x.numel() > 0


def quantize_int8(weight: torch.Tensor, rows_per_block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: weight [N, K] ~ quantized [N, K] int8 * scale [N, 1].

    Works through `rows_per_block` rows at a time so an LM head needs no full fp32 temporaries."""
    out_features, in_features = weight.shape
    quantized = torch.empty((out_features, in_features), dtype=torch.int8)  # [N, K]
    scale = torch.empty(out_features, dtype=torch.float32)  # [N]
    for start in range(0, out_features, rows_per_block):
        block = weight[start : start + rows_per_block].detach().float()  # [n, K]
        absmax = block.abs().amax(dim=1)  # [n]
        block_scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
        quantized[start : start + rows_per_block] = torch.round(block / block_scale[:, None]).clamp_(-127, 127)
        scale[start : start + rows_per_block] = block_scale
    return quantized, scale


class Int8SkinnyLinear(_CompiledBackend):
    """Weight-only int8 (per-row scales) through the same batch-invariant kernel: 4x fewer weight
    bytes than fp32, so plain decoding gets faster too. LOSSY versus the fp32 model (speculative
    decoding stays exact with respect to this quantised target). The int8 copy of each weight is
    made at first use and remade if the weight is modified in place; the fp32 weight is kept
    (state_dict, tied embeddings). Non-fp32 inputs / autograd go through F.linear unquantised."""

    name = "int8"

    def __init__(self, compiler: str | None = None, isa: str | None = None, cache_dir: Path | None = None):
        super().__init__(compiler, isa, cache_dir)
        self._quantized: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (version, q, scale)

    def batch_invariant(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32

    def quantized(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, K] int8, scale [N]) for `weight`, cached while the weight lives and is unchanged."""
        try:
            version = weight._version  # bumped by in-place updates
        except RuntimeError:  # an inference-mode tensor has no version counter (and is immutable)
            version = -1
        entry = self._quantized.get(id(weight))
        if entry is None or entry[0] != version:
            if entry is None:  # forget the copy when the weight is freed (ids get reused)
                weakref.finalize(weight, self._quantized.pop, id(weight), None)
            with torch.inference_mode(False), torch.no_grad():
                entry = (version, *quantize_int8(weight))
            self._quantized[id(weight)] = entry
        return entry[1], entry[2]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not CppSkinnyLinear._kernel_applies(x, weight, bias):
            return F.linear(x, weight, bias)
        if not x.is_contiguous():
            x = x.contiguous()
        quantized, scale = self.quantized(weight)
        return self.library.linear_int8(x, quantized, scale, bias, torch.get_num_threads())  # [..., N]


BACKENDS = {"cpp": CppSkinnyLinear, "int8": Int8SkinnyLinear, "torch": TorchLinear, "rowwise": RowwiseTorchLinear}


@dataclass
class BackendChoice:
    backend: object  # one of BACKENDS' classes, instantiated
    reason: str  # why this one (e.g. the fast path's unavailability)


def make_backend(name: str = "auto", compiler: str | None = None) -> BackendChoice:
    """Instantiate backend `name`; "auto" = $SPECDEC_LINEAR if set, else "cpp" if it builds, else "torch"."""
    if name == "auto":
        name = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
        if name == "auto":
            try:
                return BackendChoice(CppSkinnyLinear(compiler=compiler), "auto: compiled kernel available")
            except KernelUnavailable as exc:
                return BackendChoice(TorchLinear(), f"auto: fell back to torch ({exc})")
        if name not in BACKENDS:
            raise ValueError(f"{ENV_BACKEND}={name!r} is not a linear backend; choose from {['auto', *BACKENDS]}")
    if name not in BACKENDS:
        raise ValueError(f"unknown linear backend {name!r}; choose from {['auto', *BACKENDS]}")
    return BackendChoice(BACKENDS[name](compiler=compiler), f"requested {name!r}")


class FastLinear(nn.Linear):
    """An nn.Linear whose forward goes through a linear backend; shares the original parameters."""

    def __init__(self, linear: nn.Linear, backend):
        nn.Module.__init__(self)  # skip nn.Linear.__init__: no new weights are allocated
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the same Parameter object: tied weights stay tied
        self.bias = linear.bias
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        return self.backend.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend.name}"


def fast_linear_modules(model: nn.Module, backend="auto", compiler: str | None = None) -> dict:
    """Replace every nn.Linear in `model` (in place) by a FastLinear on the chosen backend (a name,
    or a backend instance to share, e.g. with an LM head outside `model`).

    Returns {"backend", "count", "batch_invariant", "quantized", "reason"}. Parameters are
    shared, not copied (a tied lm_head keeps pointing at embed_tokens.weight). Already-replaced modules are
    re-pointed at the new backend, so calling it twice switches backends."""
    choice = make_backend(backend, compiler=compiler) if isinstance(backend, str) else BackendChoice(backend, "given")
    replacements = [
        (parent, child_name, child)
        for parent in model.modules()
        for child_name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    dtypes = set()
    for parent, child_name, child in replacements:
        if isinstance(child, FastLinear):
            child.backend = choice.backend
        else:
            setattr(parent, child_name, FastLinear(child, choice.backend))
        dtypes.add(child.weight.dtype)
    return {
        "backend": choice.backend.name,
        "count": len(replacements),
        "batch_invariant": bool(dtypes) and all(choice.backend.batch_invariant(d) for d in dtypes),
        "quantized": choice.backend.name == "int8",
        "reason": choice.reason,
    }
