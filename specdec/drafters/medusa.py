"""Medusa-1 drafting (`medusa`): K trained heads on the frozen target's last hidden state.

Head k (k = 1..K) reads the hidden state of the newest cached token t (layer num_layers, after
the final norm; the root t + 1 is committed but not cached yet) and predicts token t + k + 1,
i.e. draft depth k (specdec.heads, LABEL_CONVENTION). One proposal = one pass of the K
small heads + the frozen LM head, no extra target forward.

The proposal is a STATIC tree from a Medusa-style choice list: a node at depth d with rank r takes
head d's r-th best candidate (whatever its parent is, as in Medusa-1). Every node is a
deterministic proposal (draft_probs=None), so the core's verification is lossless at every
temperature. Typical acceptance (Medusa's lossy option) is not implemented.

The default tree is built from the checkpoint's held-out rank hit rates (how often head d's rank-r
candidate was the target's token): nodes are added best-first by the product of the hit rates
along their path, Medusa's own construction. Give `choices` to use a hand-made tree instead
(JSON like "[[0], [1], [0, 0], [0, 1], [0, 0, 0]]"); a step's node budget keeps the first nodes
of the list (in the given order, skipping any whose parent is not kept).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Sequence

import torch

from ..checks import check_int
from ..draft import Draft, TreeTemplate, tree_template_from_choices
from ..heads import DraftVocab, MedusaHeads
from .base import DraftContext, DraftCost, register_drafter
from .head_drafter import DEFAULT_DRAFT_VOCAB, HeadCheckpoint, HeadDrafter, cost_per_token, tree_draft
from .head_runners import MedusaRunner

DEFAULT_TREE_NODES = 16
MAX_TREE_NODES = 256


def prior_rank_acc(num_positions: int, num_ranks: int = 10) -> list[list[float]]:
    """A rough prior when a checkpoint carries no evaluation: hit rates fall with depth and rank."""
    return [[0.6 * 0.7**depth * 0.5**rank for rank in range(num_ranks)] for depth in range(num_positions)]


def best_first_choices(rank_acc: Sequence[Sequence[float]], num_nodes: int) -> list[tuple[int, ...]]:
    """Tree paths in best-first order of the estimated path probability prod_d rank_acc[d][path[d]].

    Frontier search: a taken path offers its next sibling (rank + 1) and its first child (rank 0),
    so every prefix of the returned list is a tree (parents come before children).
    """
    depth_limit, rank_limit = len(rank_acc), len(rank_acc[0]) if rank_acc else 0
    if depth_limit == 0 or rank_limit == 0:
        return []
    score = lambda path: float(torch.tensor([rank_acc[d][r] for d, r in enumerate(path)]).prod())  # noqa: E731
    frontier = [(-score((0,)), (0,))]
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < num_nodes:
        _, path = heapq.heappop(frontier)
        chosen.append(path)
        if path[-1] + 1 < rank_limit:
            sibling = path[:-1] + (path[-1] + 1,)
            heapq.heappush(frontier, (-score(sibling), sibling))
        if len(path) < depth_limit:
            child = path + (0,)
            heapq.heappush(frontier, (-score(child), child))
    return chosen


def parse_choices(choices) -> list[tuple[int, ...]]:
    """A JSON string or a sequence of paths -> list of tuples (validated by tree_template_from_choices)."""
    if isinstance(choices, str):
        try:
            choices = json.loads(choices)
        except json.JSONDecodeError as error:
            raise ValueError(f"choices must be JSON like [[0], [1], [0, 0]], got {choices!r}: {error}") from None
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError(f"choices must be a non-empty list of paths like [[0], [1], [0, 0]], got {choices!r}")
    paths = [tuple(path) if isinstance(path, (list, tuple)) else (path,) for path in choices]
    tree_template_from_choices(paths)  # raises a clear error for malformed lists
    return paths


class ChoiceTree:
    """An ordered choice list and its per-budget templates (the first `budget` prefix-closed nodes)."""

    def __init__(self, ordered_choices: list[tuple[int, ...]], num_positions: int):
        too_deep = [path for path in ordered_choices if len(path) > num_positions]
        if too_deep:
            raise ValueError(f"tree choices {too_deep[:3]} are deeper than the {num_positions} trained head positions")
        self.choices = list(ordered_choices)
        self._templates: dict[int, TreeTemplate] = {}

    def __len__(self) -> int:
        return len(self.choices)

    def for_budget(self, budget: int) -> TreeTemplate:
        budget = min(budget, len(self.choices))
        if budget not in self._templates:
            kept: list[tuple[int, ...]] = []
            kept_set: set[tuple[int, ...]] = set()
            for path in self.choices:
                if len(kept) == budget:
                    break
                if len(path) == 1 or path[:-1] in kept_set:
                    kept.append(path)
                    kept_set.add(path)
            self._templates[budget] = tree_template_from_choices(kept)
        return self._templates[budget]

    def draft(self, budget: int, depth_logits: Callable[[int], torch.Tensor], vocab: DraftVocab) -> Draft:
        """The tree of this budget's nodes; depth_logits(D) -> logits [D, V'] of draft depths 1 .. D."""
        template = self.for_budget(budget)
        return tree_draft(template, depth_logits(template.max_depth), vocab)


def build_choice_tree(num_positions: int, rank_acc, choices, tree_nodes: int, num_candidates: int) -> ChoiceTree:
    """The drafter's tree; paths needing a rank >= num_candidates (the draft vocabulary's size) are
    dropped (a path's prefixes use the same ranks, so the rest stays a tree)."""
    check_int("tree_nodes", tree_nodes, 1, MAX_TREE_NODES)
    if choices is not None:
        paths = parse_choices(choices)
    else:
        rank_acc = rank_acc or prior_rank_acc(num_positions)
        paths = best_first_choices([row[:num_candidates] for row in rank_acc[:num_positions]], tree_nodes)
    return ChoiceTree([path for path in paths if max(path) < num_candidates], num_positions)


@register_drafter
class MedusaDrafter(HeadDrafter):
    """Trained Medusa heads proposing a static top-k tree (lossless: deterministic proposals).

    checkpoint: directory written by `specdec train medusa` (for this very target).
    choices: optional Medusa choice list (JSON); default: best-first from the checkpoint's hit rates.
    tree_nodes: size of the default tree (the node budget per step unless the loop gives another).
    draft_vocab: propose only the checkpoint's N most frequent label tokens (computing just their
        LM-head rows); 0 = the full vocabulary. Lossless either way.
    draft_weights: the drafter's own linears while drafting: int8 (default: weight-only int8 in the CPU
        kernel, a quarter of fp32's bytes per draft forward) or fp32 (specdec.heads.draft_linears).
    """

    name = "medusa"
    cost = DraftCost(trees=True)
    runners = {MedusaHeads: MedusaRunner}

    def __init__(self, target=None, checkpoint: str | HeadCheckpoint | None = None, choices: str | None = None,
                 tree_nodes: int = DEFAULT_TREE_NODES, draft_vocab: int = DEFAULT_DRAFT_VOCAB, draft_weights: str = "int8"):
        super().__init__(target, checkpoint, draft_vocab=draft_vocab, draft_weights=draft_weights)
        rank_acc = self.config.get("eval", {}).get("rank_acc")
        self.tree = build_choice_tree(self.heads.num_positions, rank_acc, choices, tree_nodes, self.vocab.rows)
        per_token = cost_per_token(self.heads, target, self.vocab, tokens_per_module_read=self.heads.num_positions)
        self.cost = DraftCost(block=len(self.tree), per_token=per_token, trees=True)

    def draft(self, ctx: DraftContext, budget: int) -> Draft:
        return self.tree.draft(budget, self.runner.depth_logits, self.vocab)
