"""The Draft type: a chain or tree of proposed tokens, plus its tree mask / positions / paths.

Node indexing: nodes are 0..N-1 in "node order"; a node's parent always comes before it
(parents[i] < i) and parent -1 means "child of the last committed token" (the root). The
verify forward feeds N + 1 tokens: the last committed token first (row/column 0 of the mask,
position `start`), then the N draft nodes (row/column i + 1). A chain is the tree whose
parents are [-1, 0, 1, ...].

Siblings are tried by the verifier in node order, so drafters should list the most likely
child first. See specdec.verify for what `draft_probs` must contain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch


def _as_index_tensor(values, name: str) -> torch.Tensor:
    """Lists/tuples -> LongTensor; integer tensors -> long; anything else is a clear error."""
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor(list(values), dtype=torch.long)
    if values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
        raise ValueError(f"Draft.{name} must hold integers, got dtype {values.dtype}")
    if values.dim() != 1:
        raise ValueError(f"Draft.{name} must be 1-D [N], got shape {tuple(values.shape)}")
    return values.long()


def _as_probability_tensor(values, num_nodes: int) -> torch.Tensor:
    """Per-node confidences -> float tensor [N] with every entry in [0, 1], or a clear error."""
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor(list(values), dtype=torch.float32)
    if not values.is_floating_point():
        values = values.float()
    if values.dim() != 1 or values.shape[0] != num_nodes:
        raise ValueError(f"Draft.confidences must have shape [N={num_nodes}], got {tuple(values.shape)}")
    if num_nodes and not bool(((values >= 0) & (values <= 1)).all()):  # NaN fails both comparisons
        raise ValueError(f"Draft.confidences must be probabilities in [0, 1], got {values.tolist()}")
    return values


@dataclass(eq=False)
class Draft:
    """Proposed tokens arranged as a tree (a chain is the special case parents = [-1, 0, 1, ...]).

    tokens: [N] proposed token ids.
    parents: [N] parent node index; -1 = child of the last committed token.
    draft_probs: [N, V] the distribution q(.) each node's token was sampled from, or None for a
        deterministic proposal (n-gram match, argmax, top-k expansion: q is one-hot).
    confidences: [N] floats in [0, 1], or None: the drafter's estimate of P(node accepted | its
        parent accepted) (DSpark's confidence head), computed BEFORE the node's token is drawn:
        from its ancestors' tokens, never from its own (else verifying the node would depend on
        its value). With them the loop may verify only a prefix of a chain
        (specdec.schedule.admit); they never change which tokens are accepted.

    Treat a Draft as immutable: structural properties are computed once and cached.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    confidences: torch.Tensor | None = None

    def __post_init__(self):
        self.tokens = _as_index_tensor(self.tokens, "tokens")
        self.parents = _as_index_tensor(self.parents, "parents").to(self.tokens.device)
        num_nodes = self.tokens.shape[0]
        if self.parents.shape[0] != num_nodes:
            raise ValueError(
                f"Draft.parents must have one entry per token: {self.parents.shape[0]} parents "
                f"for {num_nodes} tokens"
            )
        for node, parent in enumerate(self._parent_list):
            if not -1 <= parent < node:
                raise ValueError(
                    f"Draft.parents[{node}] = {parent}: a parent must be -1 (root) or an earlier "
                    f"node index in [0, {node - 1}]"
                )
        if num_nodes and int(self.tokens.min()) < 0:
            raise ValueError(f"Draft.tokens must be non-negative token ids, got {self.tokens.tolist()}")
        if self.draft_probs is not None:
            probs = self.draft_probs
            if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
                raise ValueError("Draft.draft_probs must be a floating-point tensor [N, V] or None")
            if probs.dim() != 2 or probs.shape[0] != num_nodes:
                raise ValueError(
                    f"Draft.draft_probs must have shape [N={num_nodes}, V], got {tuple(probs.shape)}"
                )
            if num_nodes and int(self.tokens.max()) >= probs.shape[1]:
                raise ValueError(
                    f"Draft.tokens contain id {int(self.tokens.max())} outside the draft vocabulary "
                    f"of size V={probs.shape[1]}"
                )
        if self.confidences is not None:
            self.confidences = _as_probability_tensor(self.confidences, num_nodes)

    # ---------------------------------------------------------------- constructors
    @classmethod
    def chain(cls, tokens, draft_probs: torch.Tensor | None = None, confidences=None) -> "Draft":
        """A linear draft: node i is the child of node i - 1 (node 0 of the root)."""
        tokens = _as_index_tensor(tokens, "tokens")
        parents = torch.arange(-1, tokens.shape[0] - 1, dtype=torch.long, device=tokens.device)
        return cls(tokens=tokens, parents=parents, draft_probs=draft_probs, confidences=confidences)

    @classmethod
    def empty(cls) -> "Draft":
        """No proposal: verification then just samples one token from the target."""
        return cls(tokens=torch.zeros(0, dtype=torch.long), parents=torch.zeros(0, dtype=torch.long))

    def prefix(self, num_nodes: int) -> "Draft":
        """The first `num_nodes` nodes (tokens, parents, draft_probs, confidences sliced alike).
        Parents come before children, so any prefix of node order is itself a valid tree."""
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or not 0 <= num_nodes <= self.num_nodes:
            raise ValueError(f"prefix length must be an integer in [0, {self.num_nodes}], got {num_nodes!r}")
        if num_nodes == self.num_nodes:
            return self
        return Draft(
            tokens=self.tokens[:num_nodes],
            parents=self.parents[:num_nodes],
            draft_probs=None if self.draft_probs is None else self.draft_probs[:num_nodes],
            confidences=None if self.confidences is None else self.confidences[:num_nodes],
        )

    # ---------------------------------------------------------------- structure
    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @cached_property
    def _parent_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def _depth_list(self) -> list[int]:
        depths: list[int] = []
        for parent in self._parent_list:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    @cached_property
    def depths(self) -> torch.Tensor:
        """[N] depth of each node; children of the root have depth 1."""
        return torch.tensor(self._depth_list, dtype=torch.long, device=self.tokens.device)

    @cached_property
    def is_chain(self) -> bool:
        """True when parents == [-1, 0, 1, ..., N - 2] (an empty draft is a chain)."""
        return self._parent_list == list(range(-1, self.num_nodes - 1))

    @cached_property
    def children_lists(self) -> list[list[int]]:
        """children_lists[i + 1] = children of node i in node order (index 0 = the root's)."""
        children: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for node, parent in enumerate(self._parent_list):
            children[parent + 1].append(node)
        return children

    def children(self, node: int) -> list[int]:
        """Children of `node` in node order; node = -1 is the root (the last committed token)."""
        if not -1 <= node < self.num_nodes:
            raise ValueError(f"node must be -1 (root) or in [0, {self.num_nodes - 1}], got {node}")
        return list(self.children_lists[node + 1])

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (inclusive)."""
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node must be in [0, {self.num_nodes - 1}], got {node}")
        path = []
        while node >= 0:
            path.append(node)
            node = self._parent_list[node]
        return path[::-1]

    def leaf_paths(self) -> list[list[int]]:
        """Root-to-leaf node index paths, one per leaf, ordered by leaf index ([] if empty)."""
        return [self.path_to(node) for node in range(self.num_nodes) if not self.children_lists[node + 1]]

    @cached_property
    def _ancestor_or_self(self) -> torch.Tensor:
        """[N, N] bool: [i, j] is True when j is i or an ancestor of i."""
        num_nodes = self.num_nodes
        mask = torch.eye(num_nodes, dtype=torch.bool)
        for node, parent in enumerate(self._parent_list):
            if parent >= 0:  # parents come first, so the parent's row is already complete
                mask[node] |= mask[parent]
        return mask

    def tree_attention_mask(self, include_root: bool = True) -> torch.Tensor:
        """Bool mask over the verify inputs (True = may attend).

        include_root=True: [N + 1, N + 1]; row/column 0 is the last committed token (attends only
        to itself); node i (row i + 1) attends to the root, its ancestors and itself.
        include_root=False: [N, N] among draft nodes only.
        The mask covers only the new tokens; the committed prefix in the KV cache is visible to all.
        """
        among_nodes = self._ancestor_or_self
        if not include_root:
            return among_nodes.clone().to(self.tokens.device)
        num_nodes = self.num_nodes
        mask = torch.zeros(num_nodes + 1, num_nodes + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[1:, 1:] = among_nodes
        return mask.to(self.tokens.device)

    def positions(self, start: int) -> torch.Tensor:
        """[N + 1] position ids of the verify inputs: start for the last committed token, start + depth for nodes."""
        root = torch.zeros(1, dtype=torch.long, device=self.tokens.device)
        return int(start) + torch.cat([root, self.depths])


@dataclass(frozen=True)
class TreeTemplate:
    """A static tree shape built from Medusa-style choice paths.

    choices[i]: the path of candidate ranks from the root to node i, e.g. (0, 1) = "the 2nd best
        candidate after the best candidate". Sorted by (depth, path) so siblings appear with the
        best rank first — the order in which the verifier tries them.
    parents[i]: parent node index (-1 = root). ranks[i]: choices[i][-1], the candidate rank node i
        takes among its parent's candidates. depths[i] = len(choices[i]).
    """

    choices: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    depths: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.choices)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def topk_per_depth(self) -> tuple[int, ...]:
        """How many top candidates each depth needs (max rank + 1), depth 1 first."""
        needed = [0] * self.max_depth
        for depth, rank in zip(self.depths, self.ranks):
            needed[depth - 1] = max(needed[depth - 1], rank + 1)
        return tuple(needed)

    def parents_tensor(self) -> torch.Tensor:
        """[N] LongTensor of parents, ready for Draft(tokens, parents, ...)."""
        return torch.tensor(self.parents, dtype=torch.long)


def tree_template_from_choices(choices: Sequence[Sequence[int]]) -> TreeTemplate:
    """Build a TreeTemplate from Medusa choice paths such as [(0,), (1,), (0, 0), (0, 1), (1, 0)].

    Every path must be non-empty, made of ranks >= 0, unique, and every proper prefix of a path
    must also be listed (a node needs its parent).
    """
    normalised: list[tuple[int, ...]] = []
    for choice in choices:
        path = tuple(choice)
        if not path:
            raise ValueError("tree choices must be non-empty paths of candidate ranks, got ()")
        if any(isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 for rank in path):
            raise ValueError(f"tree choice {path} must contain only integer ranks >= 0")
        normalised.append(path)
    if len(set(normalised)) != len(normalised):
        duplicates = sorted({path for path in normalised if normalised.count(path) > 1})
        raise ValueError(f"tree choices must be unique, duplicated: {duplicates}")
    ordered = sorted(normalised, key=lambda path: (len(path), path))
    index_of = {path: index for index, path in enumerate(ordered)}
    parents = []
    for path in ordered:
        if len(path) == 1:
            parents.append(-1)
        elif path[:-1] in index_of:
            parents.append(index_of[path[:-1]])
        else:
            raise ValueError(f"tree choice {path} needs its parent {path[:-1]} to be listed too")
    return TreeTemplate(
        choices=tuple(ordered),
        parents=tuple(parents),
        ranks=tuple(path[-1] for path in ordered),
        depths=tuple(len(path) for path in ordered),
    )


class ScoredTree:
    """A draft tree grown by top-k expansion, each node scored by the cumulative draft
    log-probability of its root-to-node path (SpecInfer / EAGLE-2). Nodes are numbered in creation
    order (parents first); `best_subtree(n)` reranks every node and keeps the n best, which is a
    tree because a child never scores above its parent. Model drafters (a draft LM, EAGLE) grow it
    with their own forwards; every proposal it makes is deterministic (draft_probs None)."""

    def __init__(self, topk: int):
        self.topk = topk
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []  # cumulative draft log-probability of the root-to-node path
        self.paths: list[tuple[int, ...]] = []  # node ids root-to-node (inclusive)

    def depth(self, node: int) -> int:
        return len(self.paths[node])

    def expand(self, parent: int, log_probs: torch.Tensor, token_ids: torch.Tensor | None = None) -> list[int]:
        """Add the top-k children of `parent` (-1 = the root) from draft log-probabilities [V'];
        `token_ids` [V'] maps an index to its token id (None: the index is the id)."""
        values, indices = torch.topk(log_probs, min(self.topk, log_probs.shape[0]))
        tokens = indices if token_ids is None else token_ids[indices]
        base = 0.0 if parent < 0 else self.scores[parent]
        prefix = () if parent < 0 else self.paths[parent]
        children = []
        for value, token in zip(values.tolist(), tokens.tolist()):
            if value == -math.inf:
                break
            node = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(base + value)
            self.paths.append(prefix + (node,))
            children.append(node)
        return children

    def best(self, nodes: Sequence[int], count: int) -> list[int]:
        """The `count` best-scoring of `nodes`, best first."""
        return sorted(nodes, key=lambda node: -self.scores[node])[:count]

    def cannot_improve(self, frontier: Sequence[int], budget: int) -> bool:
        """True when `budget` nodes already beat the best frontier node: no deeper node can enter the best-n tree."""
        best = max(self.scores[node] for node in frontier)
        return sum(score > best for score in self.scores) >= budget

    def best_subtree(self, budget: int) -> Draft:
        """The `budget` best nodes by path score (ancestor-closed), parents first, best sibling first."""
        order = sorted(range(len(self.tokens)), key=lambda n: (-self.scores[n], len(self.paths[n]), n))
        chosen = sorted(order[:budget], key=lambda n: (len(self.paths[n]), self.paths[n][:-1], -self.scores[n], n))
        # sorting by (depth, parent path) keeps every parent before its children
        new_index = {node: i for i, node in enumerate(chosen)}
        parents = [-1 if self.parents[n] < 0 else new_index[self.parents[n]] for n in chosen]
        tokens = torch.tensor([self.tokens[n] for n in chosen], dtype=torch.long)
        return Draft(tokens, torch.tensor(parents, dtype=torch.long), None)
