"""CPU kernels: a batch-invariant skinny GEMM so verifying k tokens costs about one decode step.

    from specdec.kernels import fast_linear_modules
    info = fast_linear_modules(model)          # every nn.Linear -> FastLinear, in place
    # info == {"backend": "cpp", "count": ..., "batch_invariant": True, "reason": ...}

SPECDEC_LINEAR=torch (or fast_linear_modules(model, backend="torch")) keeps plain F.linear;
backend="int8" (or SPECDEC_LINEAR=int8) is the opt-in, lossy weight-only int8 path.
GGUFLinear / GGUFEmbedding (gguf_linear.py) keep a GGUF file's quantized blocks and compute
bitwise what the fp32 kernel computes on the dequantized weights.

The modules: build.py (compiler, ISA flags, the build into the cache at first use), library.py
(the compiled kernel through ctypes), backends.py (the linear backends, FastLinear, attention
and rotary), gguf_linear.py; the C++ source is csrc/.
"""

from .backends import (
    BACKENDS,
    CppSkinnyLinear,
    FastLinear,
    Int8SkinnyLinear,
    RowwiseTorchLinear,
    TorchLinear,
    fast_linear_modules,
    make_backend,
    quantize_int8,
)
from .build import KernelUnavailable, cpu_isa, kernel_cache_dir
from .gguf_linear import KERNEL_TYPES, GGUFEmbedding, GGUFLinear, dequantize_blocks, gguf_module, huge_page_buffer
from .library import load_library

__all__ = [
    "BACKENDS",
    "CppSkinnyLinear",
    "FastLinear",
    "GGUFEmbedding",
    "GGUFLinear",
    "KERNEL_TYPES",
    "Int8SkinnyLinear",
    "KernelUnavailable",
    "RowwiseTorchLinear",
    "TorchLinear",
    "cpu_isa",
    "dequantize_blocks",
    "fast_linear_modules",
    "gguf_module",
    "huge_page_buffer",
    "kernel_cache_dir",
    "load_library",
    "make_backend",
    "quantize_int8",
]
