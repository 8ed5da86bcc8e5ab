"""The Target contract shared by every backend (native Llama family, transformers fallback).

A Target is a causal LM plus its tokenizer:

    target.new_cache(batch_size=1, max_len=..., max_tokens=None) -> cache with .lengths [B], .truncate(), .keep()
        (max_len: slots per sequence at most; max_tokens: a KV memory budget in token slots)
    target.forward(tokens [B, T], positions [B, T], cache, attn_mask=None, hidden_layers=())
        -> (logits [B, T, V] float32, {layer: hidden [B, T, H]})

`attn_mask [B, T, T]` (True = may attend) is the mask among the T new tokens (None = causal);
new tokens always see all cached tokens. Hidden-layer indices follow transformers'
`output_hidden_states`: 0 = embeddings, i = output of block i, num_layers = after the final norm.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from pathlib import Path

import torch

from ..checks import check_text


class ContextLengthError(ValueError):
    """prompt + max_new_tokens does not fit the context (the model's window, a server's max_model_len)
    or the KV slots one sequence may hold. `prompt_too_long`: the prompt alone is past the context."""

    def __init__(self, message: str, prompt_too_long: bool = False):
        super().__init__(message)
        self.prompt_too_long = prompt_too_long


class Target(ABC):
    name: str
    tokenizer: object
    config: object
    vocab_size: int
    num_layers: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    model_dir: Path | None = None
    # True when forward() also takes token_valid [B, T] (bool) and skips padding tokens' compute
    skips_padding: bool = False
    selects_logits: bool = False  # forward(..., logits_at=[B]) returns only those rows' logits [B, 1, V]

    @abstractmethod
    def new_cache(self, batch_size: int = 1, max_len: int = 2048, max_tokens: int | None = None): ...

    @abstractmethod
    def forward(self, tokens, positions, cache, attn_mask=None, hidden_layers=()): ...

    def kernel_owns_threads(self):
        """A context for a run of forwards and the work between them (a decoding step): where the
        target's linears run in the compiled kernel, torch's own ops run on one thread inside it
        (`SkinnyGemmLibrary.kernel_owns_threads`); elsewhere nothing changes."""
        return nullcontext()

    # ---- sizes (one rule for every entry point: CLI, API, server, bench, training data) ----

    def _sizes_config(self):
        """The config holding the language model's sizes (multimodal configs nest it)."""
        return self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config

    @property
    def context_window(self) -> int:
        """Positions the model was trained on (`max_position_embeddings` of its config)."""
        window = getattr(self._sizes_config(), "max_position_embeddings", None)
        if not window:
            raise ValueError(f"{self.name}: the model config has no max_position_embeddings (context window)")
        return int(window)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes over all layers (keys + values)."""
        cfg = self._sizes_config()
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 2 * self.num_layers * kv_heads * head_dim * self.dtype.itemsize

    def check_fits(self, prompt_len: int, max_new_tokens: int, *, max_len: int | None = None,
                   kv_slots: int | None = None, draft_room: int = 0, budget_name: str = "max_new_tokens") -> None:
        """THE size rule: generate, the loop, the server, bench and training data all call it, before
        any allocation, so every refusal reads the same. A sequence needs prompt_len >= 1 and
        max_new_tokens >= 1; prompt_len + max_new_tokens must fit the context (the model's window, or
        `max_len` when smaller: a server's --max-model-len); with `draft_room` more (the largest draft
        block, root and bonus: loop.kv_room) it must fit the `kv_slots` one sequence may hold.
        `budget_name` is what the caller calls max_new_tokens (the server: "max_tokens")."""
        if prompt_len < 1:
            raise ValueError("prompt is empty: give some text or token ids")
        if max_new_tokens < 1:
            raise ValueError(f"{budget_name} must be >= 1, got {max_new_tokens}")
        window = self.context_window
        context, where = (window, f"{self.name}'s context window")
        if max_len is not None and max_len < window:
            context, where = max_len, "the server's context length (--max-model-len)"
        total = prompt_len + max_new_tokens
        if total > context:
            too_long = prompt_len >= context
            what = "the prompt alone exceeds it: shorten the prompt" if too_long else \
                f"lower {budget_name} to at most {context - prompt_len:,}"
            raise ContextLengthError(f"prompt ({prompt_len:,} tokens) + {budget_name} ({max_new_tokens:,}) = {total:,} "
                                     f"tokens exceeds {where} of {context:,} tokens; {what}", too_long)
        if kv_slots is not None and total + draft_room > kv_slots:
            raise ContextLengthError(
                f"prompt ({prompt_len:,} tokens) + {budget_name} ({max_new_tokens:,}) + draft room ({draft_room:,}) "
                f"does not fit the {kv_slots:,} KV slots this batch holds per sequence; lower {budget_name} to at most "
                f"{max(kv_slots - draft_room - prompt_len, 0):,}", kv_slots - draft_room <= prompt_len)

    # ---- tokenizer helpers (shared by every backend) ----

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a generation: the tokenizer's EOS plus generation_config's list."""
        ids: set[int] = set()
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(getattr(self, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif gen_eos:
            ids.update(int(i) for i in gen_eos)
        return sorted(ids)

    def encode_prompt(self, prompt: str | list[int] | list[dict]) -> list[int]:
        """A list[int] is used verbatim; a str (or a list of chat messages) gets the chat template when there is one."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            for message in messages:
                if isinstance(message.get("content"), str):
                    check_text("prompt", message["content"])
            if isinstance(prompt, str) and not prompt.strip():
                raise ValueError("prompt is empty: give some text or token ids")
            if getattr(self.tokenizer, "chat_template", None):
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                ids = list(ids)
            else:
                text = "\n".join(m["content"] for m in messages)
                ids = self.tokenizer(text)["input_ids"]
        else:
            raise TypeError(f"prompt must be str, list[int] or a list of chat messages, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty: give some text or token ids")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
