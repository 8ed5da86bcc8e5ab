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
from typing import Callable, Sequence

import torch

from .sampling import SamplingParams, sample_token, warp_logits_to_probs


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
    sources: N names, or None: which source proposed each node when one drafter merges several
        (the `hybrid` drafter: "suffix", "pld", "small-model", ...); SpecStats counts drafted and
        accepted nodes per source. Bookkeeping only: verification never reads it.

    Treat a Draft as immutable: structural properties are computed once and cached.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    confidences: torch.Tensor | None = None
    sources: tuple[str, ...] | None = None

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
        if self.sources is not None:
            self.sources = tuple(self.sources)
            if len(self.sources) != num_nodes or not all(isinstance(name, str) for name in self.sources):
                raise ValueError(f"Draft.sources must be one source name per node (N={num_nodes}), got {self.sources!r}")

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
        """The first `num_nodes` nodes (tokens, parents, draft_probs, confidences, sources sliced alike).
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
            sources=None if self.sources is None else self.sources[:num_nodes],
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
    """A draft tree grown node by node, each node scored by an estimate of the log-probability that
    its root-to-node path is accepted (SpecInfer / EAGLE-2). Nodes are numbered in creation order
    (parents first); drafters (a draft LM, EAGLE) grow it with their own forwards: `expand` adds a
    node's children from the drafter's logits, `best` picks the frontier to expand next,
    `best_subtree(n)` keeps the n best nodes.

    Two modes:
      * deterministic (greedy, or sample=False): a node's children are the top-k tokens of the
        drafter's distribution (warped like the target's when temperature > 0), scored by the
        cumulative draft log-probability of the path; draft_probs None (the multi-candidate rule).
      * sampled (temperature > 0 and sample=True): a node's children are DRAWN from q = the
        drafter's distribution warped like the target's, without replacement; child j carries the
        row it was drawn from, q with children 1..j-1 removed and renormalised (over the full
        vocabulary via `full_probs`: zero outside a reduced draft vocabulary).

    Why the sampled mode stays exact. Recursive rejection sampling (specdec.verify) needs, for each
    node s, that x_s, given everything the verifier knows when it tries s (ancestors, their earlier
    siblings, s's earlier siblings, and that s is in the tree at all), is distributed as s's row.
    x_s is drawn with fresh randomness from that row, so this holds as long as s's presence and
    place are decided without x_s and without anything drawn from it — "downstream of s": its later
    siblings (they depend on x_s through the removal), its descendants, and theirs. Ancestors and
    earlier siblings are fine (a stopping time). EAGLE-2's rerank by the path's own draft
    probabilities breaks this: a node kept because q(x_s) is large favours likely drafts over what
    the target would emit. So a sampled slot is scored BEFORE its token is drawn:
        score(P, j) = min(score(P, j - 1), score(P) + log(S_j / M_j)),
    M_j = q's mass left after children 1..j-1, S_j = the sum of q(x)^2 over the tokens left;
    S_j / M_j = E[q(x_j) | earlier siblings] is the expected value of EAGLE-2's own-value factor
    (the chance that slot j holds the token, were the target's token drawn from q too). A slot
    never outscores its parent (S_j <= M_j) nor an earlier sibling (the min), so under the ranking
    key (score descending, then depth, then creation order) every node downstream of s ranks after
    s. Every decision about the tree compares nodes by that key: s exists if its parent made its
    depth's frontier (`best`: decided by nodes ranked ahead of the parent) and growth did not stop
    (`cannot_improve`: nodes ranked ahead of the best frontier node), and s is kept if fewer than
    n nodes rank ahead of it (`best_subtree`). By induction down the ranking, s's presence is a
    function of the nodes ranked ahead of s, none of which is downstream of s; for the same reason
    the kept set holds every kept node's ancestors and earlier siblings. Deterministic trees need
    none of this: their proposals carry no draft randomness. tests/test_sampled_tree.py shows
    both mistakes (rows ignoring earlier siblings, a top-n by own values) fail a distribution test."""

    def __init__(self, topk: int, sampling: SamplingParams | None = None, generator: torch.Generator | None = None,
                 sample: bool = True, full_probs: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.topk = topk
        self.sampling = sampling or SamplingParams()
        self.sampled = sample and not self.sampling.greedy
        self.generator = generator
        self.full_probs = full_probs  # [V'] -> [V] (a reduced draft vocabulary); None: rows are over [V] already
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []  # estimated log P(root-to-node path accepted), fixed before the token is drawn
        self.paths: list[tuple[int, ...]] = []  # node ids root-to-node (inclusive)
        # sampled mode: node -> (q [V'] of its parent, indices of its earlier siblings, its own index)
        self.sources: list[tuple[torch.Tensor, tuple[int, ...], int]] = []

    def depth(self, node: int) -> int:
        return len(self.paths[node])

    def expand(self, parent: int, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> list[int]:
        """Add the children of `parent` (-1 = the root) from the drafter's logits [V'] after it:
        its top-k tokens, or k tokens drawn without replacement (sampled mode). `token_ids` [V']
        maps an index to its token id (None: the index is the id)."""
        if self.sampled:
            return self._draw_children(parent, warp_logits_to_probs(logits, self.sampling), token_ids)
        if self.sampling.greedy:
            log_probs = torch.log_softmax(logits.float(), dim=-1)
        else:  # tokens the target cannot emit (top-k / top-p) get -inf
            log_probs = warp_logits_to_probs(logits, self.sampling).log()
        return self._top_children(parent, log_probs, token_ids)

    def _add(self, parent: int, token: int, score: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.paths.append((() if parent < 0 else self.paths[parent]) + (node,))
        return node

    def _top_children(self, parent: int, log_probs: torch.Tensor, token_ids: torch.Tensor | None) -> list[int]:
        values, indices = torch.topk(log_probs, min(self.topk, log_probs.shape[0]))
        tokens = indices if token_ids is None else token_ids[indices]
        base = 0.0 if parent < 0 else self.scores[parent]
        children = []
        for value, token in zip(values.tolist(), tokens.tolist()):
            if value == -math.inf:
                break
            children.append(self._add(parent, token, base + value))
        return children

    def _draw_children(self, parent: int, probs: torch.Tensor, token_ids: torch.Tensor | None) -> list[int]:
        """Draw up to k children from q = probs [V'] without replacement, each slot scored before its draw."""
        remaining = probs.clone()  # [V']: q with the children drawn so far removed (unnormalised)
        score = 0.0 if parent < 0 else self.scores[parent]
        base, drawn, children = score, [], []
        for _ in range(self.topk):
            mass = float(remaining.sum())
            if mass <= 0.0:  # q's whole support is drawn
                break
            expected_own = float(remaining.double().square().sum()) / mass  # S_j / M_j = E[q(x_j) | earlier siblings]
            score = min(score, base + math.log(expected_own)) if expected_own > 0.0 else -math.inf
            index = sample_token(remaining, self.generator)
            token = index if token_ids is None else int(token_ids[index])
            node = self._add(parent, token, score)
            self.sources.append((probs, tuple(drawn), index))
            children.append(node)
            drawn.append(index)
            remaining[index] = 0.0
        return children

    def draft_row(self, node: int) -> torch.Tensor:
        """The distribution node's token was drawn from [V]: its parent's q with the earlier
        siblings removed, renormalised (zero outside the draft vocabulary)."""
        probs, earlier, _ = self.sources[node]
        row = probs.clone()
        row[list(earlier)] = 0.0
        row = row / row.sum()
        return row if self.full_probs is None else self.full_probs(row)

    def best(self, nodes: Sequence[int], count: int) -> list[int]:
        """The `count` best-scoring of `nodes`, best first (ties: creation order)."""
        return sorted(nodes, key=lambda node: (-self.scores[node], node))[:count]

    def cannot_improve(self, frontier: Sequence[int], budget: int) -> bool:
        """True when `budget` nodes already beat the best frontier node: no deeper node can enter the best-n tree."""
        best = max(self.scores[node] for node in frontier)
        return sum(score > best for score in self.scores) >= budget

    def _closure(self, node: int, children: dict[int, list[int]]) -> set[int]:
        """`node`, its ancestors and each one's earlier siblings (`children`: parent -> children in creation order)."""
        needed = set()
        for member in self.paths[node]:
            siblings = children[self.parents[member]]
            needed.update(siblings[: siblings.index(member) + 1])
        return needed

    def best_subtree(self, budget: int) -> Draft:
        """The best nodes by score, taken with their ancestors and earlier siblings while `budget`
        allows; parents first, siblings in creation (= score, = draw) order."""
        order = sorted(range(len(self.tokens)), key=lambda n: (-self.scores[n], len(self.paths[n]), n))
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(node)
        kept: set[int] = set()
        for node in order:
            needed = self._closure(node, children) - kept  # just {node} for heap-ordered scores
            if len(kept) + len(needed) <= budget:
                kept |= needed
            if len(kept) == budget:
                break
        chosen = sorted(kept, key=lambda n: (len(self.paths[n]), self.paths[n][:-1], n))
        # sorting by (depth, parent path) keeps every parent before its children
        new_index = {node: i for i, node in enumerate(chosen)}
        parents = [-1 if self.parents[n] < 0 else new_index[self.parents[n]] for n in chosen]
        tokens = torch.tensor([self.tokens[n] for n in chosen], dtype=torch.long)
        draft_probs = torch.stack([self.draft_row(n) for n in chosen]) if self.sampled and chosen else None  # [N, V]
        return Draft(tokens, torch.tensor(parents, dtype=torch.long), draft_probs)
