"""DFlash drafting (`dflash`): one forward of the block-diffusion module drafts a whole chain.

The module (specdec.heads.dflash) keeps a KV cache of the context: after each verify the loop
hands the target's fused hidden rows of the tokens that entered its cache (`ctx.new_hidden`). The
runner only holds them (`DFlashRunner.keep`); each draft layer's context keys / values for them are
computed once, in one forward over every held row, when a block is next drafted
(`DFlashRunner.catch_up`). Every step of that forward is row-wise (fc, RMSNorm, K / V projections,
RoPE at each row's own position) and the draft linears are batch invariant, so the keys are the
same bits as absorbing each step's rows as they come: the draft is the same, and a step that does
not draft (`--gamma auto` falling back to plain decoding) costs the drafter nothing. A proposal runs
the block [root, MASK x (block_size - 1)] at the root's position over that cache (non-causal: no
mask), reads rows 1 .. K through the target's LM head (or the rows of a reduced draft vocabulary),
and forgets the block's keys.

Greedy (or sample=false): each row's argmax. Temperature > 0: each row's token is sampled from
its own warped q and q goes to verification as draft_probs. The rows do not see each other's
sampled tokens, so q_k is exactly the distribution token k was drawn from — rejection sampling
stays exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checks import check_int
from ..draft import Draft
from ..heads import DFlashModule, DraftVocab, FrozenTargetParts, draft_linears, grow_cache, load_checkpoint
from ..heads.export import is_dflash_export, load_dflash_export
from ..kv_cache import KVCache
from .base import DraftContext, DraftCost, Drafter, register_drafter
from .eagle import chain_chooser, new_hidden_rows

_CACHE_HEADROOM = 64


class DFlashRunner:
    """Per-sequence state: the context keys / values of every draft layer over the committed positions."""

    def __init__(self, heads: DFlashModule, vocab: DraftVocab, target, prompt_len: int):
        self.heads, self.vocab, self.parts = heads, vocab, vocab.parts
        attn = heads.layers[0].self_attn
        self.cache = KVCache(len(heads.layers), 1, attn.num_kv_heads, attn.head_dim, prompt_len + _CACHE_HEADROOM,
                             target.dtype, target.device)
        self.held: list[torch.Tensor] = []  # target rows [n, F*H] not absorbed yet, oldest first

    @property
    def cached(self) -> int:
        """Positions whose context keys / values are in the cache."""
        return int(self.cache.lengths[0])

    @property
    def known(self) -> int:
        """Positions whose target rows the runner has: cached, or held for the next catch-up."""
        return self.cached + sum(rows.shape[0] for rows in self.held)

    def keep(self, ctx: DraftContext) -> None:
        """Hold the target rows that just entered the target's cache (absorbed at the next catch-up)."""
        rows, _ = new_hidden_rows(ctx, self.heads.input_layers, self.known)
        if rows is not None:
            self.held.append(rows)

    def catch_up(self) -> None:
        """Absorb every held row: the context keys / values of every draft layer, one forward for all."""
        if not self.held:
            return
        rows = self.held[0] if len(self.held) == 1 else torch.cat(self.held)  # [n, F*H]
        self.held = []
        start, num_new = self.cached, rows.shape[0]
        self.cache = grow_cache(self.cache, start + num_new + self.heads.block_size + _CACHE_HEADROOM)
        positions = torch.arange(start, start + num_new, device=rows.device)[None]  # [1, n]
        for slot, (keys, values) in enumerate(self.heads.context_kv(self.heads.context_states(rows[None]), positions)):
            self.cache.write(slot, keys, values)
        self.cache.advance(num_new)

    def block_rows(self, root: int, length: int) -> torch.Tensor:
        """Final-normed hidden states [length, H] of the first `length` prediction rows of the block rooted at `root`."""
        self.catch_up()
        committed = self.cached
        offset = self.heads.prediction_offset
        block = self.heads.block_tokens(torch.tensor([root], device=self.heads.fc.weight.device))  # [1, block_size]
        positions = torch.arange(committed, committed + self.heads.block_size, device=block.device)[None]
        hidden = self.heads.run_block(block, positions, self.cache, None, self.parts)  # [1, block_size, H]
        self.cache.truncate(committed)  # forget the block's keys: only verified positions stay
        return hidden[0, offset : offset + length]


@register_drafter
class DFlashDrafter(Drafter):
    """DFlash block diffusion: one draft forward proposes a chain of up to block_size - 1 tokens.

    checkpoint: directory written by `specdec train dflash` (for this very target), or a
        DFlashDraftModel directory (`specdec export`, SGLang / vLLM layout) for this target.
    sample: at temperature > 0, sample each draft token from its row's q (draft_probs) instead of argmax.
    draft_vocab: propose only the checkpoint's N most frequent label tokens (0 = every token).
    draft_weights: the drafter's own linears while drafting: int8 (default: weight-only int8 in the CPU
        kernel, a quarter of fp32's bytes per draft forward) or fp32 (specdec.heads.draft_linears).
    """

    name = "dflash"

    # how a directory in the public layout is recognised and loaded (DSparkDrafter: DeepSpec's)
    is_export = staticmethod(is_dflash_export)
    load_export = staticmethod(load_dflash_export)

    def __init__(self, target=None, checkpoint: str | None = None, sample: bool = True, draft_vocab: int = 8192,
                 draft_weights: str = "int8"):
        if target is None:
            raise ValueError(f"the {self.name} drafter needs the target (its embeddings, LM head and hidden states)")
        if not checkpoint:
            raise ValueError(f"the {self.name} drafter needs checkpoint=DIR: train one with `specdec train {self.name}`")
        if self.is_export(Path(checkpoint)):
            heads, config = self.load_export(checkpoint, target), {}
        else:
            heads, config = load_checkpoint(checkpoint, target, drafter=self.name)
        vocab = DraftVocab.from_config(FrozenTargetParts.from_target(target), config, draft_vocab)
        self._setup(target, heads, vocab, sample, draft_weights)

    @classmethod
    def from_module(cls, target, heads: DFlashModule, sample: bool = True, draft_weights: str = "int8") -> DFlashDrafter:
        """A drafter around an in-memory module (e.g. right after training), without a checkpoint."""
        drafter = cls.__new__(cls)
        heads = heads.to(device=target.device, dtype=target.dtype).eval()
        drafter._setup(target, heads, DraftVocab(FrozenTargetParts.from_target(target), None), sample, draft_weights)
        return drafter

    def _setup(self, target, heads: DFlashModule, vocab: DraftVocab, sample: bool, draft_weights: str = "int8") -> None:
        # the exact kind, not only isinstance: a DSpark module IS a DFlash module, but drafting it
        # without its sequential head would propose from the wrong q (DSparkDrafter checks its own)
        if not isinstance(heads, DFlashModule) or (type(self) is DFlashDrafter and heads.kind != DFlashModule.kind):
            hint = " (run it with the dspark drafter)" if getattr(heads, "kind", None) == "dspark" else ""
            raise ValueError(f"the dflash drafter runs 'dflash' modules, got {heads.kind!r}{hint}")
        if not isinstance(sample, bool):
            raise ValueError(f"sample must be true or false, got {sample!r}")
        self.target, self.heads, self.vocab, self.sample = target, heads, vocab, sample
        self.linear_backend = draft_linears(heads, vocab, draft_weights)
        self.hidden_layers = tuple(heads.input_layers)
        target_params = sum(p.numel() for p in target.model.parameters())
        head_params = sum(p.numel() for p in heads.parameters())
        # one forward reads the module once for the whole block; each row reads its LM-head rows
        per_token = (head_params / heads.num_positions + vocab.rows * target.hidden_size) / max(1, target_params)
        self.cost = DraftCost(block=heads.num_positions, per_token=per_token)
        self.runner: DFlashRunner | None = None

    def begin(self, prompt_ids, target) -> None:
        self.runner = DFlashRunner(self.heads, self.vocab, self.target, len(prompt_ids))

    def on_verified(self, result, ctx: DraftContext) -> None:
        self.runner.keep(ctx)  # absorbed when the next block is drafted (block_rows)

    def catch_up_tokens(self, ctx: DraftContext) -> int:
        """Held target rows the next block must first absorb (steps verified without drafting)."""
        return 0 if self.runner is None else self.runner.known - self.runner.cached

    @torch.inference_mode()
    def block_rows(self, ctx: DraftContext, budget: int) -> torch.Tensor | None:
        """Hidden rows [K, H] of this step's block, K = min(budget, prediction rows); None = nothing to draft."""
        if self.runner is None or self.runner.known == 0 or budget <= 0:
            return None
        if len(ctx.tokens) - 1 != self.runner.known:
            raise RuntimeError(f"drafter out of sync: {self.runner.known} positions known, root at {len(ctx.tokens) - 1}")
        return self.runner.block_rows(ctx.tokens[-1], min(check_int("budget", budget, 1), self.heads.num_positions))

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        hidden = self.block_rows(ctx, budget)  # [K, H]
        if hidden is None:
            return Draft.empty()
        choose = chain_chooser(self.vocab, ctx, self.sample)
        picks = [choose(row) for row in self.heads.project(hidden, self.vocab.parts).float()]  # rows of [K, V']
        tokens = torch.tensor([token for token, _ in picks], dtype=torch.long)
        if picks[0][1] is None:
            return Draft.chain(tokens)
        return Draft.chain(tokens, torch.stack([q for _, q in picks]))
