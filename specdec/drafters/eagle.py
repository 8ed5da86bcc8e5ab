"""EAGLE drafting (`eagle1`, `eagle3`): a one-layer drafter autoregressing in the target's feature
space, proposing EAGLE-2 dynamic trees (or chains).

The module (specdec.heads.eagle) keeps a small KV cache over the committed positions: each verify
forward returns the target's hidden rows of the tokens that entered its cache (EAGLE-1: the top
layer; EAGLE-3: three fused layers), and the drafter feeds them once (head_runners.ChainRunner). The
newest row's output is the depth-1 state; deeper states come from feeding a draft token with its
parent's state — the same computation the trainer unrolls.

Proposals:
  * tree=true (default), EAGLE-2: depth 1 = the root's children; at every further depth the best k
    nodes of the previous depth by score are fed in ONE forward (tree mask over the drafter's
    cache) and each adds k children; finally the best N nodes form the Draft (`ScoredTree`, shared
    with `small-model`). N is the step's budget (the cost table's choice under --gamma auto), the
    depth min(tree_depth, N).
      - greedy (or sample=false): children = the top-k tokens, scored by the path's cumulative
        draft log-probability; deterministic proposals (draft_probs None: the multi-candidate rule).
      - temperature > 0 and sample=true: children are DRAWN from q = the drafter's distribution
        warped like the target's, without replacement; child j's draft_probs row is q with
        children 1..j-1 removed, renormalised, zero outside the draft vocabulary. EAGLE-2's rerank
        by each node's own draft probability would not be exact for sampled nodes (a node kept
        because its own value is likely biases the output), so a sampled slot is scored BEFORE its
        draw (parent's score + log E[q(x_j) | earlier siblings], never above its parent or an
        earlier sibling) and every choice — frontier and final top N — ranks by that score: a
        node's presence then depends only on nodes ranked ahead of it, never on its own value or
        on anything drawn from it (the argument is ScoredTree's docstring).
  * tree=false: a chain of the budget's length; greedy (or sample=false) takes the argmax,
    temperature > 0 SAMPLES each token from q = the drafter's distribution warped like the target's
    and passes q (zero outside the draft vocabulary) as draft_probs — exact rejection sampling.
"""

from __future__ import annotations

from ..checks import check_int, check_positive_int
from ..draft import Draft
from ..heads import DraftVocab, Eagle1Module, Eagle3Module, FrozenTargetParts
from ..heads.export import is_eagle3_export, load_eagle3_export
from .base import DraftContext, DraftCost, register_drafter
from .head_drafter import DEFAULT_DRAFT_VOCAB, HeadCheckpoint, HeadDrafter, check_flag, cost_per_token
from .head_runners import ChainRunner

DEFAULT_TREE_NODES, DEFAULT_TREE_DEPTH, DEFAULT_TREE_TOPK = 10, 6, 4


class EagleDrafter(HeadDrafter):
    """Shared by `eagle1` and `eagle3`: a chained EAGLE module proposing dynamic trees or chains."""

    reads_from_target = "its embeddings and hidden states"

    def __init__(self, target, checkpoint: str | HeadCheckpoint | None, tree: bool, tree_nodes: int, tree_depth: int,
                 tree_topk: int, gamma: int, sample: bool, draft_vocab: int | None, draft_weights: str):
        super().__init__(target, checkpoint, draft_vocab=draft_vocab, draft_weights=draft_weights, sample=sample)
        self.tree = check_flag("tree", tree)
        self.gamma = check_int("gamma", gamma, 1, 64)
        self.tree_nodes = check_int("tree_nodes", tree_nodes, 1, 256)
        self.tree_depth = check_positive_int("tree_depth", tree_depth)
        self.tree_topk = check_positive_int("tree_topk", tree_topk)
        own_lm_head = isinstance(self.heads, Eagle3Module)  # EAGLE-3's head is its own; a draft forward reads it all
        per_token = cost_per_token(self.heads, target, self.vocab, own_lm_head=own_lm_head)
        self.cost = DraftCost(block=tree_nodes if tree else gamma, per_token=per_token, trees=tree)

    def draft(self, ctx: DraftContext, budget: int) -> Draft:
        if self.tree:
            return self.runner.tree(ctx, budget, self.tree_depth, self.tree_topk, self.sample)
        return super().draft(ctx, budget)


@register_drafter
class Eagle1Drafter(EagleDrafter):
    """EAGLE-1 features + EAGLE-2 dynamic trees.

    checkpoint: directory written by `specdec train eagle1` (for this very target).
    tree: EAGLE-2 dynamic tree (default) or a chain of `gamma` tokens.
    tree_nodes: nodes per step (the budget without --gamma auto); tree_depth / tree_topk: its shape.
    sample: at temperature > 0, sample drafts (chains and trees) with exact draft_probs instead of
        proposing the top-k / argmax deterministically.
    draft_vocab: propose only the checkpoint's N most frequent label tokens (0 = every token).
    draft_weights: the drafter's own linears while drafting: int8 (default: weight-only int8 in the CPU
        kernel, a quarter of fp32's bytes per draft forward) or fp32 (specdec.heads.draft_linears).
    """

    name = "eagle1"
    runners = {Eagle1Module: ChainRunner}

    def __init__(self, target=None, checkpoint: str | HeadCheckpoint | None = None, tree: bool = True,
                 tree_nodes: int = DEFAULT_TREE_NODES, tree_depth: int = DEFAULT_TREE_DEPTH, tree_topk: int = DEFAULT_TREE_TOPK,
                 gamma: int = 4, sample: bool = True, draft_vocab: int = DEFAULT_DRAFT_VOCAB, draft_weights: str = "int8"):
        super().__init__(target, checkpoint, tree, tree_nodes, tree_depth, tree_topk, gamma, sample, draft_vocab, draft_weights)


@register_drafter
class Eagle3Drafter(EagleDrafter):
    """EAGLE-3 (three fused target layers, its own reduced vocabulary) + EAGLE-2 dynamic trees.

    checkpoint: directory written by `specdec train eagle3`, or an EAGLE-3 directory in SGLang /
        vLLM layout for this target (`specdec export`, or a published drafter).
    tree / tree_nodes / tree_depth / tree_topk / gamma / sample / draft_weights: as for `eagle1`.
    """

    name = "eagle3"
    runners = {Eagle3Module: ChainRunner}
    is_export = staticmethod(is_eagle3_export)
    load_export = staticmethod(load_eagle3_export)

    def __init__(self, target=None, checkpoint: str | HeadCheckpoint | None = None, tree: bool = True,
                 tree_nodes: int = DEFAULT_TREE_NODES, tree_depth: int = DEFAULT_TREE_DEPTH, tree_topk: int = DEFAULT_TREE_TOPK,
                 gamma: int = 4, sample: bool = True, draft_weights: str = "int8"):
        super().__init__(target, checkpoint, tree, tree_nodes, tree_depth, tree_topk, gamma, sample, None, draft_weights)

    def draft_vocabulary(self, size: int | None) -> DraftVocab:
        """EAGLE-3's own reduced vocabulary (its LM head's rows are the module's)."""
        return DraftVocab(FrozenTargetParts.from_target(self.target), self.heads.draft_ids.cpu(), own_head=True)
