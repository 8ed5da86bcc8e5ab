"""Multi-token-prediction drafting (`mtp`) with trained heads on the frozen target.

The checkpoint decides the flavour (specdec.heads):

* `mtp-parallel` (Gloeckle et al.): K transformer-block heads on one shared trunk state (the input
  of the target's last block). Each head keeps a small KV cache over the committed positions, fed
  with the trunk rows the verify forward returns; head k's next-token distribution is draft depth k.
  Proposal: a chain of the K heads' tokens, or with `tree=true` a Medusa-style static top-k tree.
* `mtp-sequential` (DeepSeek-V3 style; run by head_runners.ChainRunner, as EAGLE is): one module
  [RMSNorm(hidden); RMSNorm(embed(next token))] -> linear -> transformer block -> target's final
  norm + LM head, chained: depth 1 reads the target's last hidden state and the root, depth d
  reads depth d - 1's output and draft token d - 1. Its KV cache holds depth-1 keys of the
  committed positions (computed once, when they are verified) and, while drafting, the chain's own
  keys (dropped after the proposal) — exactly as it was trained.

Lossless either way:
  * temperature 0, or `sample=false`: each draft token is the argmax of its head, a deterministic
    proposal (draft_probs=None; the core accepts x with probability p(x)).
  * temperature > 0 with `sample=true` (default): each token is SAMPLED from q = the head's
    distribution warped with the request's temperature / top-k / top-p, using the sequence's
    generator, and q is passed as draft_probs (rejection sampling min(1, p/q)). The chain length is
    the step's budget, fixed before drafting (non-anticipating). Parallel heads sample each depth
    independently, so q_k is exactly the conditional distribution of token k.
  Trees (parallel flavour only) are deterministic top-k proposals at every temperature.
"""

from __future__ import annotations

from ..checks import check_int
from ..draft import Draft
from ..heads import MTPParallelHeads, MTPSequentialModule
from .base import DraftContext, DraftCost, register_drafter
from .head_drafter import DEFAULT_DRAFT_VOCAB, HeadCheckpoint, HeadDrafter, check_flag, cost_per_token
from .head_runners import ChainRunner, ParallelRunner
from .medusa import DEFAULT_TREE_NODES, build_choice_tree

MAX_SEQUENTIAL_CHAIN = 64  # chain length limit of sequential heads (parallel heads: their K positions)


@register_drafter
class MTPDrafter(HeadDrafter):
    """Trained multi-token-prediction heads (parallel or sequential, chosen by the checkpoint).

    checkpoint: directory written by `specdec train mtp` (for this very target).
    gamma: chain length (default: the trained head positions / depth; parallel heads cap it at K).
    sample: at temperature > 0, sample drafts from the heads (with draft_probs) instead of argmax.
    tree / choices / tree_nodes: parallel heads only — a Medusa-style static top-k tree.
    draft_vocab: propose only the checkpoint's N most frequent label tokens (computing just their
        LM-head rows); 0 = the full vocabulary. Lossless either way.
    draft_weights: the drafter's own linears while drafting: int8 (default: weight-only int8 in the CPU
        kernel, a quarter of fp32's bytes per draft forward) or fp32 (specdec.heads.draft_linears).
    """

    name = "mtp"
    runners = {MTPParallelHeads: ParallelRunner, MTPSequentialModule: ChainRunner}

    def __init__(self, target=None, checkpoint: str | HeadCheckpoint | None = None, gamma: int | None = None,
                 sample: bool = True, tree: bool = False, choices: str | None = None, tree_nodes: int = DEFAULT_TREE_NODES,
                 draft_vocab: int = DEFAULT_DRAFT_VOCAB, draft_weights: str = "int8"):
        super().__init__(target, checkpoint, draft_vocab=draft_vocab, draft_weights=draft_weights, sample=sample)
        heads, parallel = self.heads, isinstance(self.heads, MTPParallelHeads)
        if check_flag("tree", tree) and not parallel:
            raise ValueError(f"tree=true needs parallel MTP heads; this checkpoint holds {heads.kind!r} (a chain drafter)")
        self.max_chain = heads.num_positions if parallel else MAX_SEQUENTIAL_CHAIN
        gamma = check_int(f"gamma for {heads.kind} heads", heads.num_positions if gamma is None else gamma, 1, self.max_chain)
        rank_acc = self.config.get("eval", {}).get("rank_acc")
        self.tree = build_choice_tree(heads.num_positions, rank_acc, choices, tree_nodes, self.vocab.rows) if tree else None
        # parallel: a depth reads its own head; sequential: one module serves every depth
        per_token = cost_per_token(heads, target, self.vocab, tokens_per_module_read=heads.num_positions if parallel else 1)
        self.cost = DraftCost(block=len(self.tree) if tree else gamma, per_token=per_token, trees=tree)

    def draft(self, ctx: DraftContext, budget: int) -> Draft:
        if self.tree is not None:
            return self.tree.draft(budget, self.runner.depth_logits, self.vocab)
        return super().draft(ctx, budget)

    def chain_length(self, budget: int) -> int:
        return min(budget, self.max_chain)
