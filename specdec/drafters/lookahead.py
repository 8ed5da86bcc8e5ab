"""Lookahead decoding (Fu et al. 2024): Jacobi iteration window + n-gram pool, no draft model.

Lookahead keeps a 2-D window of guessed future tokens: W columns x (N - 1) levels. Level j,
column i is a guess for the token at depth i + j after the root (the last committed token).
Every step the window is sent through the target together with the verification candidates;
the target's argmax at the last level of each column is one more Jacobi iteration of that
column, and the diagonal it completes is an n-gram the target "believes" in:

    (level 0 [i], level 1 [i], ..., level N-2 [i], new [i])     (root instead of level 0 [0])

Those n-grams go into a pool keyed by their first token. The verification branch proposes the
pool's continuations (at most G) of the root token.

How this fits the one-forward-per-step loop: both branches are ONE Draft tree. Column i of the
lookahead branch is the path root -> level0[1] -> ... -> level0[i] -> level1[i] -> ... ->
level{N-2}[i] (the trunk level0[1..W-1] is shared), so a node's depth is exactly i + j, its
position in the window. Verification candidates and window paths are merged into one token
trie (identical prefixes have identical contexts, so sharing a node is exact). The verifier
treats every node as a candidate, which is fine: a window token that happens to be right is
accepted like any other deterministic proposal. Verification candidates come first in the
trie, so the verifier tries them first.

Where the window logits come from: the loop's verify forward already computed the target's
logits at every node, and hands them over as `ctx.all_node_logits` ([N + 1, V], raw logits for
the root and every node of the last draft) before `on_verified`, because this drafter sets
`wants_node_logits = True`. The window costs no forward of its own.

Lossless at any temperature: every proposal is deterministic given the history. The window is
initialised from the prompt with the drafter's own seeded RNG (`init_seed`), updated only with
argmaxes of target logits computed in earlier steps, and the pool holds n-grams of committed
tokens and of those argmaxes; nothing reads the sampling generator or the current step's target
output. So the proposal is a fixed function of the past when the verifier draws its randomness,
`draft_probs` is None, and the deterministic-proposal rule (accept x with p(x), else continue
with p minus x renormalised) emits tokens distributed exactly as the target's.

Options (constructor keywords): `window_size` W (columns), `ngram_size` N (n-gram length; the
window has N - 1 levels; N = 2 is plain Jacobi decoding), `guess_set_size` G (pool n-grams per
first token, all verified each step), `context_ngrams` (also add n-grams of the prompt and the
output to the pool, prompt-lookup style), `init_seed`. Full draft size: (G + W) * (N - 1) - 1
nodes. CPU defaults are small (W=3, N=3, G=2: at most 9 nodes) because on CPU a verify forward
over k tokens costs ~2-3x a 1-token step; on a GPU use larger windows (the paper: W=15, N=5, G=15).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..checks import check_int
from ..draft import Draft
from .base import DraftContext, DraftCost, Drafter, register_drafter

MAX_WINDOW_SIZE = 64
MAX_NGRAM_SIZE = 16
MAX_GUESS_SET_SIZE = 64


class _TokenTrie:
    """Builds a Draft by merging token paths from the root, within a node budget."""

    def __init__(self, budget: int):
        self.budget = budget
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.child_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node

    def missing_nodes(self, path: list[int]) -> int:
        """How many new nodes adding `path` would create."""
        node = -1
        for depth, token in enumerate(path):
            node = self.child_of.get((node, token), None)
            if node is None:
                return len(path) - depth
        return 0

    def add(self, path: list[int]) -> list[int]:
        """Insert `path` (the caller checked it fits); returns its node indices, root side first."""
        nodes, node = [], -1
        for token in path:
            child = self.child_of.get((node, token))
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.child_of[(node, token)] = child
            nodes.append(child)
            node = child
        return nodes

    @property
    def room(self) -> int:
        return self.budget - len(self.tokens)

    def draft(self) -> Draft:
        return Draft(torch.tensor(self.tokens, dtype=torch.long), torch.tensor(self.parents, dtype=torch.long), None)


@dataclass
class _Proposal:
    """What on_verified needs to know about the last proposal."""

    draft: Draft
    num_committed: int  # len(ctx.tokens) when proposed (the root is the last of them)
    column_output_nodes: list[int | None]  # node whose logits extend column i (-1 = root), None = not sent


@register_drafter
class LookaheadDrafter(Drafter):
    """Lookahead decoding: Jacobi window (lookahead branch) + n-gram pool (verification branch)."""

    name = "lookahead"
    cost = DraftCost(trees=True)
    wants_node_logits = True  # asks the loop for ctx.all_node_logits (see module docstring)

    def __init__(
        self,
        target=None,
        window_size: int = 3,
        ngram_size: int = 3,
        guess_set_size: int = 2,
        context_ngrams: bool = True,
        init_seed: int = 0,
    ):
        self.window_size = check_int("window_size (lookahead window columns W)", window_size, 1, MAX_WINDOW_SIZE)
        self.ngram_size = check_int("ngram_size (n-gram length N)", ngram_size, 2, MAX_NGRAM_SIZE)
        self.guess_set_size = check_int("guess_set_size (n-grams verified per step G)", guess_set_size, 0, MAX_GUESS_SET_SIZE)
        if not isinstance(context_ngrams, bool):
            raise ValueError(f"context_ngrams must be True or False, got {context_ngrams!r}")
        if isinstance(init_seed, bool) or not isinstance(init_seed, int):
            raise ValueError(f"init_seed must be an integer, got {init_seed!r}")
        self.context_ngrams = context_ngrams
        self.init_seed = init_seed
        self.target = target
        if self.max_draft_nodes < 1:
            raise ValueError(
                f"window_size={window_size}, ngram_size={ngram_size}, guess_set_size={guess_set_size} "
                "propose no draft nodes: use ngram_size >= 3, window_size >= 2 or guess_set_size >= 1"
            )
        self.cost = DraftCost(block=self.max_draft_nodes, trees=True)

    @property
    def max_draft_nodes(self) -> int:
        """Window (W * (N - 1) - 1 nodes: slot (0, 0) is the root) plus G candidates of N - 1 tokens."""
        return (self.window_size + self.guess_set_size) * (self.ngram_size - 1) - 1

    # ------------------------------------------------------------------ per-sequence state
    def begin(self, prompt_ids: list[int], target) -> None:
        if not prompt_ids:
            raise ValueError("the lookahead drafter needs a non-empty prompt")
        rng = random.Random(self.init_seed)  # the drafter's own RNG: never the sampling generator
        # levels[j][i]: guess for the token at depth i + j; levels[0][0] is never used (the root)
        self.levels = [
            [prompt_ids[rng.randrange(len(prompt_ids))] for _ in range(self.window_size)]
            for _ in range(self.ngram_size - 1)
        ]
        self.pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> continuations, newest first
        self.context_ngrams_done = 0  # n-grams of committed tokens already pooled (by start index)
        self.proposal: _Proposal | None = None
        if self.context_ngrams:
            self._pool_context_ngrams(prompt_ids)

    def _add_to_pool(self, first: int, continuation: tuple[int, ...]) -> None:
        """Most recent first, no duplicates, at most G continuations per first token."""
        if self.guess_set_size == 0:
            return
        entries = self.pool.setdefault(first, [])
        if continuation in entries:
            entries.remove(continuation)
        entries.insert(0, continuation)
        del entries[self.guess_set_size :]

    def _pool_context_ngrams(self, tokens: list[int]) -> None:
        """Pool every not-yet-pooled n-gram of the committed tokens."""
        last_start = len(tokens) - self.ngram_size
        for start in range(self.context_ngrams_done, last_start + 1):
            self._add_to_pool(tokens[start], tuple(tokens[start + 1 : start + self.ngram_size]))
        self.context_ngrams_done = max(self.context_ngrams_done, last_start + 1)

    # ------------------------------------------------------------------ propose
    def _column_path(self, column: int) -> list[int]:
        """Tokens from the root down to column `column`'s last level: level0[1..i], level1..N-2[i]."""
        trunk = self.levels[0][1 : column + 1]
        return trunk + [self.levels[level][column] for level in range(1, self.ngram_size - 1)]

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        root = ctx.tokens[-1]
        trie = _TokenTrie(budget)
        # verification branch first: the verifier tries siblings in node order
        for continuation in self.pool.get(root, [])[: self.guess_set_size]:
            fitting = list(continuation)
            while fitting and trie.missing_nodes(fitting) > trie.room:
                fitting.pop()  # a prefix of a deterministic guess is still a valid guess
            trie.add(fitting)
        # lookahead branch: whole columns only (a cut column has no last level to extend)
        output_nodes: list[int | None] = []
        for column in range(self.window_size):
            path = self._column_path(column)
            if trie.missing_nodes(path) > trie.room:
                output_nodes.append(None)
                continue
            nodes = trie.add(path)
            output_nodes.append(nodes[-1] if nodes else -1)
        draft = trie.draft()
        self.proposal = _Proposal(draft, len(ctx.tokens), output_nodes)
        return draft

    # ------------------------------------------------------------------ learn
    def on_verified(self, result, ctx: DraftContext) -> None:
        proposal, self.proposal = self.proposal, None
        if self.context_ngrams:
            self._pool_context_ngrams(ctx.tokens)
        if proposal is None:  # the prefill, or a step the loop drafted nothing for
            return
        node_logits = self._node_logits(proposal, result, ctx)  # [n + 1, V]
        root = ctx.tokens[proposal.num_committed - 1]
        fresh: list[int | None] = []
        for column, node in enumerate(proposal.column_output_nodes):
            if node is None:
                fresh.append(None)
                continue
            token = int(node_logits[node + 1].argmax())
            fresh.append(token)
            first = root if column == 0 else self.levels[0][column]
            continuation = [self.levels[level][column] for level in range(1, self.ngram_size - 1)] + [token]
            self._add_to_pool(first, tuple(continuation))
        # one Jacobi iteration: levels move up, the new last level is the target's argmax
        # (columns that were not sent keep recycling their level-0 guess)
        self._shift_levels([token if token is not None else self.levels[0][i] for i, token in enumerate(fresh)])
        # every further committed token moves the root once more: shift again, recycling level 0
        for _ in range(len(result.tokens) - 1):
            self._shift_levels(list(self.levels[0]))

    def _shift_levels(self, new_last_level: list[int]) -> None:
        self.levels = self.levels[1:] + [new_last_level]

    # ------------------------------------------------------------------ window logits
    def _node_logits(self, proposal: _Proposal, result, ctx: DraftContext) -> torch.Tensor:
        """Target logits [n + 1, V] at the root and every node of the proposal (from the loop)."""
        supplied = ctx.all_node_logits
        if supplied is None or supplied.shape[0] != len(proposal.draft) + 1:
            raise RuntimeError(
                "the lookahead drafter needs the verify forward's logits at every draft node in "
                "ctx.all_node_logits (wants_node_logits = True); this loop did not supply them"
            )
        return supplied
