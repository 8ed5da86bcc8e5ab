"""Multi-token-prediction drafting (`mtp`) with trained heads on the frozen target.

The checkpoint decides the flavour (specdec.heads):

* `mtp-parallel` (Gloeckle et al.): K transformer-block heads on one shared trunk state (the input
  of the target's last block). Each head keeps a small KV cache over the committed positions, fed
  with the trunk rows the verify forward returns; head k's next-token distribution is draft depth k.
  Proposal: a chain of the K heads' tokens, or with `tree=true` a Medusa-style static top-k tree.
* `mtp-sequential` (DeepSeek-V3 style; run by the EAGLE drafters' ChainRunner): one module [RMSNorm(hidden); RMSNorm(embed(next token))] ->
  linear -> transformer block -> target's final norm + LM head, chained: depth 1 reads the target's
  last hidden state and the root, depth d reads depth d - 1's output and draft token d - 1. Its KV
  cache holds depth-1 keys of the committed positions (computed once, when they are verified) and,
  while drafting, the chain's own keys (dropped after the proposal) — exactly as it was trained.

Lossless either way:
  * temperature 0, or `sample=false`: each draft token is the argmax of its head, a deterministic
    proposal (draft_probs=None; the core accepts x with probability p(x)).
  * temperature > 0 with `sample=true` (default): each token is SAMPLED from q = the head's
    distribution warped with the request's temperature / top-k / top-p, using the sequence's
    generator, and q is passed as draft_probs (rejection sampling min(1, p/q)). The chain length is
    the step's budget, fixed before drafting (non-anticipating). Parallel heads sample each depth
    independently, so q_k is exactly the conditional distribution of token k.
  Trees (parallel flavour only) are deterministic top-k proposals at every temperature.
"""

from __future__ import annotations

import torch

from ..checks import check_int
from ..draft import Draft
from ..heads import (DraftVocab, FrozenTargetParts, MTPParallelHeads, MTPSequentialModule, draft_linears, grow_cache,
                     load_checkpoint)
from .base import DraftContext, DraftCost, Drafter, register_drafter
from .eagle import ChainRunner, Choose, chain_chooser, new_hidden_rows
from .medusa import DEFAULT_DRAFT_VOCAB, DEFAULT_TREE_NODES, build_choice_tree, draft_from_candidates, heads_cost_tokens, top_candidates

_CACHE_HEADROOM = 64


class _ParallelRunner:
    """Per-sequence state of MTP parallel heads: their KV cache and the newest row's features."""

    def __init__(self, heads: MTPParallelHeads, vocab: DraftVocab, target, prompt_len: int):
        self.heads, self.parts = heads, vocab.parts
        self.cache = heads.new_cache(prompt_len + _CACHE_HEADROOM, target.dtype, target.device)
        self.features: torch.Tensor | None = None  # [K, H] head outputs at the newest cached position

    def absorb(self, ctx: DraftContext) -> None:
        cached = int(self.cache.lengths[0])
        rows, start = new_hidden_rows(ctx, self.heads.input_layers, cached)
        if rows is None:
            return
        self.cache = grow_cache(self.cache, start + rows.shape[0] + _CACHE_HEADROOM)
        positions = torch.arange(start, start + rows.shape[0])[None]  # [1, n]
        self.features = self.heads.absorb(rows[None], positions, self.cache)

    def ready(self) -> bool:
        return self.features is not None

    def logits(self, depth: int) -> torch.Tensor:
        return self.heads.project(self.features[:depth], self.parts).float()  # [depth, V'] (draft vocabulary)

    def chain(self, length: int, choose: Choose):
        logits = self.logits(min(length, self.heads.num_positions))
        return [choose(row) for row in logits]


_RUNNERS = {MTPParallelHeads: _ParallelRunner, MTPSequentialModule: ChainRunner}


@register_drafter
class MTPDrafter(Drafter):
    """Trained multi-token-prediction heads (parallel or sequential, chosen by the checkpoint).

    checkpoint: directory written by `specdec train mtp` (for this very target).
    gamma: chain length (default: the trained head positions / depth; parallel heads cap it at K).
    sample: at temperature > 0, sample drafts from the heads (with draft_probs) instead of argmax.
    tree / choices / tree_nodes: parallel heads only — a Medusa-style static top-k tree.
    draft_vocab: propose only the checkpoint's N most frequent label tokens (computing just their
        LM-head rows); 0 = the full vocabulary. Lossless either way.
    draft_weights: the drafter's own linears while drafting: int8 (default: weight-only int8 in the CPU
        kernel, a quarter of fp32's bytes per draft forward) or fp32 (specdec.heads.draft_linears).
    """

    name = "mtp"

    def __init__(self, target=None, checkpoint: str | None = None, gamma: int | None = None, sample: bool = True,
                 tree: bool = False, choices: str | None = None, tree_nodes: int = DEFAULT_TREE_NODES,
                 draft_vocab: int = DEFAULT_DRAFT_VOCAB, draft_weights: str = "int8"):
        if target is None:
            raise ValueError("the mtp drafter needs the target (its LM head and hidden states)")
        if not checkpoint:
            raise ValueError("the mtp drafter needs checkpoint=DIR: train heads with `specdec train mtp`")
        heads, config = load_checkpoint(checkpoint, target, drafter=self.name)
        self._setup(target, heads, config, gamma, sample, tree, choices, tree_nodes, draft_vocab, draft_weights)

    @classmethod
    def from_heads(cls, target, heads, rank_acc=None, gamma: int | None = None, sample: bool = True, tree: bool = False,
                   choices=None, tree_nodes: int = DEFAULT_TREE_NODES, draft_vocab_ids: list[int] | None = None,
                   draft_vocab: int = DEFAULT_DRAFT_VOCAB, draft_weights: str = "int8") -> MTPDrafter:
        """A drafter around in-memory heads (e.g. right after training), without a checkpoint."""
        drafter = cls.__new__(cls)
        heads = heads.to(device=target.device, dtype=target.dtype).eval()
        config = {"eval": {"rank_acc": rank_acc}, "draft_vocab": {"ids": draft_vocab_ids}}
        drafter._setup(target, heads, config, gamma, sample, tree, choices, tree_nodes, draft_vocab, draft_weights)
        return drafter

    def _setup(self, target, heads, config, gamma, sample, tree, choices, tree_nodes, draft_vocab, draft_weights) -> None:
        if type(heads) not in _RUNNERS:
            raise ValueError(f"the mtp drafter runs {[c.kind for c in _RUNNERS]} heads, got {type(heads).__name__}")
        for name, flag in (("sample", sample), ("tree", tree)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be true or false, got {flag!r}")
        if tree and not isinstance(heads, MTPParallelHeads):
            raise ValueError(f"tree=true needs parallel MTP heads; this checkpoint holds {heads.kind!r} (a chain drafter)")
        limit = heads.num_positions if isinstance(heads, MTPParallelHeads) else 64
        gamma = heads.num_positions if gamma is None else gamma
        check_int(f"gamma for {heads.kind} heads", gamma, 1, limit)
        self.target, self.heads, self.sample = target, heads, sample
        self.vocab = DraftVocab.from_config(FrozenTargetParts.from_target(target), config, draft_vocab)
        self.linear_backend = draft_linears(heads, self.vocab, draft_weights)
        self.hidden_layers = (heads.input_layer,)
        rank_acc = config.get("eval", {}).get("rank_acc")
        self.tree = build_choice_tree(heads.num_positions, rank_acc, choices, tree_nodes, self.vocab.rows) if tree else None
        per_token = heads_cost_tokens(heads, target, self.vocab, weights_shared_by_depths=isinstance(heads, MTPSequentialModule))
        self.cost = DraftCost(block=len(self.tree) if tree else gamma, per_token=per_token, trees=tree)
        self._max_chain = limit
        self.runner = None

    def begin(self, prompt_ids, target) -> None:
        self.runner = _RUNNERS[type(self.heads)](self.heads, self.vocab, self.target, len(prompt_ids))

    @torch.inference_mode()
    def on_verified(self, result, ctx: DraftContext) -> None:
        self.runner.absorb(ctx)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        if self.runner is None or not self.runner.ready() or budget <= 0:
            return Draft.empty()
        if self.tree is not None:
            template = self.tree.for_budget(budget)
            logits = self.runner.logits(template.max_depth)  # [D, V']
            return draft_from_candidates(template, top_candidates(template, logits, self.vocab))
        picks = self.runner.chain(min(budget, self._max_chain), chain_chooser(self.vocab, ctx, self.sample))
        tokens = torch.tensor([token for token, _ in picks], dtype=torch.long)
        if picks[0][1] is None:
            return Draft.chain(tokens)
        return Draft.chain(tokens, torch.stack([q for _, q in picks]))
