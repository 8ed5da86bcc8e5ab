"""Drafters for testing the core: `oracle` (always right) and `random` (almost always wrong).

`oracle` proposes the target's own greedy continuation, so under greedy decoding every draft
token is accepted and tau must equal budget + 1. `random` proposes uniformly random tokens
(as a chain or a tree, with their true proposal probabilities), so the output must still equal
plain decoding: the lossless core, not the drafter, guarantees the result.
"""

from __future__ import annotations

import torch

from ..draft import Draft
from .base import DraftContext, Drafter, register_drafter


@register_drafter
class OracleDrafter(Drafter):
    name = "oracle"

    def __init__(self, target=None, gamma: int = 4):
        if target is None:
            raise ValueError("the oracle drafter needs the target")
        self.target, self.default_budget = target, gamma
        self.cache = None

    def begin(self, prompt_ids, target) -> None:
        self.cache = self.target.new_cache(1, 4096)
        self.fed: list[int] = []  # tokens whose K/V sit in self.cache

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        common = 0
        while common < min(len(self.fed), len(ctx.tokens) - 1) and self.fed[common] == ctx.tokens[common]:
            common += 1
        self.cache.truncate(common)
        self.fed = self.fed[:common]
        pending = ctx.tokens[common:]
        proposal = []
        for _ in range(budget):
            logits, _ = self.target.forward(
                torch.tensor([pending]), torch.arange(len(self.fed), len(self.fed) + len(pending))[None], self.cache
            )
            self.fed += pending
            pending = [int(logits[0, -1].argmax())]
            proposal += pending
        return Draft.chain(torch.tensor(proposal, dtype=torch.long))


@register_drafter
class RandomDrafter(Drafter):
    name = "random"

    def __init__(self, target=None, gamma: int = 4, tree: bool = False, branching: int = 2, seed: int = 0, vocab_size=None):
        self.vocab_size = vocab_size or (target.vocab_size if target is not None else None)
        if not self.vocab_size:
            raise ValueError("the random drafter needs the target (or vocab_size)")
        self.default_budget, self.tree, self.branching = gamma, tree, branching
        self.makes_trees = tree
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
