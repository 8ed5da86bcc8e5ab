"""`pld`: prompt lookup decoding — copy the continuation of an earlier occurrence of the recent n-gram.

The last n committed tokens (n = max_ngram down to min_ngram; longer matches are more specific,
so they win) are looked up among earlier positions of prompt + output; the most recent earlier
occurrence that has a continuation wins, and the tokens that followed it are proposed as a chain.

The lookup is an index `n-gram -> start of its continuation` (the most recent one), updated
incrementally as tokens are committed, so each step costs O(max_ngram) dict lookups instead of
a scan over the whole context.

When the copied continuation runs into the present (the match ends less than `gamma` tokens
before the end, as in a repetition loop "a b c a b c"), the copy continues with the tokens it
has just proposed, like an overlapping LZ77 copy: a repeating pattern keeps repeating.

Proposals are deterministic (draft_probs=None), so the output is exactly the target's.
"""

from __future__ import annotations

from ..checks import check_int
from ..draft import Draft
from .base import DraftContext, DraftCost, Drafter, register_drafter

MAX_NGRAM_LIMIT = 16


def check_ngram_range(low_name: str, low: int, high_name: str, high: int, limit: int) -> None:
    """1 <= low <= high <= limit, with a message naming both options."""
    check_int(low_name, low, 1, limit)
    check_int(high_name, high, 1, limit)
    if low > high:
        raise ValueError(f"{low_name} ({low}) must be <= {high_name} ({high}); both must be in [1, {limit}]")


@register_drafter
class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding (n-gram copy from prompt + output), a chain of up to `budget` tokens.

    Options:
        max_ngram: longest suffix n-gram tried first (more specific matches first).
        min_ngram: shortest n-gram accepted; 2 by default because on CPU a draft that misses
            still doubles the step cost, and single-token matches ("the", ",") miss often.
        gamma: draft length per step when no cost model picks it.
    """

    name = "pld"
    retrieval_source = True
    cost = DraftCost(block=5)

    def __init__(self, target=None, max_ngram: int = 4, min_ngram: int = 2, gamma: int = 5):
        check_ngram_range("min_ngram", min_ngram, "max_ngram", max_ngram, MAX_NGRAM_LIMIT)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.cost = DraftCost(block=check_int("gamma", gamma, 1, 256))
        self._reset()

    def _reset(self) -> None:
        # n-gram tuple -> index of the token that followed its most recent occurrence.
        # Fresh objects (never .clear()): for_sequence() copies share attributes until begin().
        self.continuation_of: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # tokens[:num_indexed] have had every n-gram ending before them indexed
        self.indexed_prefix_last: int | None = None  # tokens[num_indexed - 1], to detect a new sequence

    def begin(self, prompt_ids: list[int], target) -> None:
        self._reset()
        self._index(list(prompt_ids))

    def _index(self, tokens: list[int]) -> None:
        """Register, for every new position `end`, the n-grams that end just before it -> end."""
        if self.num_indexed > len(tokens) or (
            self.num_indexed and tokens[self.num_indexed - 1] != self.indexed_prefix_last
        ):
            self._reset()  # not an extension of what we indexed: start over
        for end in range(max(self.num_indexed, 1), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.continuation_of[tuple(tokens[end - n : end])] = end
        self.num_indexed = len(tokens)
        self.indexed_prefix_last = tokens[-1] if tokens else None

    def on_verified(self, result, ctx: DraftContext) -> None:
        self._index(ctx.tokens)

    def find_continuation(self, tokens: list[int]) -> int | None:
        """Index where the copy starts: after the most recent earlier occurrence of the longest
        matching suffix n-gram of `tokens` (None when no n-gram of allowed size recurs)."""
        self._index(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = self.continuation_of.get(tuple(tokens[-n:]))
            if start is not None:
                return start
        return None

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        tokens = ctx.tokens
        start = self.find_continuation(tokens)
        if start is None or budget <= 0:
            return Draft.empty()
        proposal: list[int] = []
        source = tokens[start : start + budget]
        distance = len(tokens) - start  # how far back the copy source lies (== len(source) when short)
        for offset in range(budget):
            proposal.append(source[offset] if offset < len(source) else proposal[offset - distance])
        return Draft.chain(proposal)


@register_drafter
class BigramDrafter(PromptLookupDrafter):
    """The token that followed the root token's most recent earlier occurrence (prompt + output), one node.

    pld's fallback where no longer n-gram recurs, kept a drafter of its own so a hybrid tracks its
    acceptance apart from pld's longer matches (a single token after a single token is right far
    less often, and pld's depth estimates would sink with it). Under greedy decoding this is what
    Token Recycling's table holds for the committed tokens: the target's top-1 after each one.

    Options:
        gamma: draft length per step when no cost model picks it (the copy continues past one token).
    """

    name = "bigram"

    def __init__(self, target=None, gamma: int = 1):
        super().__init__(target, max_ngram=1, min_ngram=1, gamma=gamma)
