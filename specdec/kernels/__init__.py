"""CPU kernels: a batch-invariant skinny GEMM so verifying k tokens costs about one decode step.

    from specdec.kernels import fast_linear_modules
    info = fast_linear_modules(model)          # every nn.Linear -> FastLinear, in place
    # info == {"backend": "cpp", "count": ..., "batch_invariant": True, "reason": ...}

SPECDEC_LINEAR=torch (or fast_linear_modules(model, backend="torch")) keeps plain F.linear;
backend="int8" (or SPECDEC_LINEAR=int8) is the opt-in, lossy weight-only int8 path.
"""

from .skinny_gemm import (
    BACKENDS,
    CppSkinnyLinear,
    FastLinear,
    Int8SkinnyLinear,
    KernelUnavailable,
    RowwiseTorchLinear,
    TorchLinear,
    cpu_isa,
    fast_linear_modules,
    kernel_cache_dir,
    load_library,
    make_backend,
    quantize_int8,
)

__all__ = [
    "BACKENDS",
    "CppSkinnyLinear",
    "FastLinear",
    "Int8SkinnyLinear",
    "KernelUnavailable",
    "RowwiseTorchLinear",
    "TorchLinear",
    "cpu_isa",
    "fast_linear_modules",
    "kernel_cache_dir",
    "load_library",
    "make_backend",
    "quantize_int8",
]
