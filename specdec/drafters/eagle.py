"""EAGLE drafting (`eagle1`, `eagle3`): a one-layer drafter autoregressing in the target's feature
space, proposing EAGLE-2 dynamic trees (or chains).

The module (specdec.heads.eagle) keeps a small KV cache over the committed positions: each verify
forward returns the target's hidden rows of the tokens that entered its cache (EAGLE-1: the top
layer; EAGLE-3: three fused layers), and the drafter feeds them once (`ChainRunner.absorb`). The
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

from collections.abc import Callable
from pathlib import Path

import torch

from ..checks import check_int, check_positive_int
from ..draft import Draft, ScoredTree
from ..heads import (ChainedModule, DraftVocab, Eagle1Module, Eagle3Module, FrozenTargetParts, draft_linears, grow_cache,
                     load_checkpoint)
from ..heads.export import is_eagle3_export, load_eagle3_export
from ..sampling import sample_from_probs, warp_logits_to_probs
from .base import DraftContext, DraftCost, Drafter, register_drafter

_CACHE_HEADROOM = 64
DEFAULT_TREE_NODES, DEFAULT_TREE_DEPTH, DEFAULT_TREE_TOPK = 10, 6, 4
Choose = Callable[[torch.Tensor], tuple[int, torch.Tensor | None]]  # draft logits [V'] -> (token id, q row [V] or None)


def chain_chooser(vocab: DraftVocab, ctx: DraftContext, sample: bool) -> Choose:
    """How a chain drafter picks each token: argmax (greedy, or sample=False: a deterministic
    proposal) or a sample from the warped q, whose full-vocabulary row goes to verification."""
    if ctx.sampling.greedy or not sample:
        return lambda logits: (vocab.token(logits.argmax()), None)

    def sample_token(logits: torch.Tensor):
        draft_probs = warp_logits_to_probs(logits, ctx.sampling)  # [V']: q, the same warp as the target
        return vocab.token(sample_from_probs(draft_probs, ctx.generator)), vocab.full_probs(draft_probs)  # q over [V]

    return sample_token


def new_hidden_rows(ctx: DraftContext, layers: tuple[int, ...], cached: int) -> tuple[torch.Tensor | None, int]:
    """(the target rows [n, H * len(layers)] just cached, layers concatenated in order; their first
    position), checked against the drafter's cache."""
    parts = [ctx.new_hidden.get(layer) for layer in layers]
    if any(rows is None for rows in parts) or parts[0].shape[0] == 0:
        return None, cached
    start = len(ctx.tokens) - 1 - parts[0].shape[0]  # the root (last token) is not cached yet
    if start != cached:
        raise RuntimeError(f"drafter out of sync: {cached} positions cached, new target rows start at {start}")
    return torch.cat(parts, dim=-1), start


class ChainRunner:
    """Per-sequence state of a chained module (MTP sequential, EAGLE): its KV cache and the state at
    the newest cached position (whose projection is the depth-1 distribution)."""

    def __init__(self, heads: ChainedModule, vocab: DraftVocab, target, prompt_len: int):
        # vocab.parts: embeddings from the full table (any committed token), logits over the draft vocabulary
        self.heads, self.vocab, self.parts = heads, vocab, vocab.parts
        self.cache = heads.new_cache(prompt_len + _CACHE_HEADROOM, target.dtype, target.device)
        self.last_output: torch.Tensor | None = None  # [1, 1, H]

    def absorb(self, ctx: DraftContext) -> None:
        cached = int(self.cache.lengths[0])
        rows, start = new_hidden_rows(ctx, self.heads.input_layers, cached)
        if rows is None:
            return
        num_new = rows.shape[0]
        self.cache = grow_cache(self.cache, start + num_new + _CACHE_HEADROOM)
        next_tokens = torch.tensor([ctx.tokens[start + 1 : start + 1 + num_new]])  # [1, n]: all committed
        positions = torch.arange(start, start + num_new)[None]
        state = self.heads.first_state(rows[None])  # [1, n, H]
        self.last_output = self.heads.step(state, next_tokens, positions, self.cache, self.parts)[:, -1:]

    def ready(self) -> bool:
        return self.last_output is not None

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.heads.project(states, self.parts).float()  # [..., V'] over the draft vocabulary

    def chain(self, length: int, choose: Choose):
        committed = int(self.cache.lengths[0])
        self.cache = grow_cache(self.cache, committed + length + _CACHE_HEADROOM)
        previous, picks = self.last_output, []
        for depth in range(1, length + 1):
            if depth > 1:  # depth d sits at position (newest cached) + d - 1 and reads draft token d - 1
                token = torch.tensor([[picks[-1][0]]])
                position = torch.tensor([[committed + depth - 2]])
                previous = self.heads.step(previous, token, position, self.cache, self.parts)
            picks.append(choose(self.logits(previous[0, 0])))
        self.cache.truncate(committed)  # forget the chain's keys: only verified positions stay
        return picks

    def tree(self, ctx: DraftContext, budget: int, max_depth: int, topk: int, sample: bool) -> Draft:
        """EAGLE-2's dynamic tree: expand the best k nodes of each depth, rank all, keep `budget`
        (children drawn from q with exact rows when sampling, see ScoredTree)."""
        committed = int(self.cache.lengths[0])
        depth_limit = min(max_depth, budget)
        self.cache = grow_cache(self.cache, committed + topk * depth_limit + _CACHE_HEADROOM)
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


class EagleDrafter(Drafter):
    """Shared by `eagle1` and `eagle3`: a chained EAGLE module proposing dynamic trees or chains."""

    module_type: type[ChainedModule] = ChainedModule

    def _setup(self, target, heads: ChainedModule, vocab: DraftVocab, gamma: int, sample: bool, tree: bool,
               tree_nodes: int, tree_depth: int, tree_topk: int, draft_weights: str = "int8") -> None:
        if not isinstance(heads, self.module_type):
            raise ValueError(f"the {self.name} drafter runs {self.module_type.kind!r} modules, got {heads.kind!r}")
        for name, flag in (("sample", sample), ("tree", tree)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be true or false, got {flag!r}")
        self.gamma = check_int("gamma", gamma, 1, 64)
        self.tree_nodes = check_int("tree_nodes", tree_nodes, 1, 256)
        self.tree_depth = check_positive_int("tree_depth", tree_depth)
        self.tree_topk = check_positive_int("tree_topk", tree_topk)
        self.target, self.heads, self.vocab, self.sample, self.tree = target, heads, vocab, sample, tree
        self.linear_backend = draft_linears(heads, vocab, draft_weights)
        self.hidden_layers = tuple(heads.input_layers)
        target_params = sum(p.numel() for p in target.model.parameters())
        head_params = sum(p.numel() for p in heads.parameters())
        lm_rows = 0 if isinstance(heads, Eagle3Module) else vocab.rows * target.hidden_size  # EAGLE-3's head is its own
        per_token = (head_params + lm_rows) / max(1, target_params)  # weights read per draft forward
        self.cost = DraftCost(block=tree_nodes if tree else gamma, per_token=per_token, trees=tree)
        self.runner: ChainRunner | None = None

    def _load(self, target, checkpoint):
        if target is None:
            raise ValueError(f"the {self.name} drafter needs the target (its embeddings and hidden states)")
        if not checkpoint:
            raise ValueError(f"the {self.name} drafter needs checkpoint=DIR: train one with `specdec train {self.name}`")
        return load_checkpoint(checkpoint, target, drafter=self.name)

    @classmethod
    def _vocab(cls, target, heads, config: dict, draft_vocab: int = 0) -> DraftVocab:
        raise NotImplementedError

    @classmethod
    def from_module(cls, target, heads: ChainedModule, gamma: int = 4, sample: bool = True, tree: bool = True,
                    tree_nodes: int = DEFAULT_TREE_NODES, tree_depth: int = DEFAULT_TREE_DEPTH,
                    tree_topk: int = DEFAULT_TREE_TOPK, draft_weights: str = "int8") -> EagleDrafter:
        """A drafter around an in-memory module (e.g. right after training), without a checkpoint."""
        drafter = cls.__new__(cls)
        heads = heads.to(device=target.device, dtype=target.dtype).eval()
        drafter._setup(target, heads, cls._vocab(target, heads, {}), gamma, sample, tree, tree_nodes, tree_depth, tree_topk,
                       draft_weights)
        return drafter

    def begin(self, prompt_ids, target) -> None:
        self.runner = ChainRunner(self.heads, self.vocab, self.target, len(prompt_ids))

    @torch.inference_mode()
    def on_verified(self, result, ctx: DraftContext) -> None:
        self.runner.absorb(ctx)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        if self.runner is None or not self.runner.ready() or budget <= 0:
            return Draft.empty()
        if self.tree:
            return self.runner.tree(ctx, budget, self.tree_depth, self.tree_topk, self.sample)
        picks = self.runner.chain(budget, chain_chooser(self.vocab, ctx, self.sample))
        tokens = torch.tensor([token for token, _ in picks], dtype=torch.long)
        if picks[0][1] is None:
            return Draft.chain(tokens)
        return Draft.chain(tokens, torch.stack([q for _, q in picks]))


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
    module_type = Eagle1Module

    def __init__(self, target=None, checkpoint: str | None = None, tree: bool = True, tree_nodes: int = DEFAULT_TREE_NODES,
                 tree_depth: int = DEFAULT_TREE_DEPTH, tree_topk: int = DEFAULT_TREE_TOPK, gamma: int = 4, sample: bool = True,
                 draft_vocab: int = 8192, draft_weights: str = "int8"):
        heads, config = self._load(target, checkpoint)
        self._setup(target, heads, self._vocab(target, heads, config, draft_vocab), gamma, sample, tree, tree_nodes,
                    tree_depth, tree_topk, draft_weights)

    @classmethod
    def _vocab(cls, target, heads, config: dict, draft_vocab: int = 0) -> DraftVocab:
        return DraftVocab.from_config(FrozenTargetParts.from_target(target), config, draft_vocab)


@register_drafter
class Eagle3Drafter(EagleDrafter):
    """EAGLE-3 (three fused target layers, its own reduced vocabulary) + EAGLE-2 dynamic trees.

    checkpoint: directory written by `specdec train eagle3`, or an EAGLE-3 directory in SGLang /
        vLLM layout for this target (`specdec export`, or a published drafter).
    tree / tree_nodes / tree_depth / tree_topk / gamma / sample / draft_weights: as for `eagle1`.
    """

    name = "eagle3"
    module_type = Eagle3Module

    def __init__(self, target=None, checkpoint: str | None = None, tree: bool = True, tree_nodes: int = DEFAULT_TREE_NODES,
                 tree_depth: int = DEFAULT_TREE_DEPTH, tree_topk: int = DEFAULT_TREE_TOPK, gamma: int = 4, sample: bool = True,
                 draft_weights: str = "int8"):
        if target is not None and checkpoint and is_eagle3_export(Path(checkpoint)):
            heads, config = load_eagle3_export(checkpoint, target), {}
        else:
            heads, config = self._load(target, checkpoint)
        self._setup(target, heads, self._vocab(target, heads, config), gamma, sample, tree, tree_nodes, tree_depth, tree_topk,
                    draft_weights)

    @classmethod
    def _vocab(cls, target, heads, config: dict, draft_vocab: int = 0) -> DraftVocab:
        return DraftVocab(FrozenTargetParts.from_target(target), heads.draft_ids.cpu(), own_head=True)
