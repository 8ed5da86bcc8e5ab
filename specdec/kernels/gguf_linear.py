"""GGUF weights as the file stores them: linear and embedding modules over ggml blocks.

A GGUF model's weights are quantized blocks (Q4_K, Q6_K, Q8_0, ...). `GGUFLinear` keeps them as
they are ([out, in / block * bytes] uint8, ggml's row layout) and the batch-invariant kernel
dequantizes each weight in registers with gguf-py's own per-weight expression before the fixed
order fp32 FMA accumulation (`csrc/`). So

    GGUFLinear(blocks, type, K)(x) == FastLinear on dequantize_blocks(blocks, type)   (bitwise)

for every row count and thread count, while reading ~4-7x fewer bytes than the fp32 matrix and
never materialising it. `GGUFEmbedding` dequantizes only the looked-up rows.

`GGUFLinear(..., activations="int8")` is the int8-activation mode (weights="gguf-a8"): x is
quantized per block of 32 to int8 with an fp32 scale and each weight sub-block costs one exact
integer dot product (VNNI / AVX2 maddubs). Lossy vs fp32 activations, still bitwise batch
invariant (and the same bits on AVX2 and AVX-512), so speculation is exact w.r.t. this model.

Both modules keep the blocks in a `weight` Parameter (uint8, no grad) so byte counts over
`parameters()` and weight tying work as for nn.Linear; `fp32_weight()` is the dense matrix for
code that needs one (training heads, other dtypes, autograd: a temporary copy each call).
"""

from __future__ import annotations

import mmap

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .backends import CppSkinnyLinear
from .library import ROUTE_A8, ROUTE_EXACT, ROUTE_INTERLEAVED_A8

# The GGUF block types the kernel computes on (ggml type ids, as gguf.GGMLQuantizationType).
KERNEL_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
_FP32 = torch.float32
ACTIVATIONS = ("fp32", "int8")  # GGUFLinear's activation modes: exact fp32, or int8 blocks (a8)
# The most rows the interleaved copy runs where AMX tiles are on (a 1.5B forward on Sapphire Rapids,
# gguf-a8, 2 threads, copy vs AMX: 177 vs 198 ms at 24 rows, 231 vs 216 at 32; docs/performance.md). The fewest:
# the library's interleaved_min_rows (fewer rows stream the raw blocks as fast or faster).
INTERLEAVED_ROWS_OVER_AMX = 24
AMX_TYPES = frozenset(KERNEL_TYPES[name] for name in ("Q4_K", "Q5_K", "Q6_K"))  # the formats csrc/amx.cpp runs


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(int(ggml_type)).name


def block_layout(ggml_type: int) -> tuple[int, int]:
    """(weights, bytes) per block, from gguf-py's table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]


def dequantize_blocks(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """blocks [N, row_bytes] uint8 -> fp32 [N, K] exactly as `gguf.quants.dequantize` computes it
    (the dequantized-fp32 path and the reference the kernel must equal bitwise)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    array = dequantize(blocks.detach().cpu().numpy(), GGMLQuantizationType(int(ggml_type)))
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


_HUGE_PAGE = 2 * 1024 * 1024


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor [nbytes] in private anonymous memory advised for 2 MiB (transparent
    huge) pages, starting on a 2 MiB boundary; the tensor keeps its mapping alive.

    Why: a forward streams every weight byte once, so with 4 KiB pages it also walks a page-table
    entry per 4 KiB (~250k per Qwen2.5-Coder-1.5B forward, each a nested walk in a VM). Measured
    on the 1.5B (gguf-a8, 1 thread, 1 token): ~15% less time per forward, the LM head ~25% less.
    Where the OS has no transparent huge pages (or refuses the advice) it is ordinary memory."""
    length = nbytes + _HUGE_PAGE  # room to start on a 2 MiB boundary
    arena = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory gets no THP
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            arena.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    whole = torch.frombuffer(arena, dtype=torch.uint8)  # holds a reference to `arena`
    start = -whole.data_ptr() % _HUGE_PAGE
    return whole[start:start + nbytes]


def aligned_buffer(nbytes: int, alignment: int = 64) -> torch.Tensor:
    """An uninitialised uint8 tensor [nbytes] starting on an `alignment`-byte boundary (ordinary
    pages). For copies smaller than a huge page: huge_page_buffer rounds each to a whole 2 MiB page
    once the kernel touches it (a 128 x 896 Q5_0 copy of 4 KB would hold 2 MiB)."""
    whole = torch.empty(nbytes + alignment, dtype=torch.uint8)
    start = -whole.data_ptr() % alignment
    return whole[start:start + nbytes]


def _checked_blocks(blocks: torch.Tensor, ggml_type: int, in_features: int, backend: CppSkinnyLinear) -> None:
    name = type_name(ggml_type)
    layout = backend.library.block_layout(ggml_type)
    if layout is None or int(ggml_type) not in KERNEL_TYPES.values():
        raise ValueError(f"the kernel does not compute on GGUF type {name}; it knows {', '.join(KERNEL_TYPES)}")
    if layout != block_layout(ggml_type):
        raise RuntimeError(f"kernel block layout {layout} for {name} differs from gguf's {block_layout(ggml_type)}")
    block, nbytes = layout
    if in_features % block:
        raise ValueError(f"{name} rows hold a multiple of {block} weights; in_features is {in_features}")
    row_bytes = in_features // block * nbytes
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes or not blocks.is_contiguous():
        raise ValueError(
            f"{name} weight must be contiguous uint8 [out, {row_bytes}] for {in_features} inputs; "
            f"got {blocks.dtype} {tuple(blocks.shape)}"
        )


def _as_parameter(tensor: torch.Tensor | None) -> nn.Parameter | None:
    if tensor is None or isinstance(tensor, nn.Parameter):
        return tensor
    return nn.Parameter(tensor, requires_grad=False)


class GGUFLinear(nn.Module):
    """y = x W^T (+ b) with W kept as GGUF blocks; bitwise the kernel on the dequantized W."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None = None,
                 backend: CppSkinnyLinear | None = None, activations: str = "fp32"):
        super().__init__()
        self.backend = backend or CppSkinnyLinear()
        _checked_blocks(blocks, ggml_type, in_features, self.backend)
        self.weight = _as_parameter(blocks)  # [out, in / block * bytes] uint8; tied weights share it
        self.bias = _as_parameter(bias)  # [out] fp32 or None
        self.ggml_type = int(ggml_type)
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.set_activations(activations)

    def set_activations(self, activations: str) -> None:
        """Run on fp32 activations (exact) or int8 ones (the gguf-a8 mode). int8 layers of the formats the
        library interleaves also hold the blocks interleaved 16 (AVX-512 VNNI) or 8 output columns wide
        (csrc/a8_interleaved.cpp: the same bits at fewer instructions per row), run from the library's
        `interleaved_min_rows(type)` rows on; `weight` stays the file's blocks (tying, lookups,
        fp32_weight, exports, fewer rows, and AMX tiles past INTERLEAVED_ROWS_OVER_AMX rows read them)."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.activations = activations
        self.interleaved_weight = self._interleaved() if activations == "int8" else None
        # (fewest rows on the copy, most rows on it where AMX tiles run this format, or None)
        self._copy_rows = None if self.interleaved_weight is None else (
            self.backend.library.interleaved_min_rows(self.ggml_type),
            INTERLEAVED_ROWS_OVER_AMX if self.ggml_type in AMX_TYPES else None)

    def _interleaved(self) -> torch.Tensor | None:
        library = self.backend.library
        nbytes = library.interleaved_bytes(self.ggml_type, self.out_features, self.in_features)
        if not nbytes or not library.interleave_weights:
            return None
        packed = huge_page_buffer(nbytes) if nbytes >= _HUGE_PAGE else aligned_buffer(nbytes)
        library.interleave(self.weight, self.ggml_type, self.in_features, packed)
        return packed

    def runs_in_kernel(self, x: torch.Tensor) -> bool:
        """Whether forward(x) runs in the kernel: fp32 CPU inference with x of this layer's width."""
        bias = self.bias
        return (
            x.dtype is _FP32 and x.is_cpu and x.shape[-1] == self.in_features and x.numel() > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)))
            and (bias is None or (bias.dtype is _FP32 and bias.is_contiguous()))
        )  # fmt: skip

    def route(self, rows: int) -> tuple[int, torch.Tensor, int, int, torch.Tensor | None]:
        """How the kernel runs `rows` rows: (route id, weight it reads, out_features, ggml type, bias), as
        SkinnyGemmLibrary.linear_routed takes them. The interleaved copy from the library's
        interleaved_min_rows(type) rows (and past INTERLEAVED_ROWS_OVER_AMX rows only where AMX is off),
        else the blocks as stored."""
        if self.interleaved_weight is not None:
            fewest, most_over_amx = self._copy_rows
            if rows >= fewest and (most_over_amx is None or rows <= most_over_amx or not self.backend.library.amx):
                return ROUTE_INTERLEAVED_A8, self.interleaved_weight, self.out_features, self.ggml_type, self.bias
        route = ROUTE_A8 if self.activations == "int8" else ROUTE_EXACT
        return route, self.weight, self.out_features, self.ggml_type, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if self.runs_in_kernel(x):
            if not x.is_contiguous():
                x = x.contiguous()
            library = self.backend.library
            route, weight, out_features, ggml_type, bias = self.route(x.numel() // self.in_features)
            return library.linear_routed(route, x, weight, out_features, ggml_type, bias, library.threads())
        # other dtypes, autograd, empty or mis-shaped input: F.linear on a temporary dense copy
        # (fp32 activations also in int8 mode: autograd through the a8 rounding has no use)
        weight = self.fp32_weight().to(x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def fp32_weight(self) -> torch.Tensor:
        """The dequantized matrix [out, in] fp32 (a new tensor each call)."""
        return dequantize_blocks(self.weight, self.ggml_type)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"type={type_name(self.ggml_type)}, activations={self.activations}"
                + (", interleaved" if self.interleaved_weight is not None else ""))


class GGUFEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks: a lookup dequantizes only the rows it returns."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, embedding_dim: int, backend: CppSkinnyLinear | None = None):
        super().__init__()
        self.backend = backend or CppSkinnyLinear()
        _checked_blocks(blocks, ggml_type, embedding_dim, self.backend)
        self.weight = _as_parameter(blocks)  # [vocab, dim / block * bytes] uint8
        self.ggml_type = int(ggml_type)
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = embedding_dim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [...] -> [..., dim] fp32
        tokens = tokens.to(torch.int64)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings}): {tokens.min()}..{tokens.max()}")
        return self.backend.library.dequantize_rows(self.weight, self.ggml_type, self.embedding_dim, tokens.cpu())

    def fp32_weight(self) -> torch.Tensor:
        """The dequantized table [vocab, dim] fp32 (a new tensor each call)."""
        return dequantize_blocks(self.weight, self.ggml_type)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={type_name(self.ggml_type)}"


def gguf_module(module: nn.Module, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None,
                backend: CppSkinnyLinear, activations: str = "fp32") -> nn.Module:
    """The GGUF counterpart of an nn.Linear or nn.Embedding of the same shape (possibly on meta).
    `activations` applies to linears (an embedding lookup has no activations to quantize)."""
    if isinstance(module, nn.Embedding):
        if bias is not None:
            raise ValueError("an embedding has no bias")
        return GGUFEmbedding(blocks, ggml_type, module.embedding_dim, backend)
    if isinstance(module, nn.Linear):
        if blocks.shape[0] != module.out_features:
            raise ValueError(f"{type_name(ggml_type)} weight has {blocks.shape[0]} rows, the layer {module.out_features} outputs")
        return GGUFLinear(blocks, ggml_type, module.in_features, bias, backend, activations)
    raise TypeError(f"only nn.Linear and nn.Embedding can hold GGUF blocks, not {type(module).__name__}")
