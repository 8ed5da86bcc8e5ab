"""Linear backends for `nn.Linear` on CPU, and the attention and rotary ops that go with them.

Decode is memory-bound: a forward over k <= ~10 new tokens should cost about one weight
stream, like a 1-token step. MKL's fp32 GEMM does not deliver that on small CPUs (2.3-2.9x
at k = 8) and, summing in a different order for 1 row than for 8, can flip a greedy argmax
on a near-tie. The compiled kernel (csrc/, loaded by library.py) reads each weight row once
for all rows and computes every output with the same instruction sequence whatever the row
count, so row i of a k-row call is bitwise equal to that row run alone.

Backends (a registry, looked up by name):

    "cpp"      the compiled kernel (fp32, AVX-512 or AVX2+FMA), built at first use (build.py).
               Other dtypes (bf16) go through F.linear.
    "torch"    F.linear: exactly the plain nn.Linear behaviour (fast, not batch invariant).
    "rowwise"  F.linear one row at a time: batch invariant in pure PyTorch, but k rows cost k
               single-row calls (no use for speculative verification; a reference).
    "int8"     opt-in, LOSSY vs fp32: weight-only int8 (per-row scales) in the same kernel; 4x
               fewer weight bytes, so plain decoding gets faster too. Same batch invariance.
    "auto"     $SPECDEC_LINEAR if set, else "cpp" when it can be built here, else "torch" (said
               once on stderr, with the reason: decoding is then about half as fast).

Environment: SPECDEC_LINEAR=torch turns the fast path off for "auto" callers.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .build import KernelUnavailable
from .library import load_library

ENV_BACKEND = "SPECDEC_LINEAR"
# The most rows a block runs in one kernel call (run_layer): a decode, verify or tree step; longer
# prefills are bound by the linears' arithmetic, not by calls, and would hold larger scratch.
MAX_LAYER_ROWS = 64
_FP32 = torch.float32
log = logging.getLogger(__name__)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as torch computes it: x [..., H], weight [H] -> [..., H]."""
    # normalise in fp32 like the reference implementation, then cast back
    if x.dtype is not torch.float32 or torch.is_grad_enabled():
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)
    # fp32 inference: the same operations, so the same bits, in place on the temporaries: two casts
    # and three allocations fewer per norm
    scale = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [..., 1]
    return (x * scale).mul_(weight)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (x + delta, rms_norm(x + delta)), [..., H] each."""
    summed = x + delta
    return summed, rms_norm(summed, weight, eps)


def separate_linears(x: torch.Tensor, layers) -> list[torch.Tensor]:
    """Each layer on the same x, one call each: [layer(x) for layer in layers]."""
    return [layer(x) for layer in layers]


def separate_gate_up_silu(x: torch.Tensor, gate: nn.Module, up: nn.Module) -> torch.Tensor:
    """The SwiGLU MLP's silu(gate(x)) * up(x) by torch's ops."""
    return torch_silu_mul(gate(x), up(x))


def torch_silu_mul(gated: torch.Tensor, upped: torch.Tensor) -> torch.Tensor:
    """silu(gated) * upped by torch's ops."""
    if torch.is_grad_enabled():
        return F.silu(gated) * upped
    return F.silu(gated).mul_(upped)  # the product in place on silu's own temporary


def composed_attention_step(kernels, q, k, v, cos, sin, cache, layer: int, mask) -> torch.Tensor:
    """A layer's attention after its projections, op by op on any backend: q [B, T, H, D], k / v
    [B, T, H_kv, D]; rotated k and v written into `cache`'s `layer`, then `kernels.attention` over it
    -> [B, T, H * D] (o_proj's input)."""
    keys, values = cache.write(layer, kernels.rotary(k, cos, sin), v.transpose(1, 2))  # [B, H_kv, S, D]
    out = kernels.attention(kernels.rotary(q, cos, sin), keys, values, mask)  # [B, H, T, D]
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


class TorchOps:
    """The ops between a layer's linears as torch computes them: the torch backends' (the compiled
    backends run them in the kernel)."""

    attention = staticmethod(sdpa_attention)
    rotary = staticmethod(torch_rotary)
    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    attention_step = composed_attention_step
    linears = staticmethod(separate_linears)
    gate_up_silu = staticmethod(separate_gate_up_silu)
    run_layer = staticmethod(lambda block, x, cos, sin, cache, layer, mask: None)  # no one-call block: op by op


class TorchLinear(TorchOps):
    """F.linear: plain nn.Linear behaviour (MKL/oneDNN). Fast, not batch invariant."""

    name = "torch"

    def __init__(self, compiler: str | None = None):
        pass  # nothing to build; same constructor as every backend

    def batch_invariant(self, dtype: torch.dtype) -> bool:
        return False

    def prepare(self, weight: torch.Tensor) -> None:
        """Make now whatever the first `linear` with `weight` would make (nothing here)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class RowwiseTorchLinear(TorchOps):
    """Each row through its own 1-row F.linear: batch invariant without a compiler, k rows cost ~k x."""

    name = "rowwise"

    def __init__(self, compiler: str | None = None):
        pass

    def batch_invariant(self, dtype: torch.dtype) -> bool:
        return True

    def prepare(self, weight: torch.Tensor) -> None:
        pass  # nothing made on first use

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

    def prepare(self, weight: torch.Tensor) -> None:
        """Make now whatever the first `linear` with `weight` would make (the fp32 kernel: nothing)."""

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

    def attention_step(self, q, k, v, cos, sin, cache, layer: int, mask) -> torch.Tensor:
        """composed_attention_step's result (bitwise) in one kernel call for fp32 CPU inference: q
        [B, T, H, D], k / v [B, T, H_kv, D] -> [B, T, H * D]; anything else op by op."""
        batch, num_new, _, head_dim = q.shape
        if _fp32_inference(q, k, v, cos, sin) and not head_dim % 2 and cos.shape == (batch, 1, num_new, head_dim) \
                and sin.shape == cos.shape and cache.dtype is _FP32:
            keys, values, span = cache.layer_for_write(layer, num_new)
            if keys.stride() == values.stride() and keys.stride()[2:] == (head_dim, 1):
                return self.library.attention_step(q, k, v, cos, sin, keys, values, cache.lengths, span, mask)
        return composed_attention_step(self, q, k, v, cos, sin, cache, layer, mask)

    def run_layer(self, block, x, cos, sin, cache, layer: int, mask) -> torch.Tensor | None:
        """A Llama block (duck-typed: input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
        mlp.{gate,up,down}_proj) on x [B, T, H] in one kernel call (sg_layer), bitwise its op-by-op
        forward: for fp32 inference of at most MAX_LAYER_ROWS rows with GGUF linears, no q / k norm and
        an fp32 KV cache. Otherwise None: the caller runs the block op by op."""
        attention, mlp, norm1, norm2 = block.self_attn, block.mlp, block.input_layernorm, block.post_attention_layernorm
        batch, num_new, _ = x.shape
        head_dim = attention.head_dim
        linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj,
                   mlp.down_proj)
        if (
            batch * num_new > MAX_LAYER_ROWS or attention.qk_norm or norm1.eps != norm2.eps or head_dim % 2
            or not (_fp32_inference(x, cos, sin, norm1.weight, norm2.weight) and x.is_contiguous())
            or cos.shape != (batch, 1, num_new, head_dim) or sin.shape != cos.shape or cache.dtype is not _FP32
            or not all(hasattr(linear, "route") for linear in linears)  # GGUFLinear, all seven
            or not all(linear.runs_in_kernel(x) for linear in linears if linear.in_features == x.shape[-1])
            or attention.o_proj.in_features != attention.num_heads * head_dim
            or not (mlp.gate_proj.out_features == mlp.up_proj.out_features == mlp.down_proj.in_features)
            or not all(_fp32_inference(linear.bias) and linear.bias.is_contiguous() for linear in
                       (attention.o_proj, mlp.down_proj) if linear.bias is not None)
        ):  # fmt: skip
            return None
        keys, values, span = cache.layer_for_write(layer, num_new)
        if keys.stride() != values.stride() or keys.stride()[2:] != (head_dim, 1):
            return None
        rows = batch * num_new
        return self.library.layer(
            x, (norm1.weight, norm2.weight), norm1.eps, [linear.route(rows) for linear in linears], attention.num_heads,
            cos.contiguous(), sin.contiguous(), keys, values, cache.lengths, span, mask,
        )  # fmt: skip

    def linears(self, x: torch.Tensor, layers) -> list[torch.Tensor]:
        """[layer(x) for layer in layers], bitwise, in one kernel call where they are three GGUF linears
        the kernel runs on x (a layer's q / k / v); otherwise one call each."""
        if len(layers) == 3 and all(getattr(layer, "runs_in_kernel", None) and layer.runs_in_kernel(x) for layer in layers):
            x = x.contiguous()
            rows = x.numel() // x.shape[-1]
            return self.library.linear3(x, [layer.route(rows) for layer in layers], self.library.threads())
        return separate_linears(x, layers)

    def gate_up_silu(self, x: torch.Tensor, gate: nn.Module, up: nn.Module) -> torch.Tensor:
        """silu(gate(x)) * up(x) with the kernel's SiLU (its own exp: close to torch's silu, not its bits)
        for fp32 inference, so dense and GGUF weights of one model agree bitwise: in one kernel call for
        two GGUF linears the kernel runs on x, else the projections one by one. Otherwise torch's."""
        if all(getattr(layer, "runs_in_kernel", None) and layer.runs_in_kernel(x) for layer in (gate, up)) \
                and gate.out_features == up.out_features:
            x = x.contiguous()
            rows = x.numel() // x.shape[-1]
            return self.library.gate_up_silu(x, gate.route(rows), up.route(rows), self.library.threads())
        if _fp32_inference(x):
            gated, upped = gate(x), up(x)  # [..., I] each
            if _fp32_inference(gated, upped) and gated.shape == upped.shape and gated.is_contiguous() and upped.is_contiguous():
                return self.library.silu_mul(gated, upped)
            return torch_silu_mul(gated, upped)
        return separate_gate_up_silu(x, gate, up)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm in the kernel for fp32 CPU inference (its own fixed order: csrc/norm.cpp), else torch's."""
        if not (_fp32_inference(x, weight) and x.is_contiguous() and weight.is_contiguous()):
            return rms_norm(x, weight, eps)
        return self.library.rms_norm(x, weight, eps)[1]

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
        """(x + delta, its RMSNorm) in one kernel pass for fp32 CPU inference, else torch's."""
        if not (_fp32_inference(x, delta, weight) and x.shape == delta.shape and x.is_contiguous()
                and delta.is_contiguous() and weight.is_contiguous()):
            return add_rms_norm(x, delta, weight, eps)
        return self.library.rms_norm(x, weight, eps, delta)

    def __reduce__(self):
        return (type(self), self._options)


def _fp32_inference(*tensors: torch.Tensor) -> bool:
    """Every tensor fp32 on the CPU and no autograd through them (the kernels have no backward)."""
    grad = torch.is_grad_enabled()
    return all(t.dtype is _FP32 and t.is_cpu and not (grad and t.requires_grad) for t in tensors)


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
        return self.library.linear_f32(x, weight, bias, self.library.threads())  # [..., N]

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

    def prepare(self, weight: torch.Tensor) -> None:
        """The int8 copy now (at load) rather than in the first call (a request's first draft)."""
        self.quantized(weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not CppSkinnyLinear._kernel_applies(x, weight, bias):
            return F.linear(x, weight, bias)
        if not x.is_contiguous():
            x = x.contiguous()
        quantized, scale = self.quantized(weight)
        return self.library.linear_int8(x, quantized, scale, bias, self.library.threads())  # [..., N]


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
                _say_once_torch_runs_instead(_one_line(str(exc)))
                return BackendChoice(TorchLinear(), f"auto: fell back to torch ({exc})")
        if name not in BACKENDS:
            raise ValueError(f"{ENV_BACKEND}={name!r} is not a linear backend; choose from {['auto', *BACKENDS]}")
    if name not in BACKENDS:
        raise ValueError(f"unknown linear backend {name!r}; choose from {['auto', *BACKENDS]}")
    return BackendChoice(BACKENDS[name](compiler=compiler), f"requested {name!r}")


@cache
def _say_once_torch_runs_instead(reason: str) -> None:
    """One stderr line per process (and reason): without the kernel decoding is about half as fast."""
    log.warning(f"specdec: the compiled CPU kernel could not be built or loaded ({reason}); decoding runs on "
                f"the slower PyTorch path ({ENV_BACKEND}=torch chooses it without this message)")


def _one_line(reason: str, limit: int = 400) -> str:
    """A build failure's message (the compiler's stderr after its first line) as one line: the first
    line and the compiler's first error."""
    first, *rest = reason.splitlines() or [""]
    error = next((line.strip() for line in rest if "error" in line.lower()), "")
    text = f"{first.rstrip(':')}: {error}" if error else first
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
