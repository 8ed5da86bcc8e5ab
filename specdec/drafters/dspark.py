"""DSpark drafting (`dspark`): one DFlash backbone forward for the block, then a light sequential
pass left to right.

The backbone (shared with `dflash`, DFlashRunner) gives the hidden rows of the block
[root, MASK ...] at the root's position; row k proposes draft token k + 1 (the root row is itself
the first prediction). Token k is then drawn from the EXACT q_k = warp(lm_head(h_k) + bias_k),
where bias_k comes from the sequential head given the token drafted at k - 1 (the root for k = 0):
greedy takes the argmax, temperature > 0 samples, and q_k is passed as draft_probs, so rejection
sampling stays exact although the rows now depend on each other. Each node also carries its
calibrated confidence c_k (Draft.confidences), which the confidence scheduler multiplies into
survivals to cut the block before verification (`--gamma auto`).
"""

from __future__ import annotations

from ..draft import Draft
from ..heads import DSparkModule
from ..heads.export import is_dspark_export, load_dspark_export
from .base import DraftContext, DraftCost, register_drafter
from .dflash import DFlashDrafter
from .head_drafter import ChainPicks, chain_chooser
from .head_runners import DFlashRunner


@register_drafter
class DSparkDrafter(DFlashDrafter):
    """DSpark: the DFlash backbone + a sequential (Markov / RNN) head + calibrated confidences.

    checkpoint: directory written by `specdec train dspark` (for this very target), or a DSpark
        directory in DeepSpec's layout (`specdec export`) for this target.
    sample: at temperature > 0, sample each draft token from its exact q (draft_probs) instead of argmax.
    draft_vocab: propose only the checkpoint's N most frequent label tokens (0 = every token).
    draft_weights: int8 (default) or fp32, as for `dflash`.
    """

    name = "dspark"
    runners = {DSparkModule: DFlashRunner}
    is_export = staticmethod(is_dspark_export)
    load_export = staticmethod(load_dspark_export)

    # its drafts are scored: c_k reads h_k and the token before k, known before token k is drawn
    cost = DraftCost(scored=True)

    def draft(self, ctx: DraftContext, budget: int) -> Draft:
        self.check_in_sync(ctx)
        hidden = self.runner.block_rows(ctx.tokens[-1], self.chain_length(budget))  # [K, H]
        base_logits = self.heads.project(hidden, self.vocab.parts).float()  # [K, V'] over the draft vocabulary
        picks = ChainPicks(chain_chooser(self.vocab, ctx, self.sample))
        _, _, confidences = self.heads.sequential.draft(base_logits, hidden, ctx.tokens[-1], picks, self.vocab.ids)
        return picks.draft(confidences)
