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

import dataclasses

import torch

from ..draft import Draft
from ..heads import DraftVocab, DSparkModule
from ..heads.export import is_dspark_export, load_dspark_export
from .base import DraftContext, register_drafter
from .dflash import DFlashDrafter
from .eagle import chain_chooser


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

    is_export = staticmethod(is_dspark_export)
    load_export = staticmethod(load_dspark_export)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        hidden = self.block_rows(ctx, budget)  # [K, H]
        if hidden is None:
            return Draft.empty()
        base_logits = self.heads.project(hidden, self.vocab.parts).float()  # [K, V'] over the draft vocabulary
        tokens, probs, confidences = self.heads.sequential.draft(
            base_logits, hidden, ctx.tokens[-1], chain_chooser(self.vocab, ctx, self.sample), self.vocab.ids)
        return Draft.chain(torch.tensor(tokens, dtype=torch.long), probs, confidences)

    def _setup(self, target, heads, vocab: DraftVocab, sample: bool, draft_weights: str = "int8") -> None:
        if not isinstance(heads, DSparkModule):
            raise ValueError(f"the dspark drafter runs 'dspark' modules, got {heads.kind!r}")
        super()._setup(target, heads, vocab, sample, draft_weights)
        # its drafts are scored: c_k reads h_k and the token before k, known before token k is drawn
        self.cost = dataclasses.replace(self.cost, scored=True)
