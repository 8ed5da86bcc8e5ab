"""The head drafters' runners (the `HeadRunner` protocol of head_drafter.py), one per module family:
what a module keeps of a sequence's committed positions and how it drafts from them.

* `MedusaRunner` (MedusaHeads): the newest cached token's hidden state; every depth's logits at once.
* `ParallelRunner` (MTP parallel heads): the heads' KV caches; every depth's logits at once.
* `ChainRunner` (chained modules: MTP sequential, EAGLE-1, EAGLE-3): a KV cache and the state at
  the newest cached position; depth d reads depth d - 1's state and draft token d - 1; also
  EAGLE-2's dynamic tree. Holds the target's rows until the next draft too (a step without one
  costs the module nothing).
* `DFlashRunner` (DFlash, DSpark): holds the target's rows until a block is drafted, then computes
  every draft layer's context keys / values for all of them in one forward; one block forward
  drafts the chain.
"""

from __future__ import annotations

import torch

from ..draft import Draft, ScoredTree
from ..heads import ChainedModule, DFlashModule, DraftVocab, MedusaHeads, MTPParallelHeads, grow_cache
from ..kv_cache import KVCache
from .base import DraftContext
from .head_drafter import CACHE_HEADROOM, Choose, new_hidden_rows


class _AllDepthsAtOnce:
    """A module whose heads give every draft depth's logits from one state, reading no draft token
    (Medusa, MTP parallel): a chain takes each depth's pick, a static tree each depth's top k."""

    heads: MedusaHeads | MTPParallelHeads

    def pending(self) -> int:
        return 0

    def depth_logits(self, depth: int) -> torch.Tensor:
        """Logits [depth, V'] over the draft vocabulary of draft depths 1 .. depth."""
        raise NotImplementedError

    def chain(self, ctx: DraftContext, length: int, choose: Choose) -> None:
        for row in self.depth_logits(min(length, self.heads.num_positions)):
            choose(row)


class MedusaRunner(_AllDepthsAtOnce):
    """Medusa heads read only the hidden state of the newest cached token (the one before the root)."""

    def __init__(self, heads: MedusaHeads, vocab: DraftVocab, target, prompt_len: int):
        self.heads, self.parts = heads, vocab.parts
        self.last_hidden: torch.Tensor | None = None  # [H]

    def receive(self, ctx: DraftContext) -> None:
        rows = ctx.new_hidden.get(self.heads.input_layer)
        if rows is not None and rows.shape[0]:
            self.last_hidden = rows[-1]

    def ready(self) -> bool:
        return self.last_hidden is not None

    def depth_logits(self, depth: int) -> torch.Tensor:
        features = self.heads(self.last_hidden[None])[:depth, 0]  # [depth, H]
        return self.heads.project(features, self.parts)


class ParallelRunner(_AllDepthsAtOnce):
    """MTP parallel heads: their KV cache and the newest row's features."""

    def __init__(self, heads: MTPParallelHeads, vocab: DraftVocab, target, prompt_len: int):
        self.heads, self.parts = heads, vocab.parts
        self.cache = heads.new_cache(prompt_len + CACHE_HEADROOM, target.dtype, target.device)
        self.features: torch.Tensor | None = None  # [K, H] head outputs at the newest cached position

    def receive(self, ctx: DraftContext) -> None:
        cached = int(self.cache.lengths[0])
        rows, start = new_hidden_rows(ctx, self.heads.input_layers, cached)
        if rows is None:
            return
        self.cache = grow_cache(self.cache, start + rows.shape[0] + CACHE_HEADROOM)
        positions = torch.arange(start, start + rows.shape[0])[None]  # [1, n]
        self.features = self.heads.absorb(rows[None], positions, self.cache)

    def ready(self) -> bool:
        return self.features is not None

    def depth_logits(self, depth: int) -> torch.Tensor:
        return self.heads.project(self.features[:depth], self.parts).float()


class ChainRunner:
    """A chained module (MTP sequential, EAGLE): its KV cache and the state at the newest cached
    position (whose projection is the depth-1 distribution).

    The target rows of a step it drafted in are fed through the module as they arrive, as the
    verify ends; the prompt's rows, and those after a step without a draft (the budget policy gave
    it nothing, or a hybrid ran its retrieval sources alone), are held and fed in one forward before
    its next draft: a request it never drafts in costs the module nothing (the prompt's feed is a
    prefill-sized forward, ~4 target steps for an EAGLE-3 layer over a 700-token prompt on a CPU),
    and the held rows are the catch-up the budget policy prices (`pending`) before drafting."""

    def __init__(self, heads: ChainedModule, vocab: DraftVocab, target, prompt_len: int):
        # vocab.parts: embeddings from the full table (any committed token), logits over the draft vocabulary
        self.heads, self.vocab, self.parts = heads, vocab, vocab.parts
        self.cache = heads.new_cache(prompt_len + CACHE_HEADROOM, target.dtype, target.device)
        self.last_output: torch.Tensor | None = None  # [1, 1, H]
        self.held: list[torch.Tensor] = []  # [n_i, H * layers] target rows received, not fed yet
        self.drafted = False  # drafted since the last receive (the prompt's rows wait for the first draft)

    def receive(self, ctx: DraftContext) -> None:
        rows, _ = new_hidden_rows(ctx, self.heads.input_layers, int(self.cache.lengths[0]) + self.pending())
        if rows is not None:
            self.held.append(rows)
        if self.drafted:
            self.feed(ctx)
        self.drafted = False

    def feed(self, ctx: DraftContext) -> None:
        """Feed the held rows through the module: position i's row with committed token i + 1."""
        if not self.held:
            return
        rows, self.held = torch.cat(self.held), []  # [n, H * layers]
        start, num_new = int(self.cache.lengths[0]), rows.shape[0]
        self.cache = grow_cache(self.cache, start + num_new + CACHE_HEADROOM)
        next_tokens = torch.tensor([ctx.tokens[start + 1 : start + 1 + num_new]])  # [1, n]: all committed
        positions = torch.arange(start, start + num_new)[None]
        state = self.heads.first_state(rows[None])  # [1, n, H]
        self.last_output = self.heads.step(state, next_tokens, positions, self.cache, self.parts)[:, -1:]

    def ready(self) -> bool:
        return self.last_output is not None or bool(self.held)

    def pending(self) -> int:
        return sum(rows.shape[0] for rows in self.held)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.heads.project(states, self.parts).float()  # [..., V'] over the draft vocabulary

    def chain(self, ctx: DraftContext, length: int, choose: Choose) -> None:
        self.feed(ctx)
        self.drafted = True
        committed = int(self.cache.lengths[0])
        self.cache = grow_cache(self.cache, committed + length + CACHE_HEADROOM)
        previous, token = self.last_output, None
        for depth in range(1, length + 1):
            if depth > 1:  # depth d sits at position (newest cached) + d - 1 and reads draft token d - 1
                position = torch.tensor([[committed + depth - 2]])
                previous = self.heads.step(previous, torch.tensor([[token]]), position, self.cache, self.parts)
            token, _ = choose(self.logits(previous[0, 0]))
        self.cache.truncate(committed)  # forget the chain's keys: only verified positions stay

    def tree(self, ctx: DraftContext, budget: int, max_depth: int, topk: int, sample: bool) -> Draft:
        """EAGLE-2's dynamic tree: expand the best k nodes of each depth, rank all, keep `budget`
        (children drawn from q with exact rows when sampling, see ScoredTree)."""
        self.feed(ctx)
        self.drafted = True
        committed = int(self.cache.lengths[0])
        depth_limit = min(max_depth, budget)
        self.cache = grow_cache(self.cache, committed + topk * depth_limit + CACHE_HEADROOM)
        tree = ScoredTree(topk, ctx.sampling, ctx.generator, sample, full_probs=self.vocab.full_probs)
        ids = self.vocab.ids
        level = tree.expand(-1, self.logits(self.last_output[0, 0]), ids)
        state_of = {node: self.last_output[0, 0] for node in level}  # the state each node is fed with
        slot_of: dict[int, int] = {}  # node -> its cache slot (nodes fed so far)
        for _ in range(2, depth_limit + 1):
            frontier = tree.best(level, topk)
            if not frontier or tree.cannot_improve(frontier, budget):
                break
            depth = tree.depth(frontier[0])
            first_slot = int(self.cache.lengths[0])
            mask = torch.zeros(len(frontier), first_slot + len(frontier), dtype=torch.bool)  # [F, S]
            mask[:, :committed] = True
            for row, node in enumerate(frontier):
                for ancestor in tree.paths[node][:-1]:
                    mask[row, slot_of[ancestor]] = True
                mask[row, first_slot + row] = True
                slot_of[node] = first_slot + row
            previous = torch.stack([state_of[node] for node in frontier])[None]  # [1, F, H]
            tokens = torch.tensor([[tree.tokens[node] for node in frontier]])  # [1, F]
            positions = torch.full((1, len(frontier)), committed - 1 + depth)  # a depth-d node sits at newest + d
            outputs = self.heads.step(previous, tokens, positions, self.cache, self.parts, mask[None, None])[0]  # [F, H]
            logits = self.logits(outputs)  # [F, V']
            level = []
            for node, row, state in zip(frontier, logits, outputs):
                children = tree.expand(node, row, ids)
                state_of.update((child, state) for child in children)
                level += children
        self.cache.truncate(committed)
        return tree.best_subtree(budget)


class DFlashRunner:
    """The context keys / values of every draft layer over the committed positions, and the target
    rows received since the last block (absorbed when the next block is drafted)."""

    def __init__(self, heads: DFlashModule, vocab: DraftVocab, target, prompt_len: int):
        self.heads, self.vocab, self.parts = heads, vocab, vocab.parts
        attn = heads.layers[0].self_attn
        self.cache = KVCache(len(heads.layers), 1, attn.num_kv_heads, attn.head_dim, prompt_len + CACHE_HEADROOM,
                             target.dtype, target.device)
        self.held: list[torch.Tensor] = []  # target rows [n, F*H] not absorbed yet, oldest first
        self.newest_state: torch.Tensor | None = None  # [1, 1, H] the newest cached context state (anchor_feature)

    @property
    def cached(self) -> int:
        """Positions whose context keys / values are in the cache."""
        return int(self.cache.lengths[0])

    @property
    def known(self) -> int:
        """Positions whose target rows the runner has: cached, or held for the next catch-up."""
        return self.cached + sum(rows.shape[0] for rows in self.held)

    def receive(self, ctx: DraftContext) -> None:
        """Hold the target rows that just entered the target's cache (absorbed at the next catch-up)."""
        rows, _ = new_hidden_rows(ctx, self.heads.input_layers, self.known)
        if rows is not None:
            self.held.append(rows)

    def ready(self) -> bool:
        return self.known > 0

    def pending(self) -> int:
        return self.known - self.cached

    def catch_up(self) -> None:
        """Absorb every held row: the context keys / values of every draft layer, one forward for all."""
        if not self.held:
            return
        rows = self.held[0] if len(self.held) == 1 else torch.cat(self.held)  # [n, F*H]
        self.held = []
        start, num_new = self.cached, rows.shape[0]
        self.cache = grow_cache(self.cache, start + num_new + self.heads.block_size + CACHE_HEADROOM)
        positions = torch.arange(start, start + num_new, device=rows.device)[None]  # [1, n]
        states = self.heads.context_states(rows[None])  # [1, n, H]
        for slot, (keys, values) in enumerate(self.heads.context_kv(states, positions)):
            self.cache.write(slot, keys, values)
        self.cache.advance(num_new)
        self.newest_state = states[:, -1:]

    def block_rows(self, root: int, length: int) -> torch.Tensor:
        """Final-normed hidden states [length, H] of the first `length` prediction rows of the block rooted at `root`."""
        self.catch_up()
        committed = self.cached
        offset = self.heads.prediction_offset
        block = self.heads.block_tokens(torch.tensor([root], device=self.heads.fc.weight.device))  # [1, block_size]
        positions = torch.arange(committed, committed + self.heads.block_size, device=block.device)[None]
        hidden = self.heads.run_block(block, positions, self.cache, None, self.parts, self.newest_state)  # [1, block_size, H]
        self.cache.truncate(committed)  # forget the block's keys: only verified positions stay
        return hidden[0, offset : offset + length]

    def chain(self, ctx: DraftContext, length: int, choose: Choose) -> None:
        """One block forward; each prediction row's token is picked from its own logits (the rows do
        not see each other's picks, so each q is exactly what its token was drawn from)."""
        hidden = self.block_rows(ctx.tokens[-1], length)  # [length, H]
        for row in self.heads.project(hidden, self.parts).float():  # rows of [length, V']
            choose(row)
