"""The compiled kernel as a Python object: its C functions through ctypes, loaded once per build.

`load_library()` builds the kernel at first use (build.py) and loads it; `SkinnyGemmLibrary`
wraps each exported sg_* function for torch tensors (shapes checked by the callers, the
backends). Environment: SPECDEC_KERNEL_SPIN_US sets how long kernel threads spin-wait between
calls (default 300); SPECDEC_KERNEL_AMX=0 keeps the int8-activation K-quant linears off AMX
tiles (same bits, for A/Bs); SPECDEC_KERNEL_INTERLEAVE=0 builds no interleaved copy of the a8 K-quant
weights (same bits; ~1.1 GB less on the 1.5B, slower verify rows).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from .build import ENV_ISA, KernelUnavailable, build_library, kernel_cache_dir, require_compiler, resolve_isa

ENV_SPIN_US = "SPECDEC_KERNEL_SPIN_US"
ENV_AMX = "SPECDEC_KERNEL_AMX"
ENV_INTERLEAVE = "SPECDEC_KERNEL_INTERLEAVE"
DEFAULT_SPIN_US = 300  # > the gap between one layer's kernel calls (torch ops of a few rows)


def _env_switch(name: str) -> bool:
    """An on/off environment switch, on unless set to 0 / off / false / no."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "off", "false", "no")


_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_GGUF_LINEAR = (
    _ptr, _i64, _i64,  # x, M, K
    _ptr, _i64, _int, _ptr,  # blocks, N, ggml type, bias
    _ptr, _int,  # y, threads
)  # fmt: skip
# The entry points a GGUF linear runs on, by route id (GGUFLinear.route picks one; csrc/layer.cpp's Route)
ROUTES = ("sg_linear_gguf", "sg_linear_gguf_a8", "sg_linear_interleaved_a8")
ROUTE_EXACT, ROUTE_A8, ROUTE_INTERLEAVED_A8 = range(3)
_ROUTED_LINEAR = (_int, _ptr, _i64, _int, _ptr, _ptr)  # route, weight, N, ggml type, bias, y


class LayerLinear(ctypes.Structure):
    """One GGUF linear of sg_layer (csrc/layer.cpp): GGUFLinear.route's (route, weight, N, type, bias)."""

    _fields_ = [("route", ctypes.c_int32), ("ggml_type", ctypes.c_int32), ("w", _ptr), ("N", _i64), ("bias", _ptr)]


class LayerArgs(ctypes.Structure):
    """sg_layer's arguments, field for field csrc/layer.cpp's LayerArgs."""

    _fields_ = [
        *((name, _i64) for name in ("B", "T", "H", "heads", "kv_heads", "D", "I")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("threads", ctypes.c_int32), ("unused", ctypes.c_int32),
        *((name, _ptr) for name in ("x", "out", "norm1", "norm2")),
        *((name, LayerLinear) for name in ("q", "k", "v", "o", "gate", "up", "down")),
        ("cos", _ptr), ("sin", _ptr), ("cache_k", _ptr), ("cache_v", _ptr), ("kv_stride_b", _i64), ("kv_stride_h", _i64),
        ("starts", _ptr), ("span", _i64), ("mask", _ptr),
    ]  # fmt: skip


# every exported function: name -> (restype, argtypes)
SIGNATURES = {
    "sg_isa": (ctypes.c_char_p, ()),
    "sg_vector_width": (_int, ()),
    "sg_set_spin_us": (None, (_i64,)),
    "sg_linear_f32": (_int, (
        _ptr, _i64, _i64,  # x, M, K
        _ptr, _i64, _ptr,  # w, N, bias
        _ptr, _int,  # y, threads
    )),
    "sg_linear_i8": (_int, (
        _ptr, _i64, _i64,  # x, M, K
        _ptr, _i64, _ptr, _ptr,  # q, N, scale, bias
        _ptr, _int,  # y, threads
    )),
    "sg_linear_gguf": (_int, _GGUF_LINEAR),
    "sg_linear_gguf_a8": (_int, _GGUF_LINEAR),
    "sg_linear3": (_int, (_ptr, _i64, _i64, *_ROUTED_LINEAR * 3, _int)),  # x, M, K, 3 linears, threads
    "sg_gate_up_silu": (_int, (
        _ptr, _i64, _i64,  # x, M, K
        _int, _ptr, _int, _ptr,  # gate: route, weight, ggml type, bias
        _int, _ptr, _int, _ptr,  # up: route, weight, ggml type, bias
        _i64, _ptr, _ptr, _int,  # N, y, scratch, threads
    )),
    "sg_layer": (_int, (ctypes.POINTER(LayerArgs),)),
    "sg_silu_mul": (_int, (_ptr, _ptr, _ptr, _i64)),  # gate, up, out (may be gate), n
    "sg_interleaved_cols": (_int, ()),
    "sg_interleaved_min_rows": (_int, (_int,)),  # ggml type
    "sg_interleaved_bytes": (_i64, (_int, _i64, _i64)),  # ggml type, N, K
    "sg_interleave": (_int, (_int, _ptr, _i64, _i64, _ptr, _int)),  # ggml type, blocks, N, K, out, threads
    "sg_linear_interleaved_a8": (_int, _GGUF_LINEAR),  # the interleaved copy in place of the blocks
    "sg_a8_row_bytes": (_i64, (_i64,)),
    "sg_quantize_a8": (_int, (_ptr, _i64, _i64, _int, _ptr)),  # x, M, K, block, out
    "sg_a8_block": (_int, (_int,)),
    "sg_a8_vnni": (_int, ()),
    "sg_set_amx": (_int, (_int, _i64)),  # on, min rows
    "sg_amx": (_int, ()),
    "sg_dequantize_rows": (_int, (
        _ptr, _i64, _int,  # blocks, K, ggml type
        _ptr, _i64, _ptr,  # row ids (int64), count, out
    )),
    "sg_attention": (_int, (
        _ptr, _ptr, _ptr, _i64, _i64,  # q, k, v, kv strides
        _ptr, _i64, _i64, _i64,  # mask, B, H, Hkv
        _i64, _i64, _i64, ctypes.c_float,  # T, S, D, scale
        _ptr, _int,  # out, threads
    )),
    "sg_attention_step": (_int, (
        _ptr, _ptr, _ptr, _ptr, _ptr,  # q, k, v, cos, sin
        _ptr, _ptr, _i64, _i64, _ptr,  # cache keys, cache values, their strides, starts (int64)
        _ptr, _i64, _i64, _i64,  # mask, B, H, Hkv
        _i64, _i64, _i64, ctypes.c_float,  # T, S, D, scale
        _ptr, _int,  # out, threads
    )),
    "sg_rms_norm": (_int, (
        _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float,  # x, delta, weight, M, H, eps
        _ptr, _ptr,  # sum, normed
    )),
    "sg_rotary": (_int, (
        _ptr, _ptr, _ptr,  # x, cos, sin
        _i64, _i64, _i64, _i64, _ptr,  # B, T, H, D, out
    )),
    "sg_block_size": (_int, (_int,)),
    "sg_block_bytes": (_int, (_int,)),
}  # fmt: skip


class SkinnyGemmLibrary:
    """The compiled kernel (ctypes). Use `load_library()`, which builds and caches it."""

    def __init__(self, path: Path, isa: str):
        self.path = path
        self.isa = isa
        try:
            lib = ctypes.CDLL(str(path))
            for name, (restype, argtypes) in SIGNATURES.items():
                function = getattr(lib, name)
                function.restype, function.argtypes = restype, list(argtypes)
        except (OSError, AttributeError) as exc:  # not a library, or one from another source
            raise KernelUnavailable(f"cannot load {path}: {exc}") from exc
        self._lib = lib
        self._linear = lib.sg_linear_f32
        self._routes = tuple(getattr(lib, name) for name in ROUTES)  # indexed by route id
        self._linear_i8 = lib.sg_linear_i8
        self._attention = lib.sg_attention
        self.vector_width = int(lib.sg_vector_width())
        # the interleaved a8 copy: output columns per group (16 on AVX-512 VNNI builds, else 8)
        self.interleaved_cols = int(lib.sg_interleaved_cols())
        if lib.sg_isa().decode() != isa:
            raise KernelUnavailable(f"{path} was built for {lib.sg_isa().decode()}, expected {isa}")
        self.set_amx(_env_switch(ENV_AMX))
        self.interleave_weights = _env_switch(ENV_INTERLEAVE)  # GGUFLinear builds the interleaved copy
        spin = os.environ.get(ENV_SPIN_US, str(DEFAULT_SPIN_US))
        try:
            lib.sg_set_spin_us(max(0, int(spin)))
        except ValueError:
            raise ValueError(f"{ENV_SPIN_US} must be a whole number of microseconds, got {spin!r}") from None
        self._threads_lock = threading.Lock()
        self._owners = 0  # open kernel_owns_threads() blocks, over all Python threads
        self._kernel_threads = 0  # inside them: the thread count torch had on entry; else 0

    def threads(self) -> int:
        """Threads a kernel call runs on: torch's intra-op count (inside `kernel_owns_threads`, the
        count torch had on entry)."""
        return self._kernel_threads or torch.get_num_threads()

    @contextmanager
    def kernel_owns_threads(self) -> Iterator[None]:
        """Inside: kernel calls keep torch's thread count and torch's own ops run on one thread.

        Why: between a forward's kernel calls torch runs norms, SiLU and residual adds on a few
        rows. With a second thread each op pays an OpenMP wake, and while the kernel's pool worker
        spins for the next call that OpenMP thread waits for a core (docs/performance.md,
        "Threads": 11-21 ms of a 1.5B forward on 2 cores). torch's thread count is process-wide,
        so nested and concurrent blocks share one hand-over: the first entry saves it, the last
        exit restores it."""
        with self._threads_lock:
            if self._owners == 0:
                self._kernel_threads = torch.get_num_threads()
                torch.set_num_threads(1)
            self._owners += 1
        try:
            yield
        finally:
            with self._threads_lock:
                self._owners -= 1
                if self._owners == 0:
                    torch.set_num_threads(self._kernel_threads)
                    self._kernel_threads = 0

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
        return self.linear_routed(ROUTE_EXACT, x, blocks, blocks.shape[0], ggml_type, bias, num_threads)

    def linear_gguf_a8(
        self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None, num_threads: int
    ) -> torch.Tensor:
        """As linear_gguf with x quantized to int8 per block of 32 (`quantize_a8`) and integer dot
        products: the int8-activation mode, lossy vs fp32 activations, batch invariant."""
        return self.linear_routed(ROUTE_A8, x, blocks, blocks.shape[0], ggml_type, bias, num_threads)

    def linear_routed(
        self, route: int, x: torch.Tensor, weight: torch.Tensor, out_features: int, ggml_type: int,
        bias: torch.Tensor | None, num_threads: int,
    ) -> torch.Tensor:
        """A GGUF linear through the entry point `route` picks (ROUTES): x [..., K] fp32 -> [..., N]."""
        in_features = x.shape[-1]
        out = torch.empty(x.shape[:-1] + (out_features,), dtype=torch.float32)  # [..., N]
        status = self._routes[route](
            x.data_ptr(), x.numel() // in_features, in_features, weight.data_ptr(), out_features, ggml_type,
            None if bias is None else bias.data_ptr(), out.data_ptr(), num_threads,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"{ROUTES[route]} rejected x {tuple(x.shape)} for {out_features} outputs of type {ggml_type}")
        return out

    def linear3(self, x: torch.Tensor, calls, num_threads: int) -> list[torch.Tensor]:
        """Three GGUF linears of one x [..., K] in one call (csrc/layer.cpp), each as linear_routed
        computes it: `calls` = three (route, weight, out_features, ggml_type, bias) -> three [..., N_i]."""
        in_features = x.shape[-1]
        outs = [torch.empty(x.shape[:-1] + (call[2],), dtype=torch.float32) for call in calls]  # [..., N_i]
        args = []
        for (route, weight, out_features, ggml_type, bias), out in zip(calls, outs):
            args += (route, weight.data_ptr(), out_features, ggml_type, None if bias is None else bias.data_ptr(),
                     out.data_ptr())
        status = self._lib.sg_linear3(x.data_ptr(), x.numel() // in_features, in_features, *args, num_threads)
        if status != 0:
            raise RuntimeError(f"sg_linear3 rejected x {tuple(x.shape)} for outputs {[call[2] for call in calls]}")
        return outs

    def gate_up_silu(self, x: torch.Tensor, gate, up, num_threads: int) -> torch.Tensor:
        """silu(gate(x)) * up(x) in one call: gate / up = (route, weight, out_features, ggml_type, bias)
        as linear_routed takes them (same out_features) -> [..., N]. The projections' bits are
        linear_routed's; silu is x / (1 + exp(-x)) with csrc/layer.cpp's exp, the same bits on every build."""
        in_features, out_features = x.shape[-1], gate[2]
        out = torch.empty(x.shape[:-1] + (out_features,), dtype=torch.float32)  # [..., N]
        scratch = torch.empty_like(out)  # the up projection
        status = self._lib.sg_gate_up_silu(
            x.data_ptr(), x.numel() // in_features, in_features,
            gate[0], gate[1].data_ptr(), gate[3], None if gate[4] is None else gate[4].data_ptr(),
            up[0], up[1].data_ptr(), up[3], None if up[4] is None else up[4].data_ptr(),
            out_features, out.data_ptr(), scratch.data_ptr(), num_threads,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"sg_gate_up_silu rejected x {tuple(x.shape)} for {out_features} outputs")
        return out

    def interleaved_bytes(self, ggml_type: int, out_features: int, in_features: int) -> int:
        """Bytes of the a8 weights interleaved `interleaved_cols` output columns wide
        (csrc/a8_interleaved.cpp: Q4_K, Q6_K and the 32-weight formats; Q8_0 not on the plain AVX2
        build), or 0 where there is no such layout (another format, K not a multiple of its block)."""
        return int(self._lib.sg_interleaved_bytes(int(ggml_type), out_features, in_features))

    def interleaved_min_rows(self, ggml_type: int) -> int:
        """The fewest rows from which a linear of `ggml_type` runs faster on the interleaved copy than
        on the raw blocks (same bits either way): K-quants 2 (3 on the 256-bit builds), the 32-weight
        formats 8; 0 where the format has no copy."""
        return int(self._lib.sg_interleaved_min_rows(int(ggml_type)))

    def interleave(self, blocks: torch.Tensor, ggml_type: int, in_features: int, out: torch.Tensor) -> None:
        """blocks [N, K / block * bytes] uint8 -> out [interleaved_bytes(...)] uint8, 64-byte aligned."""
        status = self._lib.sg_interleave(int(ggml_type), blocks.data_ptr(), blocks.shape[0], in_features, out.data_ptr(), self.threads())
        if status != 0:
            raise RuntimeError(f"cannot interleave blocks {tuple(blocks.shape)} of type {ggml_type} for {in_features} inputs")

    def linear_interleaved_a8(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, ggml_type: int, bias: torch.Tensor | None,
        num_threads: int,
    ) -> torch.Tensor:
        """linear_gguf_a8 with the weights as `interleave` left them: bitwise the same result."""
        return self.linear_routed(ROUTE_INTERLEAVED_A8, x, packed, out_features, ggml_type, bias, num_threads)

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
        out = torch.empty((rows, row_bytes), dtype=torch.uint8)  # [M, K + 14 K / 32]: skinny_gemm.h, A8Row
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
            head_dim**-0.5, out.data_ptr(), self.threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"attention kernel rejected q {tuple(q.shape)} keys {tuple(keys.shape)}")
        return out

    def attention_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, span: int, mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """A layer's attention after its projections, in one call: q [B, T, H, D], k / v [B, T, H_kv, D]
        fp32; cos / sin [B, 1, T, D]; keys / values [B, H_kv, capacity, D] the layer's cache (same
        strides, rows of D contiguous), starts [B] int64 each row's first new slot, `span` the slots
        attention reads (max(starts) + T), mask [B, 1, T, span] bool or None -> [B, T, H * D].
        k rotated and v are stored at slots starts + t, then attention(rotary(q), the first `span` slots):
        rotary, the cache write and `attention` one by one give the same bits."""
        batch, num_new, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        q, k, v, cos, sin = q.contiguous(), k.contiguous(), v.contiguous(), cos.contiguous(), sin.contiguous()
        if mask is not None and (mask.shape != (batch, 1, num_new, span) or not mask.is_contiguous()):
            mask = mask.expand(batch, 1, num_new, span).contiguous()
        out = torch.empty((batch, num_new, heads * head_dim), dtype=torch.float32)  # [B, T, H * D]
        status = self._lib.sg_attention_step(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
            values.data_ptr(), keys.stride(0), keys.stride(1), starts.data_ptr(),
            None if mask is None else mask.data_ptr(), batch, heads, kv_heads, num_new, span, head_dim,
            head_dim**-0.5, out.data_ptr(), self.threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"attention step rejected q {tuple(q.shape)} k {tuple(k.shape)} over {span} slots")
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up (fp32, contiguous, same shape) with gate_up_silu's SiLU, as a new tensor."""
        out = torch.empty_like(gate)
        if self._lib.sg_silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel()) != 0:
            raise RuntimeError(f"silu_mul rejected {tuple(gate.shape)}")
        return out

    def layer(
        self, x: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor], eps: float, linears, heads: int,
        cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
        span: int, mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """A Llama block in one call (csrc/layer.cpp): x [B, T, H] fp32 contiguous -> the residual stream
        after it [B, T, H]. norms = (input, post-attention) RMSNorm weights [H]; linears = q, k, v, o,
        gate, up, down as GGUFLinear.route gives them; the attention's arguments as attention_step's
        (cos / sin [B, 1, T, D] contiguous). The bits of the block op by op."""
        batch, num_new, hidden = x.shape
        head_dim = cos.shape[-1]
        if mask is not None and (mask.shape != (batch, 1, num_new, span) or not mask.is_contiguous()):
            mask = mask.expand(batch, 1, num_new, span).contiguous()
        out = torch.empty_like(x)  # [B, T, H]
        calls = [LayerLinear(route, ggml_type, weight.data_ptr(), out_features, None if bias is None else bias.data_ptr())
                 for route, weight, out_features, ggml_type, bias in linears]
        args = LayerArgs(
            batch, num_new, hidden, heads, linears[1][2] // head_dim, head_dim, linears[4][2], eps, head_dim**-0.5,
            self.threads(), 0, x.data_ptr(), out.data_ptr(), norms[0].data_ptr(), norms[1].data_ptr(), *calls,
            cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1),
            starts.data_ptr(), span, None if mask is None else mask.data_ptr(),
        )  # fmt: skip
        status = self._lib.sg_layer(ctypes.byref(args))
        if status != 0:
            raise RuntimeError(f"sg_layer rejected x {tuple(x.shape)} over {span} slots")
        return out

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """x [..., H] fp32 contiguous, weight [H] -> (x + delta or None, RMSNorm of it [..., H]): one
        fixed per-row order on 256-bit vectors (csrc/norm.cpp), the same bits on AVX2 and AVX-512."""
        hidden = x.shape[-1]
        summed = None if delta is None else torch.empty_like(x)  # [..., H]
        normed = torch.empty_like(x)  # [..., H]
        status = self._lib.sg_rms_norm(
            x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), x.numel() // hidden, hidden,
            eps, None if summed is None else summed.data_ptr(), normed.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"rms_norm kernel rejected x {tuple(x.shape)}")
        return summed, normed

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


_LIBRARIES: dict[tuple, SkinnyGemmLibrary | KernelUnavailable] = {}  # per (compiler, isa, dir): loaded, or why not
_BUILD_LOCK = threading.Lock()


def load_library(
    compiler: str | None = None, isa: str | None = None, cache_dir: Path | None = None
) -> SkinnyGemmLibrary:
    """Build (once, cached on disk) and load the kernel; raises KernelUnavailable with the reason.

    `isa`: "avx512", "avx2-vnni" or "avx2"; None = $SPECDEC_KERNEL_ISA, else the widest this CPU has
    (avx2 where the compiler cannot build avx2-vnni). Results are
    bitwise reproducible per ISA (the fp32 paths of AVX-512 and AVX2 sum in different orders;
    avx2-vnni is the AVX2 build with VNNI dot products: AVX2's bits in every mode). A build that
    failed is not tried again in the same process (the same reason is raised)."""
    pinned = isa or os.environ.get(ENV_ISA) or None
    widest = resolve_isa(isa)
    # unpinned avx2-vnni: a compiler without AVX-VNNI intrinsics (gcc < 11) gives the AVX2 build
    candidates = [widest, "avx2"] if widest == "avx2-vnni" and not pinned else [widest]
    cxx = require_compiler(compiler)
    cache_dir = Path(cache_dir) if cache_dir is not None else kernel_cache_dir()
    first_failure = None
    for candidate in candidates:
        key = (cxx, candidate, str(cache_dir))
        with _BUILD_LOCK:
            if key not in _LIBRARIES:
                _LIBRARIES[key] = _build_and_load(cxx, candidate, cache_dir)
            loaded = _LIBRARIES[key]
        if not isinstance(loaded, KernelUnavailable):
            return loaded
        first_failure = first_failure or loaded
    raise KernelUnavailable(str(first_failure))


def _build_and_load(cxx: str, isa: str, cache_dir: Path) -> SkinnyGemmLibrary | KernelUnavailable:
    try:
        path = build_library(cxx, isa, cache_dir)
    except KernelUnavailable as exc:
        return exc
    try:
        return SkinnyGemmLibrary(path, isa)
    except KernelUnavailable as exc:
        path.unlink(missing_ok=True)  # a damaged cache entry: rebuilt by the next process
        return exc
