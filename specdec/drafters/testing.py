"""Drafters for testing the core: `oracle` (always right), `random` (almost always wrong) and
`tempered` (often right, with confidences). Registered unlisted: tests build them by name
(`make_drafter`, `--drafter`), `specdec drafters` does not offer them to users.

`oracle` proposes the target's own greedy continuation, so under greedy decoding every draft
token is accepted and tau must equal budget + 1. `random` proposes uniformly random tokens
(as a chain or a tree, with their true proposal probabilities), so the output must still equal
plain decoding: the lossless core, not the drafter, guarantees the result. `tempered` samples a
chain from the target itself at another temperature (exact q) and attaches crafted confidences
that depend on the drafted tokens, to test the confidence scheduler (specdec.schedule) until a
trained drafter provides real ones.
"""

from __future__ import annotations

import torch

from ..draft import Draft
from .base import DraftContext, DraftCost, Drafter, register_drafter


@register_drafter(listed=False)
class OracleDrafter(Drafter):
    name = "oracle"

    def __init__(self, target=None, gamma: int = 4):
        if target is None:
            raise ValueError("the oracle drafter needs the target")
        self.target, self.cost = target, DraftCost(block=gamma)
        self.cache = None

    def begin(self, prompt_ids, target) -> None:
        self.cache = self.target.new_cache(1, 4096)
        self.fed: list[int] = []  # tokens whose K/V sit in self.cache

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        pending = self._rewind(ctx)
        proposal = []
        for _ in range(budget):
            pending = [int(self._next_logits(pending).argmax())]
            proposal += pending
        return Draft.chain(torch.tensor(proposal, dtype=torch.long))

    def _rewind(self, ctx: DraftContext) -> list[int]:
        """Drop cached tokens that are no longer committed; returns the committed tokens to feed."""
        common = 0
        while common < min(len(self.fed), len(ctx.tokens) - 1) and self.fed[common] == ctx.tokens[common]:
            common += 1
        self.cache.truncate(common)
        self.fed = self.fed[:common]
        return ctx.tokens[common:]

    def _next_logits(self, pending: list[int]) -> torch.Tensor:
        """Feed `pending` through the target; its logits [V] for the token after them."""
        logits, _ = self.target.forward(
            torch.tensor([pending]), torch.arange(len(self.fed), len(self.fed) + len(pending))[None], self.cache
        )
        self.fed += pending
        return logits[0, -1]


@register_drafter(listed=False)
class TemperedDrafter(OracleDrafter):
    """A chain sampled from the target's own distribution at `draft_temperature` (q exact, so
    acceptance is high but not certain), with confidences crafted from the drafted tokens:
    position j's confidence is `high` when the token before it (the root for j = 0) is even,
    else `low`. A confidence depends only on tokens drawn before its position, as
    Draft.confidences requires, yet which prefix gets verified depends on what was drafted."""

    name = "tempered"

    def __init__(self, target=None, gamma: int = 4, draft_temperature: float = 1.5, high: float = 0.9,
                 low: float = 0.2):
        super().__init__(target, gamma)
        if not draft_temperature > 0:
            raise ValueError(f"draft_temperature must be > 0, got {draft_temperature}")
        for name, value in (("high", high), ("low", low)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value}")
        self.draft_temperature, self.high, self.low = draft_temperature, high, low
        self.cost = DraftCost(block=gamma, scored=True)

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        pending = self._rewind(ctx)
        tokens, rows, confidences = [], [], []
        for _ in range(budget):
            confidences.append(self.high if pending[-1] % 2 == 0 else self.low)  # before the token is drawn
            q = torch.softmax(self._next_logits(pending).float() / self.draft_temperature, dim=-1)  # [V]
            pending = [int(torch.multinomial(q, 1, generator=ctx.generator))]  # the sequence's seeded stream
            tokens += pending
            rows.append(q)
        if not tokens:
            return Draft.empty()
        return Draft.chain(torch.tensor(tokens, dtype=torch.long), torch.stack(rows), confidences)


@register_drafter(listed=False)
class RandomDrafter(Drafter):
    name = "random"

    def __init__(self, target=None, gamma: int = 4, tree: bool = False, branching: int = 2, seed: int = 0, vocab_size=None):
        self.vocab_size = vocab_size or (target.vocab_size if target is not None else None)
        if not self.vocab_size:
            raise ValueError("the random drafter needs the target (or vocab_size)")
        self.tree, self.branching = tree, branching
        self.cost = DraftCost(block=gamma, trees=tree)
        self.seed = seed

    def begin(self, prompt_ids, target) -> None:
        self.rng = torch.Generator().manual_seed(self.seed)

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        parents: list[int] = []
        for node in range(budget):  # chain, or a tree where each node has `branching` children
            parents.append(node - 1 if not self.tree else (node // self.branching) - 1)
        tokens = torch.randint(0, self.vocab_size, (budget,), generator=self.rng)
        if self.tree:
            return Draft(tokens, torch.tensor(parents, dtype=torch.long), None)
        # a real stochastic proposal: q is uniform, and the token was drawn from it
        draft_probs = torch.full((budget, self.vocab_size), 1.0 / self.vocab_size)
        return Draft.chain(tokens, draft_probs)
