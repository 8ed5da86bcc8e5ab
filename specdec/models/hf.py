"""Fallback target: any transformers causal LM behind specdec's Target contract.

The native runtime (llama.py) covers the Llama family; this wraps everything else
(AutoModelForCausalLM from a HF-format dir) with the same interface:

    target.new_cache(batch_size=1, max_len=...) -> HFCache
    target.forward(tokens[B, T], positions[B, T], cache, attn_mask[B, T, T] | None, hidden_layers)
        -> (logits[B, T, V] float32, {layer: hidden[B, T, H]})

Tree attention is just an explicit mask: the [B, T, T] mask among the new tokens is widened to
a 4D additive mask over [cached + new] keys, which transformers passes to attention unchanged.
The cache is transformers' DynamicCache built WITHOUT a config, so every layer keeps all its
keys (no sliding-window eviction) and truncate/keep are plain slicing; sliding-window layers
still get their window through the mask.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from .base import Target

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


class HFCache:
    """KV cache of an HFTarget: a DynamicCache whose rows all have the same length."""

    def __init__(self, batch_size: int, max_len: int):
        from transformers import DynamicCache

        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size and max_len must be >= 1 (got {batch_size}, {max_len})")
        self.batch_size = batch_size
        self.max_len = max_len
        self.dynamic = DynamicCache()  # no config: every layer a full DynamicLayer (see module doc)

    @property
    def length(self) -> int:
        return self.dynamic.get_seq_length()

    @property
    def lengths(self) -> torch.Tensor:
        """LongTensor[B]: tokens cached per row (equal for every row here)."""
        return torch.full((self.batch_size,), self.length, dtype=torch.long)

    def _layers(self):
        return [layer for layer in self.dynamic.layers if getattr(layer, "is_initialized", False)]

    def truncate(self, new_lengths: int | torch.Tensor) -> None:
        """Drop cached tokens beyond `new_lengths` (an int, or LongTensor[B] with equal entries)."""
        if isinstance(new_lengths, torch.Tensor):
            values = new_lengths.reshape(-1).tolist()
            if len(values) != self.batch_size:
                raise ValueError(f"new_lengths has {len(values)} entries, cache batch size is {self.batch_size}")
            if len(set(values)) != 1:
                raise NotImplementedError(
                    "HFCache (transformers DynamicCache) can only truncate every row to the same length; "
                    f"got per-row lengths {values}. Use the native runtime for ragged batches."
                )
            new_length = int(values[0])
        else:
            new_length = int(new_lengths)
        if not 0 <= new_length <= self.length:
            raise ValueError(f"cannot truncate to {new_length}: cache holds {self.length} tokens")
        if new_length < self.length:
            self.dynamic.crop(new_length - self.length)  # DynamicCache.crop takes a negative count

    def keep(self, seq: int, start: int, offsets: Sequence[int]) -> None:
        """Compact an accepted tree path: slot start+offsets[i] -> start+i, then length = start+len(offsets)."""
        if self.batch_size != 1 or seq != 0:
            raise NotImplementedError(
                f"HFCache.keep only supports batch_size 1 and seq 0 (got batch_size {self.batch_size}, seq {seq}): "
                "rows of a DynamicCache must keep equal lengths"
            )
        length, offsets = self.length, list(offsets)
        if offsets != sorted(set(offsets)) or (offsets and offsets[0] < 0):
            raise ValueError(f"keep offsets must be strictly increasing and >= 0, got {offsets}")
        if not 0 <= start <= length or (offsets and start + offsets[-1] >= length):
            raise ValueError(f"keep(start={start}, offsets={offsets}) out of range for cache length {length}")
        source = torch.tensor(offsets, dtype=torch.long) + start  # [n] slots to keep, in order
        for layer in self._layers():
            # keys/values: [B, kv_heads, S, head_dim]; index_select copies before we overwrite
            layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys.index_select(2, source)], dim=2)
            layer.values = torch.cat([layer.values[:, :, :start], layer.values.index_select(2, source)], dim=2)


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
        self._layer_types = tuple(getattr(text_config, "layer_types", None) or ())
        unsupported = set(self._layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unsupported:
            raise NotImplementedError(f"HFTarget: layer types {sorted(unsupported)} are not supported (only full/sliding attention)")
        self._sliding_window = getattr(text_config, "sliding_window", None)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu", name: str = "") -> "HFTarget":
        """Load AutoModelForCausalLM + AutoTokenizer from a HF-format directory."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"{model_dir} is not a HF-format model directory (no config.json)")
        torch_dtype = parse_dtype(dtype)
        # sdpa takes our additive 4D masks as they are; eager would too, sdpa is faster on CPU
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype, attn_implementation="sdpa")
        has_tokenizer = any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir)) if has_tokenizer else None
        return cls(model.to(device), tokenizer, name=name or model_dir.name, device=device, model_dir=model_dir)

    # -- Target contract -------------------------------------------------------------------

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> HFCache:
        return HFCache(batch_size, max_len or self.max_position_embeddings)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: HFCache,
        attn_mask: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run T new tokens per row against the cache; appends their K/V to it.

        tokens, positions: LongTensor[B, T]. attn_mask: BoolTensor[B, T, T] (True = may attend)
        among the new tokens, None = causal; new tokens always see every cached token.
        hidden_layers: HF output_hidden_states indices (0 = embeddings, i = after layer i,
        num_layers = after the final norm).
        """
        batch_size, num_new = self._check_inputs(tokens, positions, cache, attn_mask, hidden_layers)
        past = cache.length
        mask = None if attn_mask is None else self._attention_mask(attn_mask, positions, past)
        outputs = self.model(
            input_ids=tokens.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=mask,
            cache=cache.dynamic,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
        )
        logits = outputs.logits.float()  # [B, T, V]
        hidden = {layer: outputs.hidden_states[layer] for layer in hidden_layers}  # each [B, T, H]
        return logits, hidden

    # -- helpers ---------------------------------------------------------------------------

    def _check_inputs(self, tokens, positions, cache, attn_mask, hidden_layers) -> tuple[int, int]:
        if tokens.dim() != 2 or tokens.shape != positions.shape:
            raise ValueError(f"tokens and positions must both be [B, T]; got {tuple(tokens.shape)} and {tuple(positions.shape)}")
        batch_size, num_new = tokens.shape
        if batch_size != cache.batch_size:
            raise ValueError(f"tokens have batch size {batch_size}, the cache was made for {cache.batch_size}")
        if cache.length + num_new > cache.max_len:
            raise ValueError(f"cache overflow: {cache.length} cached + {num_new} new > max_len {cache.max_len}")
        if attn_mask is not None and (attn_mask.dtype != torch.bool or tuple(attn_mask.shape) != (batch_size, num_new, num_new)):
            raise ValueError(f"attn_mask must be a bool tensor of shape {(batch_size, num_new, num_new)}; "
                             f"got {attn_mask.dtype} {tuple(attn_mask.shape)}")
        bad_layers = [layer for layer in hidden_layers if not 0 <= layer <= self.num_layers]
        if bad_layers:
            raise ValueError(f"hidden_layers {bad_layers} out of range 0..{self.num_layers}")
        return batch_size, num_new

    def _attention_mask(self, attn_mask: torch.Tensor, positions: torch.Tensor, past: int):
        """[B, T, T] bool among new tokens -> 4D additive mask(s) [B, 1, T, past + T] per layer type."""
        batch_size, num_new, _ = attn_mask.shape
        allowed = torch.cat([attn_mask.new_ones(batch_size, num_new, past), attn_mask], dim=2)  # [B, T, past+T]
        masks = {FULL_ATTENTION: allowed}
        if SLIDING_ATTENTION in self._layer_types:
            # window on POSITIONS: cached slots hold positions 0..past-1, new tokens their given positions
            key_positions = torch.cat([torch.arange(past).expand(batch_size, past), positions.cpu()], dim=1)  # [B, past+T]
            distance = positions.cpu()[:, :, None] - key_positions[:, None, :]  # [B, T, past+T]
            masks[SLIDING_ATTENTION] = allowed & (distance < self._sliding_window)
        additive = {kind: self._additive(m) for kind, m in masks.items()}
        if not self._layer_types:  # model code takes one 4D tensor (e.g. Llama)
            return additive[FULL_ATTENTION]
        return {kind: additive[kind] for kind in set(self._layer_types)}

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """bool [B, T, K] -> float [B, 1, T, K]: 0 where allowed, dtype-min elsewhere (eager and sdpa both add it)."""
        blocked_value = torch.finfo(self.dtype).min
        zeros = torch.zeros((), dtype=self.dtype)
        return torch.where(allowed, zeros, torch.tensor(blocked_value, dtype=self.dtype))[:, None].to(self.device)

