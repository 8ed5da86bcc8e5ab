"""Native Llama-family forward: Llama, Mistral, SmolLM (llama arch), Qwen2 (qkv bias), Qwen3 (qk-norm).

One readable file in the spirit of gpt-fast: RMSNorm, rotary embedding, grouped-query
attention over `KVCache` with an explicit mask (tree attention is just a mask), SwiGLU MLP.
Parameter names equal transformers' so an HF checkpoint (config.json + safetensors) loads
as is. Every projection is an `nn.Linear`, so a faster linear kernel can be swapped in
module by module without touching this file: `fast_linear_modules` for dense weights, and for a
GGUF-sourced checkpoint `GGUFLinear` / `GGUFEmbedding`, which keep the file's quantized blocks
(see `load_native`'s `weights`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ..kernels.backends import TorchLinear, rms_norm, separate_gate_up_silu
from ..kv_cache import KVCache
from ..paths import read_marker
from .base import Target

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """positions [B, T] -> rotary (cos, sin) [B, 1, T, D] in `dtype` (the table stays fp32)."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg, qk_norm: bool, qkv_bias: bool):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # Qwen2 has q/k/v biases only; Llama/Qwen3 put `attention_bias` on all four projections
        o_bias = bool(getattr(cfg, "attention_bias", False)) and cfg.model_type != "qwen2"
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = qk_norm
        self.kernels = TorchLinear()  # attention backend; load_native swaps in the batch-invariant kernel's

    def forward(self, x, cos, sin, cache: KVCache, layer_slot: int, mask, rows: "PackedRows | None" = None):
        batch, num_new, _ = x.shape
        q, k, v = packed_linears(self.kernels, (self.q_proj, self.k_proj, self.v_proj), x, rows)
        q = q.view(batch, num_new, self.num_heads, self.head_dim)
        k = k.view(batch, num_new, self.num_kv_heads, self.head_dim)
        v = v.view(batch, num_new, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # rotary, the cache write and attention: one kernel call with the compiled backend
        out = self.kernels.attention_step(q, k, v, cos, sin, cache, layer_slot, mask)  # [B, T, H * D]
        return packed_linear(self.o_proj, out, rows)

    def write_keys(self, x, cos, sin, cache: KVCache, layer_slot: int, rows: "PackedRows | None" = None):
        """Write x's [B, T, H] rotated keys / values into the cache; returns all of the slot's
        (keys, values) [B, H_kv, S, D]."""
        batch, num_new, _ = x.shape
        k = packed_linear(self.k_proj, x, rows).view(batch, num_new, self.num_kv_heads, self.head_dim)
        v = packed_linear(self.v_proj, x, rows).view(batch, num_new, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        return cache.write(layer_slot, self.kernels.rotary(k, cos, sin), v.transpose(1, 2))

    def attend(self, x, cos, sin, keys, values, mask, rows: "PackedRows | None" = None, attention=None) -> torch.Tensor:
        """x's queries [B, T, H] over (keys, values) -> the attention output after o_proj [B, T, H].
        Apart from write_keys, a pass can give keys for more rows than it computes outputs for (a
        drafter's training: prompt rows only as context). `attention(q, keys, values, mask)`
        replaces the backend's (a training pass that knows its mask's structure)."""
        batch, num_new, _ = x.shape
        q = packed_linear(self.q_proj, x, rows).view(batch, num_new, self.num_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        attention = attention or self.kernels.attention
        out = attention(self.kernels.rotary(q, cos, sin), keys, values, mask)  # [B, heads, T, D]
        return packed_linear(self.o_proj, out.transpose(1, 2).reshape(batch, num_new, -1), rows)


class PackedRows:
    """The real (non-padding) token rows of a [B, T] batch whose rows carry different numbers of
    draft tokens. Linear layers run on just these N rows — their cost grows with rows on a CPU —
    and scatter back; padding rows get zeros (they are masked out and their outputs dropped).
    Attention still runs on the padded layout (per-row caches)."""

    def __init__(self, token_valid: torch.Tensor):
        self.shape = tuple(token_valid.shape)  # (B, T)
        self.index = token_valid.reshape(-1).nonzero().squeeze(1)  # [N] flat row ids

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1]).index_select(0, self.index)  # [N, H]

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        out = y.new_zeros(self.shape[0] * self.shape[1], y.shape[-1])
        out.index_copy_(0, self.index, y)
        return out.view(*self.shape, y.shape[-1])  # [B, T, H_out]


def packed_linear(layer, x: torch.Tensor, rows: PackedRows | None) -> torch.Tensor:
    """layer(x) over x [B, T, H]; with `rows`, only the real token rows are computed."""
    if rows is None:
        return layer(x)
    return rows.scatter(layer(rows.gather(x)))


def packed_linears(kernels, layers, x: torch.Tensor, rows: PackedRows | None) -> list[torch.Tensor]:
    """packed_linear of each layer on the same x, through `kernels.linears` (one kernel call for a q / k / v)."""
    if rows is None:
        return kernels.linears(x, layers)
    return [rows.scatter(y) for y in kernels.linears(rows.gather(x), layers)]


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x, rows: PackedRows | None = None, kernels=None):
        """x [..., H] -> down(silu(gate(x)) * up(x)); `kernels` (a linear backend) may run the gate, up
        and SiLU product in one call (the compiled kernel's, for GGUF weights)."""
        if rows is not None:  # the MLP is per token: run it on the real rows only
            return rows.scatter(self.forward(rows.gather(x), kernels=kernels))
        activated = (kernels.gate_up_silu if kernels is not None else separate_gate_up_silu)(x, self.gate_proj, self.up_proj)
        return self.down_proj(activated)  # [..., H]


class Block(nn.Module):
    def __init__(self, cfg, qk_norm: bool, qkv_bias: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qk_norm, qkv_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, layer_slot, mask, rows: PackedRows | None = None):
        if rows is None:  # few rows on the compiled backend: the whole block in one kernel call, the same bits
            done = self.self_attn.kernels.run_layer(self, x, cos, sin, cache, layer_slot, mask)
            if done is not None:
                return done
        return self.run_ops(x, cos, sin, cache, layer_slot, mask, rows)

    def run_ops(self, x, cos, sin, cache, layer_slot, mask, rows: PackedRows | None = None):
        """The block op by op: x [B, T, H] -> the residual stream after it [B, T, H]."""
        kernels = self.self_attn.kernels  # the norms run in the attention's backend (the kernel's own with it)
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        attended = self.self_attn(kernels.rms_norm(x, norm1.weight, norm1.eps), cos, sin, cache, layer_slot, mask, rows)
        x, normed = kernels.add_rms_norm(x, attended, norm2.weight, norm2.eps)  # the residual add and the norm in one pass
        return x + self.mlp(normed, rows, kernels)


class Backbone(nn.Module):
    """`model.*` of the HF checkpoint: embeddings, blocks, final norm."""

    def __init__(self, cfg, qk_norm: bool, qkv_bias: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, qk_norm, qkv_bias) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def block_flags(cfg) -> tuple[bool, bool]:
    """(qk_norm, qkv_bias) of a block of this model type."""
    return cfg.model_type == "qwen3", cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"native runtime supports {SUPPORTED_MODEL_TYPES}, not {cfg.model_type!r}")
        qk_norm, qkv_bias = block_flags(cfg)
        self.config = cfg
        self.model = Backbone(cfg, qk_norm, qkv_bias)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]

    @property
    def kernels(self):
        """The backend of attention and norms (load_native gives every layer the kernel's)."""
        return self.model.layers[0].self_attn.kernels

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rotary_cos_sin(positions, self.inv_freq, self.attention_scaling, dtype)  # [B, 1, T, D] each

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        attn_mask: torch.Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        layer_ids: Sequence[int] | None = None,
        token_valid: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        lm_head: nn.Module | None = None,
    ):
        """tokens / positions [B, T]; attn_mask [B, T, T] among new tokens or None (causal).

        `layer_ids` runs only a subset of blocks (layer-skip self-drafting); the cache then has
        one slot per listed block. `token_valid [B, T]` (bool) marks real tokens in a padded
        batch: linear layers and the LM head skip the others, whose logits/hiddens are zeros.
        `logits_at [B]` (long) asks for one row's logits per batch row (a prefill needs only each
        prompt's last): the LM head runs on those B rows only and logits are [B, 1, V].
        `lm_head` replaces the model's own LM head for this call (a draft model's reduced draft
        vocabulary: logits [..., V'] in its row order).
        Returns (logits [B, T, V] float32, {layer: hidden [B, T, H]}).
        """
        batch, num_new = tokens.shape
        cache.make_room(num_new)  # grows the cache (chunks) or raises past its limit
        if attn_mask is None and batch == 1 and num_new == 1:
            mask = None  # one query sees every committed slot: no mask needed
        else:
            mask = cache.attention_mask(num_new, None if attn_mask is None else attn_mask.reshape(batch, num_new, num_new))
        x = self.model.embed_tokens(tokens)  # [B, T, H]
        cos, sin = self.rope(positions, x.dtype)
        wanted = set(hidden_layers)
        hiddens = {0: x} if 0 in wanted else {}
        block_ids = range(len(self.model.layers)) if layer_ids is None else layer_ids
        rows = PackedRows(token_valid) if token_valid is not None and not bool(token_valid.all()) else None
        for slot, layer in enumerate(block_ids):
            x = self.model.layers[layer](x, cos, sin, cache, slot, mask, rows)
            if layer + 1 in wanted and layer + 1 != self.config.num_hidden_layers:
                hiddens[layer + 1] = x
        cache.advance(num_new)
        x = self.kernels.rms_norm(x, self.model.norm.weight, self.model.norm.eps)
        if self.config.num_hidden_layers in wanted:
            hiddens[self.config.num_hidden_layers] = x
        if logits_at is not None:
            x, rows = x[torch.arange(batch), logits_at][:, None], None  # [B, 1, H]
        head = self.lm_head if lm_head is None else lm_head
        logits = packed_linear(head, x, rows).float()  # [B, T, V] ([B, 1, V] with logits_at)
        return logits, hiddens


def rope_inv_freq(cfg) -> tuple[torch.Tensor, float]:
    """Inverse frequencies via transformers' own rope table (default, llama3, yarn, ...)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(cfg, "rope_parameters", None) or {"rope_type": "default"}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class NativeTarget(Target):
    """A Llama-family model on the native runtime, plus its tokenizer."""

    def __init__(self, model: LlamaModel, tokenizer, name: str, model_dir: Path | None = None, generation_config=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.model_dir = model_dir
        self.generation_config = generation_config
        cfg = model.config
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.dtype = model.model.norm.weight.dtype  # activations (GGUF-block weights are uint8)
        self.device = model.model.norm.weight.device
        attn = model.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.linear_backend = "torch"  # set by load_native when a kernel is swapped in
        self.kernel_library = None  # the compiled kernel (SkinnyGemmLibrary) when load_native found one
        self.weights = "fp32"  # "gguf" / "gguf-a8" when load_native kept GGUF blocks; "fp32": dense `dtype` weights

    def new_cache(self, batch_size: int = 1, max_len: int = 2048, num_layers: int | None = None,
                  max_tokens: int | None = None) -> KVCache:
        """A cache of `batch_size` rows x up to `max_len` slots, allocated as it grows (max_tokens: KV budget)."""
        return KVCache(num_layers or self.num_layers, batch_size, self.num_kv_heads, self.head_dim, max_len, self.dtype,
                       self.device, max_tokens)

    skips_padding = True  # forward(..., token_valid=) computes only the real tokens' rows
    selects_logits = True  # forward(..., logits_at=) runs the LM head on one row per batch row

    def kernel_owns_threads(self):
        return super().kernel_owns_threads() if self.kernel_library is None else self.kernel_library.kernel_owns_threads()

    def forward(self, tokens, positions, cache, attn_mask=None, hidden_layers=(), layer_ids=None, token_valid=None,
                logits_at=None, lm_head=None):
        with self.kernel_owns_threads():
            return self.model(tokens, positions, cache, attn_mask, hidden_layers, layer_ids, token_valid=token_valid,
                              logits_at=logits_at, lm_head=lm_head)


WEIGHT_FORMATS = ("gguf", "gguf-a8", "fp32")
# GGUFLinear activations per block-keeping weight format
BLOCK_ACTIVATIONS = {"gguf": "fp32", "gguf-a8": "int8"}


def load_native(
    model_dir: str | Path, dtype: str | torch.dtype = "float32", name: str | None = None, linear: str = "auto",
    weights: str | None = None,
) -> NativeTarget:
    """Load an HF-format directory (config.json + *.safetensors + tokenizer files) on the native runtime.

    `linear` picks the kernel behind every dense projection (specdec.kernels): "auto" = the
    batch-invariant skinny-GEMM kernel when it builds here (`SPECDEC_LINEAR=torch` turns it off).
    `weights` matters for a GGUF-sourced dir, whose tensors are partly GGUF blocks:
      "gguf"  the blocks stay as stored and run in the kernel (`GGUFLinear`, `GGUFEmbedding`):
              float32 activations, ~1/6 of the bytes of fp32 weights; the default when the kernel
              is available;
      "gguf-a8" the same blocks with activations quantized to int8 per block of 32 and integer
              dot products (llama.cpp's W4A8 / W8A8 scheme): cheaper multi-token forwards, LOSSY
              vs "gguf"/"fp32" (a different model; speculation is exact w.r.t. it). The token
              embedding lookup is unchanged;
      "fp32"  the blocks are dequantized at load (gguf's own `dequantize`) into dense `dtype`
              weights: the model the all-fp32 cache used to hold. With the kernel, both give
              bitwise the same logits (the kernel computes gguf's per-weight expression).
    A dir without blocks (an HF checkpoint) has dense weights only; "gguf"/"gguf-a8" are errors there.
    """
    from ..kernels import dequantize_blocks, fast_linear_modules, make_backend
    from .gguf import read_block_types, read_blocks_in_huge_pages

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    model_dir = Path(model_dir)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    state, block_types, block_files = {}, {}, {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(shard))  # mapped lazily: tensors never read cost no memory
        shard_types = read_block_types(shard)
        block_types.update(shard_types)
        block_files.update(dict.fromkeys(shard_types, shard))
    if not state:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    backend = make_backend(linear)
    weights = _weight_format(weights, bool(block_types), torch_dtype, backend, model_dir)
    blocks = {key: state.pop(key) for key in block_types}  # [out, row_bytes] uint8 each
    if weights == "fp32":
        state.update({key: dequantize_blocks(blocks.pop(key), block_types[key]) for key in list(blocks)})
    else:  # the kernel streams them every forward: read them again into 2 MiB pages (no page walks)
        for shard in set(block_files.values()):
            blocks.update(read_blocks_in_huge_pages(shard, [key for key, f in block_files.items() if f == shard]))
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    state = {key: tensor.to(torch_dtype) for key, tensor in state.items()}
    activations = BLOCK_ACTIVATIONS.get(weights, "fp32")
    loaded_as_blocks = _swap_in_gguf_modules(model, blocks, block_types, state, backend.backend, activations)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings) and m not in loaded_as_blocks]
    if missing or unexpected:
        raise ValueError(f"checkpoint in {model_dir} does not fit {cfg.model_type}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if getattr(cfg, "tie_word_embeddings", False):
        _tie_lm_head(model, backend.backend, activations)
    inv_freq, model.attention_scaling = rope_inv_freq(cfg)
    model.inv_freq = inv_freq
    linear_info = fast_linear_modules(model, backend=backend.backend.name)  # the dense projections, if any
    for layer in model.model.layers:  # with the kernel, attention rows are batch invariant too (sg_attention)
        layer.self_attn.kernels = backend.backend
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        gen_cfg = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        gen_cfg = None
    display = name or (read_marker(model_dir) or {}).get("name") or model_dir.name
    target = NativeTarget(model, tokenizer, display, model_dir, gen_cfg)
    target.linear_backend = linear_info["backend"]
    if torch_dtype == torch.float32:  # the kernel computes fp32 only: other dtypes' linears are torch's
        target.kernel_library = getattr(backend.backend, "library", None)
    target.weights = weights
    return target


def _weight_format(requested: str | None, has_blocks: bool, dtype: torch.dtype, backend, model_dir: Path) -> str:
    """"gguf", "gguf-a8" or "fp32" for this load (see load_native); clear errors for impossible requests."""
    if requested is not None and requested not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {requested!r}")
    kernel_ready = backend.backend.name == "cpp"
    if requested in BLOCK_ACTIVATIONS:
        if not has_blocks:
            raise ValueError(f"weights={requested!r}: {model_dir} holds no GGUF blocks (dense weights only); use weights='fp32'")
        if dtype != torch.float32:
            raise ValueError(f"weights={requested!r} runs float32 activations, not {dtype}; use weights='fp32' for dense {dtype} weights")
        if not kernel_ready:
            raise ValueError(f"weights={requested!r} needs the compiled kernel, which is off here ({backend.reason}); use weights='fp32'")
    if requested is None:  # as stored when it can run that way, else dense
        return "gguf" if has_blocks and dtype == torch.float32 and kernel_ready else "fp32"
    return requested


def _swap_in_gguf_modules(model: LlamaModel, blocks: dict, block_types: dict, state: dict, backend,
                          activations: str = "fp32") -> set[str]:
    """Replace each module whose weight is GGUF blocks by its GGUFLinear / GGUFEmbedding (its
    bias, if any, moves out of `state` into the new module); returns the parameter names filled."""
    from ..kernels import gguf_module

    filled = set()
    for key, tensor in blocks.items():
        module_name = key.removesuffix(".weight")
        parent_name, _, child_name = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        bias = state.pop(f"{module_name}.bias", None)
        module = gguf_module(getattr(parent, child_name), tensor, block_types[key], bias, backend, activations)
        setattr(parent, child_name, module)
        filled.update(f"{module_name}.{param}" for param, _ in module.named_parameters())
    return filled


def _tie_lm_head(model: LlamaModel, backend, activations: str = "fp32") -> None:
    """lm_head reads the embedding matrix itself (same Parameter; as GGUF blocks when it is)."""
    from ..kernels import GGUFEmbedding, GGUFLinear

    embed = model.model.embed_tokens
    if isinstance(embed, GGUFEmbedding):
        model.lm_head = GGUFLinear(embed.weight, embed.ggml_type, embed.embedding_dim, None, backend, activations)
    else:
        model.lm_head.weight = embed.weight
