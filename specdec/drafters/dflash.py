"""DFlash drafting (`dflash`): one forward of the block-diffusion module drafts a whole chain.

The module (specdec.heads.dflash) keeps a KV cache of the context: after each verify the loop
hands the target's fused hidden rows of the tokens that entered its cache (`ctx.new_hidden`). The
runner (head_runners.DFlashRunner) only holds them; each draft layer's context keys / values for
them are computed once, in one forward over every held row, when a block is next drafted
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

import dataclasses

from ..checks import check_int
from ..draft import Draft
from ..heads import DFlashModule
from ..heads.export import is_dflash_export, load_dflash_export
from .base import DraftContext, register_drafter
from .head_drafter import DEFAULT_DRAFT_VOCAB, HeadCheckpoint, HeadDrafter, cost_per_token
from .head_runners import DFlashRunner


@register_drafter
class DFlashDrafter(HeadDrafter):
    """DFlash block diffusion: one draft forward proposes a chain of up to block_size - 1 tokens.

    checkpoint: directory written by `specdec train dflash` (for this very target), or a
        DFlashDraftModel directory (`specdec export`, SGLang / vLLM layout) for this target.
    sample: at temperature > 0, sample each draft token from its row's q (draft_probs) instead of argmax.
    draft_vocab: propose only the checkpoint's N most frequent label tokens (0 = every token).
    draft_weights: the drafter's own linears while drafting: int8 (default: weight-only int8 in the CPU
        kernel, a quarter of fp32's bytes per draft forward) or fp32 (specdec.heads.draft_linears).
    """

    name = "dflash"
    # exactly DFlash modules: a DSpark module IS a DFlash module, but drafting it without its
    # sequential head would propose from the wrong q (the dspark drafter runs those)
    runners = {DFlashModule: DFlashRunner}
    reads_from_target = "its embeddings, LM head and hidden states"
    is_export = staticmethod(is_dflash_export)
    load_export = staticmethod(load_dflash_export)

    def __init__(self, target=None, checkpoint: str | HeadCheckpoint | None = None, sample: bool = True,
                 draft_vocab: int = DEFAULT_DRAFT_VOCAB, draft_weights: str = "int8"):
        super().__init__(target, checkpoint, draft_vocab=draft_vocab, draft_weights=draft_weights, sample=sample)
        # one forward reads the module once for the whole block; each row reads its LM-head rows
        per_token = cost_per_token(self.heads, target, self.vocab, tokens_per_module_read=self.heads.num_positions)
        # the class's cost (DSpark's is scored) with this module's block and price
        self.cost = dataclasses.replace(self.cost, block=self.heads.num_positions, per_token=per_token)

    def draft(self, ctx: DraftContext, budget: int) -> Draft:
        self.check_in_sync(ctx)
        return super().draft(ctx, budget)

    def chain_length(self, budget: int) -> int:
        return min(check_int("budget", budget, 1), self.heads.num_positions)

    def check_in_sync(self, ctx: DraftContext) -> None:
        """The runner knows every committed position but the root (the rows of each verify reached it)."""
        if len(ctx.tokens) - 1 != self.runner.known:
            raise RuntimeError(f"drafter out of sync: {self.runner.known} positions known, root at {len(ctx.tokens) - 1}")
