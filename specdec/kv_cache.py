"""Preallocated KV cache with per-sequence lengths, rollback and tree-path compaction.

Layout per layer: keys / values `[B, H_kv, max_len, D]`. Sequence `b` owns slots
`[0, lengths[b])`; a forward over T new tokens writes slots `[lengths[b], lengths[b] + T)`
and advances `lengths[b]` by T. Slots past a sequence's length are garbage and are always
masked out, so rolling back is just lowering a length (`truncate`), and keeping the accepted
path of a tree is a gather of a few slots (`keep`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"KVCache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}")
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # [B] committed slots per sequence
        self.max_len = max_len

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def check_room(self, num_new: int) -> None:
        needed = int(self.lengths.max()) + num_new
        if needed > self.max_len:
            raise ValueError(
                f"KV cache overflow: {needed} slots needed but the cache holds {self.max_len}; "
                "create it with a larger max_len (prompt + max_new_tokens + draft budget)"
            )

    def write(self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `new_keys/new_values [B, H_kv, T, D]` after each sequence's committed slots.

        Returns the keys / values `[B, H_kv, S, D]` with S = max(lengths) + T, which the
        attention reads under the mask from `attention_mask()`. Lengths advance in `advance()`
        once every layer has written, so all layers see the same offsets.
        """
        num_new = new_keys.shape[2]
        starts = self.lengths
        first = int(starts[0])
        if bool((starts == first).all()):  # the common case: one slice for the whole batch
            self.keys[layer][:, :, first : first + num_new] = new_keys
            self.values[layer][:, :, first : first + num_new] = new_values
        else:
            for row, start in enumerate(starts.tolist()):
                self.keys[layer][row, :, start : start + num_new] = new_keys[row]
                self.values[layer][row, :, start : start + num_new] = new_values[row]
        span = int(starts.max()) + num_new
        return self.keys[layer][:, :, :span], self.values[layer][:, :, :span]

    def advance(self, num_new: int) -> None:
        self.lengths += num_new

    def attention_mask(self, num_new: int, new_token_mask: torch.Tensor | None) -> torch.Tensor:
        """Boolean mask `[B, 1, T, S]` (True = may attend) for T new queries over S = max(lengths) + T keys.

        A new token sees every committed slot of its own sequence, and among the new tokens
        whatever `new_token_mask [B, T, T]` allows (None = causal). Other slots are hidden.
        """
        batch = self.batch_size
        span = int(self.lengths.max()) + num_new
        if new_token_mask is None:
            new_token_mask = torch.ones(num_new, num_new, dtype=torch.bool).tril().expand(batch, -1, -1)
        key_slots = torch.arange(span)  # [S]
        rel = key_slots[None, :] - self.lengths[:, None]  # [B, S] slot index relative to the new block
        committed = (rel < 0)[:, None, :].expand(batch, num_new, span)  # [B, T, S]
        in_block = (rel >= 0) & (rel < num_new)  # [B, S]
        gather_idx = rel.clamp(0, num_new - 1)[:, None, :].expand(batch, num_new, span)  # [B, T, S]
        block_visible = torch.gather(new_token_mask.to(torch.bool), 2, gather_idx) & in_block[:, None, :]
        return (committed | block_visible)[:, None]  # [B, 1, T, S]

    def truncate(self, new_lengths: int | torch.Tensor) -> None:
        """Roll back: forget everything past `new_lengths` (an int for all sequences, or `[B]`)."""
        new_lengths = torch.as_tensor(new_lengths, dtype=torch.long).expand(self.batch_size)
        if bool((new_lengths > self.lengths).any()) or bool((new_lengths < 0).any()):
            raise ValueError(f"truncate can only shorten: lengths {self.lengths.tolist()} -> {new_lengths.tolist()}")
        self.lengths.copy_(new_lengths)  # in place: row views share this tensor

    def rows(self, start: int, stop: int) -> KVCache:
        """A view of rows [start, stop): writes, lengths and rollbacks go to this cache."""
        view = KVCache.__new__(KVCache)
        view.keys = [k[start:stop] for k in self.keys]
        view.values = [v[start:stop] for v in self.values]
        view.lengths = self.lengths[start:stop]
        view.max_len = self.max_len
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Copy sequence `src` into row `dst` (compacting a batch when a sequence leaves)."""
        length = int(self.lengths[src])
        for keys, values in zip(self.keys, self.values):
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]
        self.lengths[dst] = length

    def keep(self, seq: int, start: int, offsets: Sequence[int]) -> None:
        """Compact sequence `seq`: slots `start + offsets[i]` move to `start + i`; length becomes start + len(offsets).

        Used after tree verification: the block written at `start` holds the root and all
        draft nodes; only the accepted root-to-leaf path survives.
        """
        offsets = list(offsets)
        if offsets != sorted(set(offsets)) or (offsets and offsets[0] < 0):
            raise ValueError(f"keep offsets must be strictly increasing and >= 0, got {offsets}")
        if offsets and start + offsets[-1] >= int(self.lengths[seq]):
            raise ValueError(f"keep offset {offsets[-1]} past sequence length {int(self.lengths[seq])} (start {start})")
        if offsets != list(range(len(offsets))):
            src = torch.tensor(offsets, dtype=torch.long) + start
            for layer in range(self.num_layers):
                self.keys[layer][seq, :, start : start + len(offsets)] = self.keys[layer][seq, :, src]
                self.values[layer][seq, :, start : start + len(offsets)] = self.values[layer][seq, :, src]
        self.lengths[seq] = start + len(offsets)
