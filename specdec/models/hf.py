"""Fallback target: any transformers causal LM behind specdec's Target contract.

The native runtime (llama.py) covers the Llama family; this wraps everything else
(AutoModelForCausalLM from a HF-format dir, e.g. Gemma 3) with the same interface:

    target.new_cache(batch_size=1, max_len=...) -> KVCache (specdec/kv_cache.py, as the native runtime)
    target.forward(tokens[B, T], positions[B, T], cache, attn_mask[B, T, T] | None, hidden_layers)
        -> (logits[B, T, V] float32, {layer: hidden[B, T, H]})

The K/V live in the same KVCache the native runtime uses (allocated as it grows), so per-row lengths,
rollback (`truncate`), tree-path compaction (`keep`), row views (`rows`) and `move_row` behave
identically for every batch size. transformers reaches it through a thin `Cache` adapter whose
layers write each row's new K/V after that row's own length. The model never builds a mask:
forward passes explicit 4D masks (one per layer type) that hide the slots a row does not own,
apply the tree mask among new tokens, and apply sliding windows on positions, so every layer
keeps all its keys and sliding-window layers still see exactly their window.

Not supported (a clear error says so): layer types other than full / sliding attention
(linear attention, chunked attention, ...), layers whose K/V shape differs from the config's,
and layer-skip drafting (`layer_ids`); use a Llama-family model on the native runtime for those.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..kv_cache import KVCache
from .base import Target
from .gguf import WEIGHTS_FILE, read_block_types
from .registry import source_gguf_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' | torch.dtype -> torch.dtype, with a clear error."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}; allowed: {', '.join(DTYPES)}")


class _KVCacheLayer(CacheLayerMixin):
    """transformers' per-layer cache interface over one layer of a specdec KVCache.

    `update` writes the new keys / values after each row's own cached length (rows may differ)
    and returns keys / values [B, H_kv, max(lengths) + T, D]; the explicit mask built by
    HFTarget.forward hides every slot a row does not own. Lengths advance once per forward.
    """

    is_sliding = False  # every layer keeps all its keys; sliding windows are applied by the mask

    def __init__(self, cache: KVCache, layer: int):
        super().__init__()
        self.cache, self.layer = cache, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the KVCache allocates itself
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        expected = tuple(self.cache.keys[self.layer].shape[1::2])  # (H_kv, D)
        got = (key_states.shape[1], key_states.shape[3])
        if got != expected or value_states.shape != key_states.shape:
            raise NotImplementedError(
                f"HFTarget: layer {self.layer} produced keys {tuple(key_states.shape)} / values {tuple(value_states.shape)}, "
                f"but the cache holds (kv_heads, head_dim) = {expected} from the config; models whose layers differ in "
                "KV shape are not supported by the transformers backend"
            )
        return self.cache.write(self.layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self.cache.lengths.max()) + query_length, 0

    def get_seq_length(self) -> int:
        return int(self.cache.lengths.max())

    def get_max_length(self) -> int:
        return self.cache.max_len


def transformers_load_kwargs(model_dir: Path | str) -> dict:
    """Extra `from_pretrained` arguments for transformers to load a converted dir: a dir whose
    weights are GGUF blocks is read from its source GGUF instead (transformers dequantises it)."""
    model_dir = Path(model_dir)
    weights_file = model_dir / WEIGHTS_FILE
    if not weights_file.is_file() or not read_block_types(weights_file):
        return {}
    source = source_gguf_of(model_dir, progress=False)
    return {"gguf_file": str(source)}


class HFTarget(Target):
    """A transformers causal LM behind the Target contract (see docs/architecture.md and base.py)."""

    def __init__(self, model, tokenizer, name: str = "", device: str | torch.device = "cpu",
                 model_dir: Path | None = None):
        self.model = model.eval()
        self.model_dir = model_dir
        self.generation_config = getattr(model, "generation_config", None)
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "name_or_path", "") or type(model).__name__
        self.config = model.config
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.text_config = text_config
        self.num_layers = int(text_config.num_hidden_layers)
        self.vocab_size = int(text_config.vocab_size)
        self.hidden_size = int(text_config.hidden_size)
        self.max_position_embeddings = int(getattr(text_config, "max_position_embeddings", 0) or 4096)
        self.num_kv_heads = int(getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads)
        self.head_dim = int(getattr(text_config, "head_dim", None) or self.hidden_size // text_config.num_attention_heads)
        self._layer_types = tuple(getattr(text_config, "layer_types", None) or ())
        unsupported = set(self._layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unsupported:
            raise NotImplementedError(
                f"HFTarget: layer types {sorted(unsupported)} are not supported by the transformers backend "
                "(only full and sliding-window attention); use a model with standard attention layers"
            )
        window = getattr(text_config, "sliding_window", None)
        # the window (in positions) each mask applies: one per layer type, or one for every layer
        # (no layer_types: a model like Mistral applies its sliding_window, when set, everywhere)
        windows = {FULL_ATTENTION: None, SLIDING_ATTENTION: window}
        self._windows = ({kind: windows[kind] for kind in set(self._layer_types)} if self._layer_types
                         else {FULL_ATTENTION: window})

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu", name: str = "") -> "HFTarget":
        """Load AutoModelForCausalLM + AutoTokenizer from a HF-format directory."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"{model_dir} is not a HF-format model directory (no config.json)")
        torch_dtype = parse_dtype(dtype)
        # sdpa takes our additive 4D masks as they are; eager would too, sdpa is faster on CPU.
        # A dir holding GGUF blocks is read from its source GGUF (transformers_load_kwargs).
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype, attn_implementation="sdpa",
                                                     **transformers_load_kwargs(model_dir))
        has_tokenizer = any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir)) if has_tokenizer else None
        return cls(model.to(device), tokenizer, name=name or model_dir.name, device=device, model_dir=model_dir)

    # -- Target contract -------------------------------------------------------------------

    def new_cache(self, batch_size: int = 1, max_len: int = 2048, max_tokens: int | None = None) -> KVCache:
        return KVCache(self.num_layers, batch_size, self.num_kv_heads, self.head_dim, max_len, self.dtype, self.device,
                       max_tokens)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        attn_mask: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run T new tokens per row against the cache; appends their K/V after each row's length.

        tokens, positions: LongTensor[B, T]. attn_mask: BoolTensor[B, T, T] (True = may attend)
        among the new tokens, None = causal; new tokens always see every cached token of their
        row (within the sliding window on sliding layers). Rows may hold different lengths.
        hidden_layers: HF output_hidden_states indices (0 = embeddings, i = after layer i,
        num_layers = after the final norm).
        """
        num_new = self._check_inputs(tokens, positions, cache, attn_mask, hidden_layers)
        layers = Cache(layers=[_KVCacheLayer(cache, layer) for layer in range(cache.num_layers)])
        outputs = self.model(
            input_ids=tokens.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=self._attention_masks(cache, positions, attn_mask),
            cache=layers,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
        )
        cache.advance(num_new)  # only after every layer wrote: a failed forward leaves the lengths as they were
        logits = outputs.logits.float()  # [B, T, V]
        hidden = {layer: outputs.hidden_states[layer] for layer in hidden_layers}  # each [B, T, H]
        return logits, hidden

    # -- helpers ---------------------------------------------------------------------------

    def _check_inputs(self, tokens, positions, cache, attn_mask, hidden_layers) -> int:
        if not isinstance(cache, KVCache):
            raise TypeError(f"HFTarget.forward needs a cache from target.new_cache(), got {type(cache).__name__}")
        if tokens.dim() != 2 or tokens.shape != positions.shape:
            raise ValueError(f"tokens and positions must both be [B, T]; got {tuple(tokens.shape)} and {tuple(positions.shape)}")
        batch_size, num_new = tokens.shape
        if batch_size != cache.batch_size:
            raise ValueError(f"tokens have batch size {batch_size}, the cache was made for {cache.batch_size}")
        if cache.num_layers != self.num_layers:
            raise ValueError(f"the cache has {cache.num_layers} layers, the model {self.num_layers}")
        cache.make_room(num_new)
        if attn_mask is not None and (attn_mask.dtype != torch.bool or tuple(attn_mask.shape) != (batch_size, num_new, num_new)):
            raise ValueError(f"attn_mask must be a bool tensor of shape {(batch_size, num_new, num_new)}; "
                             f"got {attn_mask.dtype} {tuple(attn_mask.shape)}")
        bad_layers = [layer for layer in hidden_layers if not 0 <= layer <= self.num_layers]
        if bad_layers:
            raise ValueError(f"hidden_layers {bad_layers} out of range 0..{self.num_layers}")
        return num_new

    def _attention_masks(self, cache: KVCache, positions: torch.Tensor, attn_mask: torch.Tensor | None):
        """4D additive mask(s) [B, 1, T, S] over S = max(lengths) + T key slots: one tensor, or one
        per layer type (the model code then uses them as given instead of building its own)."""
        allowed = cache.attention_mask(positions.shape[1], attn_mask)  # [B, 1, T, S] bool
        masks = {layer_type: self._additive(self._within_window(allowed, cache, positions, window))
                 for layer_type, window in self._windows.items()}
        return masks if self._layer_types else masks[FULL_ATTENTION]

    @staticmethod
    def _within_window(allowed: torch.Tensor, cache: KVCache, positions: torch.Tensor, window: int | None):
        """Restrict `allowed` [B, 1, T, S] to keys less than `window` POSITIONS behind each query."""
        if window is None:
            return allowed
        batch_size, num_new = positions.shape
        span = allowed.shape[-1]
        # slot s < lengths[b] holds position s; the new block's slots hold the given positions
        key_positions = torch.arange(span).repeat(batch_size, 1)  # [B, S]
        block_slots = cache.lengths[:, None] + torch.arange(num_new)  # [B, T]
        key_positions.scatter_(1, block_slots, positions.cpu())
        distance = positions.cpu()[:, :, None] - key_positions[:, None, :]  # [B, T, S]
        return allowed & (distance < window)[:, None]

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """bool [B, 1, T, S] -> float [B, 1, T, S]: 0 where allowed, dtype-min elsewhere (eager and sdpa both add it)."""
        blocked = torch.tensor(torch.finfo(self.dtype).min, dtype=self.dtype)
        return torch.where(allowed, torch.zeros((), dtype=self.dtype), blocked).to(self.device)
