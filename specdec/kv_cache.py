"""KV cache with per-sequence lengths, rollback and tree-path compaction, allocated as it grows.

Layout per layer: keys / values `[R, H_kv, C, D]` with R <= batch_size allocated rows and
C <= max_len allocated slots. Sequence `b` owns slots `[0, lengths[b])`; a forward over T new
tokens writes slots `[lengths[b], lengths[b] + T)` and advances `lengths[b]` by T. Slots past a
sequence's length are garbage and are always masked out, so rolling back is just lowering a
length (`truncate`), and keeping the accepted path of a tree is a gather of a few slots (`keep`).

Memory is taken as sequences grow, the way serving engines do it, instead of
batch_size x max_len up front: `make_room` (called by the forward) grows the storage to the
next multiple of KV_CHUNK slots, at least doubling, so a sequence of n tokens costs O(1)
copies per token on average and the kernel path still sees one contiguous tensor per layer.
Growth never passes `max_len` slots per row, nor `max_tokens` allocated rows x slots (the KV
memory budget, see `kv_budget_tokens`); `release()` hands everything back when the batch empties.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

KV_CHUNK = 256  # slots: the growth granularity
DEFAULT_KV_MEMORY_FRACTION = 0.4  # of the memory available at start-up, when no --kv-memory is given


class KVBudgetError(ValueError):
    """A cache would need more rows x slots than its memory budget allows."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _Storage:
    """The per-layer tensors shared by a cache and its row views, and the rules for growing them."""

    def __init__(self, num_layers, batch_size, num_kv_heads, head_dim, max_len, dtype, device, max_tokens, lengths):
        self.num_layers, self.batch_size, self.max_len, self.max_tokens = num_layers, batch_size, max_len, max_tokens
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, dtype, device
        self.lengths = lengths  # [batch_size] the root cache's lengths (views slice it)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.release()

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def release(self) -> None:
        empty = (0, self.num_kv_heads, 0, self.head_dim)
        with torch.inference_mode(False):
            self.keys = [torch.zeros(empty, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            self.values = [torch.zeros(empty, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def ensure(self, rows: int, slots: int) -> None:
        """Storage for rows [0, rows) and `slots` slots each (grown in chunks, doubling, within the budget)."""
        if rows <= self.rows and slots <= self.capacity:
            return
        if slots > self.max_len:
            raise ValueError(
                f"KV cache overflow: {slots} slots needed but the cache holds {self.max_len}; "
                "create it with a larger max_len (prompt + max_new_tokens + draft budget)"
            )
        if rows > self.batch_size:
            raise ValueError(f"KV cache has {self.batch_size} rows, {rows} needed")
        live_rows = int(self.lengths.nonzero().max()) + 1 if bool(self.lengths.any()) else 0
        need_rows, need_slots = max(rows, live_rows), max(slots, int(self.lengths.max()))
        if self.max_tokens is not None and need_rows * need_slots > self.max_tokens:
            raise KVBudgetError(
                f"KV memory budget exceeded: {need_rows} sequences x {need_slots} slots > {self.max_tokens} token slots"
            )
        new_slots = min(self.max_len, max(_round_up(need_slots, KV_CHUNK), 2 * self.capacity if slots > self.capacity else 0))
        new_rows = min(self.batch_size, max(need_rows, 2 * self.rows if rows > self.rows else self.rows))
        if self.max_tokens is not None:  # the slack of doubling and chunks stays inside the budget
            new_slots = max(need_slots, min(new_slots, self.max_tokens // new_rows))
            new_rows = max(need_rows, min(new_rows, self.max_tokens // new_slots))
        keep_rows, keep_slots = min(self.rows, new_rows), min(self.capacity, new_slots)
        # growth usually happens inside a forward (inference mode); the storage must stay a normal
        # tensor so the batch can still compact rows outside one
        with torch.inference_mode(False):
            for tensors in (self.keys, self.values):
                for layer, old in enumerate(tensors):
                    # zeros, not empty: masked slots are still read by attention, and NaN * 0 would leak
                    new = torch.zeros((new_rows, self.num_kv_heads, new_slots, self.head_dim), dtype=self.dtype,
                                      device=self.device)
                    new[:keep_rows, :, :keep_slots] = old[:keep_rows, :, :keep_slots]
                    tensors[layer] = new


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
        max_tokens: int | None = None,
    ):
        """`max_len`: slots per sequence at most; `max_tokens`: allocated rows x slots at most (None = no budget)."""
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"KVCache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}")
        if max_tokens is not None and max_tokens < max_len:
            raise KVBudgetError(f"a KV budget of {max_tokens} token slots cannot hold one sequence of {max_len}")
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # [B] committed slots per sequence
        self._store = _Storage(num_layers, batch_size, num_kv_heads, head_dim, max_len, dtype, device, max_tokens,
                               self.lengths)
        self._first_row = 0  # this cache's row 0 in the storage (row views are windows onto it)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._store.dtype

    @property
    def num_layers(self) -> int:
        return self._store.num_layers

    @property
    def max_len(self) -> int:
        return self._store.max_len

    @max_len.setter
    def max_len(self, value: int) -> None:
        """Raising the limit is free: nothing is allocated until a forward needs it."""
        if value < int(self._store.lengths.max()):
            raise ValueError(f"max_len {value} is below a committed length {int(self._store.lengths.max())}")
        self._store.max_len = value

    @property
    def capacity(self) -> int:
        """Slots allocated per row now (grows up to max_len)."""
        return self._store.capacity

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._store.keys + self._store.values)

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer `[rows, H_kv, capacity, D]`: this cache's allocated rows (views of the storage)."""
        return [k[self._first_row : self._first_row + self.batch_size] for k in self._store.keys]

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[self._first_row : self._first_row + self.batch_size] for v in self._store.values]

    def reserve(self, num_slots: int) -> None:
        """Allocate `num_slots` slots for every row of this cache now (e.g. before copying into them)."""
        self._store.ensure(self._first_row + self.batch_size, num_slots)

    def make_room(self, num_new: int) -> None:
        """Before a forward over `num_new` tokens: grow the storage, or raise past max_len / the budget."""
        self.reserve(int(self.lengths.max()) + num_new)

    def release(self) -> None:
        """Forget every sequence and hand the memory back (the batch is empty)."""
        self._store.lengths.zero_()
        self._store.release()

    def _layer(self, tensors: list[torch.Tensor], layer: int) -> torch.Tensor:
        return tensors[layer][self._first_row : self._first_row + self.batch_size]

    def write(self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `new_keys/new_values [B, H_kv, T, D]` after each sequence's committed slots.

        Returns the keys / values `[B, H_kv, S, D]` with S = max(lengths) + T, which the
        attention reads under the mask from `attention_mask()`. Lengths advance in `advance()`
        once every layer has written, so all layers see the same offsets. The storage grows here
        when a caller did not `make_room(T)` first (a model's forward does, before any layer runs).
        """
        num_new = new_keys.shape[2]
        starts = self.lengths
        first = int(starts[0])
        # one sequence (every decode / verify step of a single request): its length is the offset
        uniform = self.batch_size == 1 or bool((starts == first).all())
        keys, values, span = self.layer_for_write(layer, num_new, (first if uniform else int(starts.max())) + num_new)
        if uniform:  # the common case: one slice for the whole batch
            keys[:, :, first : first + num_new] = new_keys
            values[:, :, first : first + num_new] = new_values
        else:
            for row, start in enumerate(starts.tolist()):
                keys[row, :, start : start + num_new] = new_keys[row]
                values[row, :, start : start + num_new] = new_values[row]
        return keys[:, :, :span], values[:, :, :span]

    def layer_for_write(self, layer: int, num_new: int, span: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Where `write` puts `num_new` tokens, for a kernel that writes them itself: the layer's keys /
        values `[B, H_kv, capacity, D]` with room for them after every row's committed slots (rows
        start at `lengths`), and the span S = max(lengths) + num_new that attention then reads."""
        if span is None:
            span = int(self.lengths.max()) + num_new
        if span > self._store.capacity or self._first_row + self.batch_size > self._store.rows:
            self.reserve(span)
        return self._layer(self._store.keys, layer), self._layer(self._store.values, layer), span

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
        """A view of rows [start, stop): writes, growth, lengths and rollbacks go to this cache."""
        if not 0 <= start < stop <= self.batch_size:
            raise ValueError(f"rows({start}, {stop}) outside a cache of {self.batch_size} rows")
        view = KVCache.__new__(KVCache)
        view._store = self._store
        view._first_row = self._first_row + start
        view.lengths = self.lengths[start:stop]
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Copy sequence `src` into row `dst` (compacting a batch when a sequence leaves)."""
        length = int(self.lengths[src])
        if length:
            src_row, dst_row = self._first_row + src, self._first_row + dst
            for tensors in (self._store.keys, self._store.values):
                for layer_tensor in tensors:
                    layer_tensor[dst_row, :, :length] = layer_tensor[src_row, :, :length]
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
            row = self._first_row + seq
            for tensors in (self._store.keys, self._store.values):
                for layer_tensor in tensors:
                    layer_tensor[row, :, start : start + len(offsets)] = layer_tensor[row, :, src]
        self.lengths[seq] = start + len(offsets)


# ---------------------------------------------------------------------------- the KV memory budget


def available_memory_bytes() -> int:
    """Memory the system can give without swapping (MemAvailable; free pages where /proc is missing)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget_tokens(bytes_per_token: int, memory_gb: float | None = None,
                     fraction: float = DEFAULT_KV_MEMORY_FRACTION) -> tuple[int, str]:
    """Token slots a KV budget holds, and a phrase saying where the budget came from.

    `memory_gb` (decimal GB, > 0) when given, else `fraction` (in (0, 1]) of the memory available
    now; the server's settings are checked once, by specdec.server.config.ServerConfig."""
    if memory_gb is not None:
        budget, source = memory_gb * 1e9, f"--kv-memory {memory_gb:g} GB"
    else:
        available = available_memory_bytes()
        budget = fraction * available
        source = f"{fraction:g} of the {available / 1e9:.1f} GB available (--kv-memory-fraction)"
    return int(budget // bytes_per_token), source
