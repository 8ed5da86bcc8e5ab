"""`rest`: retrieval-based speculative decoding (REST) from a suffix-array datastore.

Each step finds the longest suffix of the context (max_suffix down to min_suffix tokens) that
occurs in the datastore (binary search on the suffix array; since every suffix of an occurring
pattern also occurs, the longest length is itself found by binary search over lengths), takes
the continuations of up to `max_candidates` of its occurrences (spread evenly over the
suffix-array range, which is sorted by continuation, so frequent continuations keep their
share), counts them in a small trie and proposes the most frequent prefixes as a tree (or the
most frequent chain with tree=False) within the node budget — see suffix.expand_draft.

Build the datastore with `specdec datastore build FILES... -o DIR --model NAME` (the target's
tokenizer; a mismatch is refused). Proposals are deterministic (draft_probs=None).
"""

from __future__ import annotations

import numpy as np

from ..datastore import SEPARATOR, Datastore
from ..draft import Draft
from .base import DraftContext, DraftCost, Drafter, register_drafter
from ..checks import check_int
from .pld import check_ngram_range
from .suffix import MAX_DEPTH_LIMIT, TrieNode, expand_draft


@register_drafter
class RestDrafter(Drafter):
    """REST: draft trees from continuations of the context's longest suffix found in a datastore.

    Options:
        datastore: path of a datastore directory (required).
        max_suffix / min_suffix: longest / shortest context suffix searched (longest wins).
            min_suffix defaults to 2: one-token matches are everywhere and predict poorly.
        max_candidates: occurrences whose continuations are counted per step.
        max_depth / max_children / min_prob: shape of the draft tree (see the suffix drafter).
        tree: False = propose only the most frequent chain.
        gamma: draft nodes per step when no cost model picks it.
    """

    name = "rest"
    retrieval_source = True
    cost = DraftCost(block=8, trees=True)

    def __init__(
        self,
        target=None,
        datastore: str = "",
        max_suffix: int = 16,
        min_suffix: int = 2,
        max_candidates: int = 128,
        max_depth: int = 6,
        max_children: int = 4,
        min_prob: float = 0.05,
        tree: bool = True,
        gamma: int = 8,
    ):
        if not datastore:
            raise ValueError("the rest drafter needs datastore=DIR (build one with `specdec datastore build`)")
        self.store = Datastore.open(datastore)
        check_ngram_range("min_suffix", min_suffix, "max_suffix", max_suffix, self.store.sorted_depth)
        self.max_suffix, self.min_suffix = max_suffix, min_suffix
        self.max_candidates = check_int("max_candidates", max_candidates, 1, 100_000)
        self.max_depth = check_int("max_depth", max_depth, 1, MAX_DEPTH_LIMIT)
        self.max_children = check_int("max_children", max_children, 1, 64)
        if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be a number in [0, 1], got {min_prob!r}")
        self.min_prob = float(min_prob)
        if not isinstance(tree, bool):
            raise ValueError(f"tree must be a boolean, got {tree!r}")
        self.tree = tree
        self.cost = DraftCost(block=check_int("gamma", gamma, 1, 1024), trees=tree)
        self._checked_target_id: int | None = None
        if target is not None:
            self._check_target(target)

    def _check_target(self, target) -> None:
        """The datastore's token ids mean something only for the tokenizer it was built with."""
        if self._checked_target_id == id(target):
            return
        self.store.check_tokenizer(target.tokenizer, getattr(target, "name", "the target"))
        vocab_size = getattr(target, "vocab_size", None)
        if vocab_size is not None and self.store.manifest["tokenizer"]["vocab_size"] > vocab_size:
            raise ValueError(
                f"datastore {self.store.path} has a vocabulary of {self.store.manifest['tokenizer']['vocab_size']} "
                f"tokens but the target's output layer has only {vocab_size}"
            )
        self._checked_target_id = id(target)

    def begin(self, prompt_ids: list[int], target) -> None:
        if target is not None:
            self._check_target(target)

    def longest_match(self, tokens: list[int]) -> tuple[int, int, int]:
        """(length, lo, hi): the longest context suffix in the datastore and its suffix-array range.

        length 0 when not even min_suffix tokens match. Occurrence is monotone in the length (a
        suffix of an occurring pattern occurs), so the longest length is a binary search."""
        best = (0, 0, 0)
        low, high = self.min_suffix, min(self.max_suffix, len(tokens))
        while low <= high:
            length = (low + high) // 2
            lo, hi = self.store.find(tokens[-length:])
            if hi > lo:
                best, low = (length, lo, hi), length + 1
            else:
                high = length - 1
        return best

    def candidate_trie(self, tokens: list[int]) -> TrieNode | None:
        """A trie counting the continuations (up to max_depth tokens) of the best match's occurrences."""
        length, lo, hi = self.longest_match(tokens)
        if length == 0:
            return None
        num_found = hi - lo
        take = min(num_found, self.max_candidates)
        ranks = lo + (np.arange(take, dtype=np.int64) * num_found) // take  # evenly over the range
        starts = np.asarray(self.store.suffix_array[ranks], dtype=np.int64) + length
        continuations = self.store.continuations(starts, self.max_depth)  # [take, max_depth]
        root = TrieNode()
        for row in continuations.tolist():
            node = root
            for token in row:
                if token == SEPARATOR:
                    break
                node, _ = node.add_child(token)
        return root

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        root = self.candidate_trie(ctx.tokens)
        plan = expand_draft(root, budget, self.max_depth, self.max_children, self.min_prob, self.tree)
        return plan.to_draft()
