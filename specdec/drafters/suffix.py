"""`suffix`: suffix-trie drafting (the SuffixDecoding / SGLang-NGRAM idea), a tree ranked by frequency.

Every n-gram (n <= max_match + max_depth) of the prompt + output is counted in a trie, updated
incrementally as tokens are committed. To draft, the longest recent suffix of the context (up to
`max_match` tokens, at least `min_match`) that has been seen followed by something is located in
the trie; its continuations are expanded best-first by their empirical path probability
(product of count(child) / count(all children) along the path) into a tree of up to `budget`
nodes, at most `max_children` per node and `max_depth` deep, dropping paths below `min_prob`.

With `share_across_requests` (default) a second, global trie shared by every sequence of the
same drafter object also counts earlier requests' outputs (SuffixDecoding's "global tree"); the
drafter proposes from whichever trie gives the higher expected accepted length. The per-sequence
trie is rebuilt in begin(). The global trie is reset when it exceeds `global_max_nodes`.

Proposals are deterministic (draft_probs=None), so the output is exactly the target's. With the
global trie, drafts depend on earlier requests, so a seeded SAMPLED run is reproducible only
from the same drafter state (the distribution is always exactly the target's).

`TrieNode` and `expand_draft` are shared with the `rest` drafter.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..draft import Draft
from .base import DraftContext, DraftCost, Drafter, register_drafter
from ..checks import check_int
from .pld import check_ngram_range

MAX_MATCH_LIMIT = 32
MAX_DEPTH_LIMIT = 64


class TrieNode:
    """One n-gram: how often it occurred and the tokens seen right after it (child n+1-grams)."""

    __slots__ = ("children", "count", "child_total")

    def __init__(self):
        self.children: dict[int, TrieNode] | None = None  # created lazily: most nodes are leaves
        self.count = 0  # occurrences of this n-gram
        self.child_total = 0  # sum of the children's counts (occurrences followed by a token)

    def child(self, token: int) -> TrieNode | None:
        return self.children.get(token) if self.children else None

    def add_child(self, token: int, count: int = 1) -> tuple[TrieNode, bool]:
        """Count `count` more occurrences of child `token`; returns (child, created)."""
        if self.children is None:
            self.children = {}
        node = self.children.get(token)
        created = node is None
        if created:
            node = self.children[token] = TrieNode()
        node.count += count
        self.child_total += count
        return node, created

    def ranked_children(self, limit: int) -> list[tuple[int, TrieNode]]:
        """The `limit` most frequent children, most frequent first (ties: smaller token id first)."""
        if not self.children:
            return []
        ranked = sorted(self.children.items(), key=lambda item: (-item[1].count, item[0]))
        return ranked[:limit]


class NgramTrie:
    """Counts of every n-gram (n <= depth) of the token streams fed to it."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = TrieNode()
        self.num_nodes = 1

    def extend(self, active: list[TrieNode], tokens) -> list[TrieNode]:
        """Append `tokens` to a stream whose last windows are `active` (active[k] = node of its last
        k + 1 tokens) and count every new n-gram; returns the stream's new active list."""
        for token in tokens:
            extended = [self.root] + active[: self.depth - 1]  # windows of length 0 .. depth-1
            active = []
            for node in extended:
                child, created = node.add_child(token)
                self.num_nodes += created
                active.append(child)
        return active

    def find(self, tokens) -> TrieNode | None:
        """The node of n-gram `tokens`, or None if it never occurred."""
        node = self.root
        for token in tokens:
            node = node.child(token)
            if node is None:
                return None
        return node

    def longest_match(self, context: list[int], max_match: int, min_match: int) -> TrieNode | None:
        """Node of the longest suffix of `context` (min_match..max_match tokens) seen followed by a token."""
        for length in range(min(max_match, len(context), self.depth - 1), min_match - 1, -1):
            node = self.find(context[-length:])
            if node is not None and node.child_total:
                return node
        return None


@dataclass
class DraftPlan:
    """A deterministic draft tree plus its expected accepted length under the count model."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    score: float = 0.0  # sum of node path probabilities = expected accepted tokens

    def to_draft(self) -> Draft:
        if not self.tokens:
            return Draft.empty()
        return Draft(self.tokens, self.parents, None)


def expand_draft(
    start: TrieNode | None, budget: int, max_depth: int, max_children: int, min_prob: float, tree: bool = True
) -> DraftPlan:
    """Grow a draft from the continuations of `start`, most probable path first.

    Path probability = product of count(child) / child_total(parent) along the path. A tree pops
    nodes best-first from a heap, so a parent always precedes its children (a child's probability
    never exceeds its parent's; ties keep push order) and siblings appear most frequent first, the
    order the verifier tries them. A chain follows the most frequent child at each step.
    """
    plan = DraftPlan()
    if start is None or not start.child_total or budget <= 0:
        return plan
    if not tree:
        node, prob = start, 1.0
        while len(plan.tokens) < min(budget, max_depth) and node.child_total:
            token, child = node.ranked_children(1)[0]
            prob *= child.count / node.child_total
            if prob < min_prob:
                break
            plan.parents.append(len(plan.tokens) - 1)
            plan.tokens.append(token)
            plan.score += prob
            node = child
        return plan
    heap: list[tuple[float, int, int, TrieNode, int, int]] = []  # (-prob, push order, token, node, parent, depth)
    pushed = 0

    def push_children(node: TrieNode, prob: float, parent: int, depth: int) -> None:
        nonlocal pushed
        for token, child in node.ranked_children(max_children):
            child_prob = prob * child.count / node.child_total
            if child_prob >= min_prob:
                heapq.heappush(heap, (-child_prob, pushed, token, child, parent, depth))
                pushed += 1

    push_children(start, 1.0, -1, 1)
    while heap and len(plan.tokens) < budget:
        neg_prob, _, token, node, parent, depth = heapq.heappop(heap)
        index = len(plan.tokens)
        plan.tokens.append(token)
        plan.parents.append(parent)
        plan.score += -neg_prob
        if depth < max_depth and node.child_total:
            push_children(node, -neg_prob, index, depth + 1)
    return plan


class _SharedTrie:
    """Holder of the global trie, shared by reference by every sequence of one drafter object."""

    def __init__(self, depth: int):
        self.trie = NgramTrie(depth)


@register_drafter
class SuffixDrafter(Drafter):
    """Suffix-trie drafter over prompt + output (+ earlier requests' outputs), tree or chain.

    Options:
        max_match / min_match: longest / shortest context suffix looked up (longest wins).
            min_match defaults to 2: on CPU a missed draft still doubles the step cost, and a
            one-token context ("the") predicts poorly.
        max_depth: deepest draft node. max_children: branching limit per node.
        min_prob: drop draft paths whose empirical probability is below this.
        tree: False = propose only the most frequent chain.
        share_across_requests: also learn from (and draft with) earlier requests' outputs.
        global_max_nodes: reset the global trie beyond this many nodes (bounds memory, ~300 B/node).
        gamma: draft nodes per step when no cost model picks it.
    """

    name = "suffix"
    retrieval_source = True
    cost = DraftCost(block=8, trees=True)

    def __init__(
        self,
        target=None,
        max_match: int = 8,
        min_match: int = 2,
        max_depth: int = 6,
        max_children: int = 4,
        min_prob: float = 0.1,
        tree: bool = True,
        share_across_requests: bool = True,
        global_max_nodes: int = 500_000,
        gamma: int = 8,
    ):
        check_ngram_range("min_match", min_match, "max_match", max_match, MAX_MATCH_LIMIT)
        self.max_match, self.min_match = max_match, min_match
        self.max_depth = check_int("max_depth", max_depth, 1, MAX_DEPTH_LIMIT)
        self.max_children = check_int("max_children", max_children, 1, 64)
        if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be a number in [0, 1], got {min_prob!r}")
        self.min_prob = float(min_prob)
        if not isinstance(tree, bool) or not isinstance(share_across_requests, bool):
            raise ValueError(
                f"tree and share_across_requests must be booleans, got {tree!r}, {share_across_requests!r}"
            )
        self.tree = tree
        self.global_max_nodes = check_int("global_max_nodes", global_max_nodes, 1)
        self.cost = DraftCost(block=check_int("gamma", gamma, 1, 1024), trees=tree)
        self.trie_depth = max_match + max_depth  # a match plus its drafted continuation
        self.shared = _SharedTrie(self.trie_depth) if share_across_requests else None
        self._reset()

    def _reset(self) -> None:
        # fresh objects (never cleared in place): for_sequence() copies share attributes until begin()
        self.local = NgramTrie(self.trie_depth)
        self.local_active: list[TrieNode] = []
        self.global_trie: NgramTrie | None = None
        self.global_active: list[TrieNode] = []
        self.num_inserted = 0  # ctx.tokens[:num_inserted] are counted
        self.num_prompt_tokens = 0

    def begin(self, prompt_ids: list[int], target) -> None:
        self._reset()
        self.num_prompt_tokens = len(prompt_ids)
        if self.shared is not None:
            if self.shared.trie.num_nodes > self.global_max_nodes:
                self.shared.trie = NgramTrie(self.trie_depth)  # running sequences keep the old one
            self.global_trie = self.shared.trie
        self._sync(list(prompt_ids))

    def _sync(self, tokens: list[int]) -> None:
        """Count the tokens committed since the last call (prompt + output locally, output globally)."""
        new = tokens[self.num_inserted :]
        if not new:
            return
        self.local_active = self.local.extend(self.local_active, new)
        if self.global_trie is not None:
            output_start = max(self.num_inserted, self.num_prompt_tokens)
            self.global_active = self.global_trie.extend(self.global_active, tokens[output_start:])
        self.num_inserted = len(tokens)

    def on_verified(self, result, ctx: DraftContext) -> None:
        self._sync(ctx.tokens)

    def plan(self, tokens: list[int], budget: int) -> DraftPlan:
        """The best draft for context `tokens` (counts must already include them)."""
        best = DraftPlan()
        for trie in (self.local, self.global_trie):
            if trie is None:
                continue
            start = trie.longest_match(tokens, self.max_match, self.min_match)
            plan = expand_draft(start, budget, self.max_depth, self.max_children, self.min_prob, self.tree)
            if plan.score > best.score:
                best = plan
        return best

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        self._sync(ctx.tokens)
        return self.plan(ctx.tokens, budget).to_draft()
