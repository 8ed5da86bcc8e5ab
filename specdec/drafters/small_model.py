"""Model-based drafting: an autoregressive draft LM with its own KV cache (`small-model`).

Two pieces, shared with `layer-skip` (drafters/layer_skip.py):

* `DraftLM` — a causal LM run one token per forward over its OWN KV cache, which follows the
  committed tokens: before every proposal the cache is cut to the longest common prefix with
  `ctx.tokens` and the missing committed tokens (always including the root `ctx.tokens[-1]`) are
  fed in ONE forward, whose last row gives the first draft distribution. Rejected draft tokens
  are thereby rolled back, accepted ones are never re-fed.
* `ModelDrafter` — chain and tree drafting over a `DraftLM`:
    - chain, temperature 0: the argmax chain, a deterministic proposal (draft_probs None);
    - chain, temperature > 0: every token is SAMPLED from q = warp(draft logits) with the
      sequence's generator and its q row is returned (lossless rejection sampling);
    - tree (`ScoredTree`, shared with EAGLE): a beam over depths; at each depth the `tree_beam`
      best nodes get their `tree_topk` children from ONE draft forward under a tree attention
      mask; the `budget` best nodes overall form the tree (children never score above their
      parent nor a later sibling above an earlier one, so the best-n set is a tree). Greedy (or
      sample=false): the top-k children by cumulative draft log-probability, deterministic;
      temperature > 0: children drawn from q without replacement with exact rows, each slot
      scored before its draw (see ScoredTree for why that keeps the output exact).

`small-model` drafts with an independent smaller model that shares the target's tokenizer
(default pair: qwen2.5-coder-1.5b target, qwen2.5-coder-0.5b draft).

A context window (`context=N`) bounds what the draft model reads: its cache starts at the last N
committed tokens whenever it would otherwise feed more than N at once (a request's prompt, a long
catch-up). On a CPU a draft model's prefill is paid in full (the 0.5B reads a prompt at ~4 ms a
token, docs/performance.md: a long prompt costs it about what the 1.5B takes to decode a 64-token
answer), while its next-token guesses depend mostly on the recent tokens; every draft is verified, so the window changes speed only, never the output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..checks import check_int, check_positive_int
from ..draft import Draft, ScoredTree
from ..kv_cache import KVCache
from ..models.base import Target
from ..sampling import sample_from_probs, warp_logits_to_probs
from .base import DraftContext, DraftCost, Drafter, register_drafter

# forward(tokens [1, T], positions [1, T], cache, attn_mask [1, T, T] | None, last_only) -> logits [1, T, V_draft]
# ([1, 1, V_draft] with last_only: the last token's only; `model_logits` writes one for a Target)
DraftForward = Callable[[torch.Tensor, torch.Tensor, object, torch.Tensor | None, bool], torch.Tensor]

DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b"
_CACHE_HEADROOM = 32  # extra slots beyond prompt + one step, before the first (doubling) growth


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    limit = min(len(a), len(b))
    index = 0
    while index < limit and a[index] == b[index]:
        index += 1
    return index


def model_logits(model: Target, tokens: torch.Tensor, positions: torch.Tensor, cache, attn_mask: torch.Tensor | None,
                 last_only: bool, **kwargs) -> torch.Tensor:
    """A Target's forward as a DraftForward: logits [1, T, V] ([1, 1, V] with last_only, the LM head
    on that row alone where the model can select rows)."""
    if last_only and getattr(model, "selects_logits", False):
        kwargs["logits_at"] = torch.tensor([tokens.shape[1] - 1])
    logits, _ = model.forward(tokens, positions, cache, attn_mask=attn_mask, **kwargs)
    return logits[:, -1:] if last_only else logits


class DraftLM:
    """A causal LM used autoregressively for drafting, with its own KV cache (batch 1).

    `forward` / `new_cache(max_len)` come from the backing model (a separate small model, or the
    target's first layers). Logits come back in the TARGET's vocabulary of `vocab_size` ids:
    sliced when the draft head is larger (padding rows), -inf padded when it is smaller, and -inf
    outside `token_ids` when the forward computes only a draft vocabulary's columns.

    Cache layout: slots [0, len(tokens)) hold `tokens` = sequence[offset:offset + len(tokens)]
    (positions = slot index; rotary attention sees only distances, so starting a window at
    position 0 changes nothing within it). `window` > 0 caps how many tokens one sync feeds: past
    it the cache restarts at the last `window` committed tokens (offset > 0). Tree drafting may
    write extra node slots after them (`run_nodes`); they are dropped by `drop_nodes()` / `sync()`
    unless adopted as a chain (`adopt_nodes`).
    """

    def __init__(self, forward: DraftForward, new_cache: Callable[[int], object], vocab_size: int, capacity: int,
                 token_ids: torch.Tensor | None = None, window: int = 0):
        self._forward, self._new_cache = forward, new_cache
        self.vocab_size = vocab_size
        self.token_ids = token_ids  # [V'] the ids of the forward's logit columns (a draft vocabulary); None: all
        self.window = window  # ModelDrafter's `context`, checked there
        self.capacity = max(1, int(capacity))
        self.cache = new_cache(self.capacity)
        self.offset = 0  # sequence index of tokens[0]
        self.tokens: list[int] = []  # tokens whose K/V fill the first slots, in sequence order
        self.next_logits: torch.Tensor | None = None  # [V] after tokens[-1], when known

    @property
    def num_slots(self) -> int:
        return int(self.cache.lengths[0])

    # ------------------------------------------------------------------ cache management
    def ensure_capacity(self, needed: int) -> None:
        """Grow the cache (doubling) so it holds at least `needed` slots; call before tree slots exist."""
        if needed <= self.capacity:
            return
        self.drop_nodes()
        new_capacity = max(2 * self.capacity, needed)
        self.capacity = new_capacity
        if isinstance(self.cache, KVCache):  # the native cache allocates as it grows: raise its limit
            self.cache.max_len = new_capacity
            return
        self.cache = self._new_cache(new_capacity)
        if self.tokens:  # any other cache type: recompute the prefix in one forward
            replay, self.tokens = self.tokens, []
            self.extend(replay)

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` sequence tokens (drops tree node slots too)."""
        if num_tokens < len(self.tokens):
            self.next_logits = None
        self.tokens = self.tokens[:num_tokens]
        self.cache.truncate(num_tokens)

    def drop_nodes(self) -> None:
        """Forget tree node slots written after the sequence tokens."""
        if self.num_slots > len(self.tokens):
            self.cache.truncate(len(self.tokens))

    def keep_nodes(self, num_nodes: int) -> None:
        """Keep the first `num_nodes` tree node slots after the sequence tokens."""
        self.cache.truncate(len(self.tokens) + num_nodes)

    def adopt_nodes(self, chain_tokens: list[int], next_logits: torch.Tensor) -> None:
        """The node slots hold exactly `chain_tokens` as a plain continuation: make them sequence tokens."""
        if self.num_slots != len(self.tokens) + len(chain_tokens):
            raise RuntimeError("adopt_nodes: node slots do not match the given chain")
        self.tokens += chain_tokens
        self.next_logits = next_logits

    # ------------------------------------------------------------------ forwards
    def _run(self, tokens: Sequence[int], positions: torch.Tensor, attn_mask: torch.Tensor | None,
             last_only: bool = False) -> torch.Tensor:
        """One forward over new tokens; returns logits [T, V] in the target vocabulary ([1, V] with
        last_only: the last token's; the LM head then runs on that row alone)."""
        if self.num_slots + len(tokens) > self.capacity:
            raise RuntimeError(
                f"draft cache overflow ({self.num_slots} + {len(tokens)} > {self.capacity}); ensure_capacity() first"
            )
        token_tensor = torch.tensor([list(tokens)], dtype=torch.long)  # [1, T]
        mask = None if attn_mask is None else attn_mask[None]  # [1, T, T]
        logits = self._forward(token_tensor, positions[None], self.cache, mask, last_only)[0].float()  # [T, V_draft]
        draft_vocab = logits.shape[-1]
        if self.token_ids is not None:  # a reduced draft vocabulary: every other id gets probability 0
            full = logits.new_full((logits.shape[0], self.vocab_size), -math.inf)  # [T, V]
            full[:, self.token_ids] = logits
            return full
        if draft_vocab > self.vocab_size:  # padded draft head: the extra ids are no tokens
            logits = logits[:, : self.vocab_size]
        elif draft_vocab < self.vocab_size:  # smaller draft head: ids it lacks get probability 0
            padding = logits.new_full((logits.shape[0], self.vocab_size - draft_vocab), -math.inf)
            logits = torch.cat([logits, padding], dim=-1)
        return logits  # [T, V]

    def extend(self, new_tokens: Sequence[int]) -> torch.Tensor:
        """Append tokens to the sequence (causal) in one forward; returns the logits [V] after the
        last. Only that row goes through the LM head: a prefill of a long prompt would otherwise run
        the head (on a Qwen2.5 0.5B a quarter of a token's compute) and a [T, V] logit tensor for
        every token it feeds."""
        self.drop_nodes()
        start = len(self.tokens)
        positions = torch.arange(start, start + len(new_tokens))  # [T]
        self.next_logits = self._run(new_tokens, positions, None, last_only=True)[0]  # [V]
        self.tokens += list(new_tokens)
        return self.next_logits

    def run_nodes(self, tokens: Sequence[int], positions: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """Write tree nodes after the current slots (they see every slot before them and, among
        themselves, what attn_mask [T, T] allows); returns their logits [T, V]."""
        return self._run(tokens, positions, attn_mask)

    def _plan_sync(self, committed: Sequence[int]) -> tuple[int, int]:
        """(offset, cached tokens kept) of the next sync to `committed`: the cached tokens that are
        still its prefix, less the last (whose logits are needed); a new offset when more than the
        window would have to be fed."""
        seen = committed[self.offset:] if len(committed) > self.offset else []
        if len(self.tokens) <= len(seen) and seen[: len(self.tokens)] == self.tokens:  # the usual case, at C speed
            common = len(self.tokens)
        else:
            common = _common_prefix_length(self.tokens, seen)
        keep = min(common, len(seen) - 1)
        if not seen or (self.window and len(seen) - keep > self.window):
            return max(0, len(committed) - self.window) if self.window else 0, 0
        return self.offset, keep

    def missing(self, committed: Sequence[int]) -> int:
        """How many tokens the next sync to `committed` feeds."""
        offset, keep = self._plan_sync(committed)
        return len(committed) - offset - keep

    def sync(self, committed: list[int], extra_slots: int = 0) -> torch.Tensor:
        """Make the cache hold `committed` (its last `window` tokens or more), with room for
        `extra_slots` more (a proposal's nodes), and return the draft logits [V] after its last token.

        Cuts the cache to the longest common prefix, then feeds the missing tokens (at least the
        last one, whose logits are needed) in one forward.
        """
        if not committed:
            raise ValueError("cannot draft without committed tokens")
        self.drop_nodes()
        offset, keep = self._plan_sync(committed)
        self.ensure_capacity(len(committed) - offset + extra_slots)
        if (offset == self.offset and len(committed) - offset == len(self.tokens) and self.next_logits is not None
                and committed[offset:] == self.tokens):
            return self.next_logits  # every committed token is cached
        self.truncate(keep)
        self.offset = offset
        return self.extend(committed[offset + keep:])


class ModelDrafter(Drafter):
    """Chain / tree drafting with an autoregressive `DraftLM`; subclasses say which model runs.

    Subclasses implement `_new_draft_lm(capacity) -> DraftLM` (one per sequence, with
    `window=self.context`) and set `self.cost`'s per_token (draft cost per token in target decode
    steps). `context`: the most committed tokens the draft model reads (DraftLM's window; 0 = all).
    """

    def __init__(
        self,
        gamma: int = 4,
        tree: bool = False,
        tree_nodes: int = 8,
        tree_depth: int = 4,
        tree_topk: int = 3,
        tree_beam: int = 1,
        sample: bool = True,
        context: int = 0,
    ):
        self.gamma = check_positive_int("gamma", gamma)
        self.context = check_int("context (0 = the whole sequence)", context, 0)
        for name, flag in (("tree", tree), ("sample", sample)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be true or false, got {flag!r}")
        self.tree, self.sample = tree, sample
        self.tree_nodes = check_positive_int("tree_nodes", tree_nodes)
        self.tree_depth = check_positive_int("tree_depth", tree_depth)
        self.tree_topk = check_positive_int("tree_topk", tree_topk)
        self.tree_beam = check_positive_int("tree_beam", tree_beam)
        self.cost = DraftCost(block=tree_nodes if tree else gamma, trees=tree)
        self.lm: DraftLM | None = None

    def _new_draft_lm(self, capacity: int) -> DraftLM:
        raise NotImplementedError

    def _first_fill(self, num_tokens: int) -> int:
        """Tokens the draft model reads of a fresh sequence of `num_tokens` (its context window)."""
        return min(num_tokens, self.context) if self.context else num_tokens

    def catch_up_tokens(self, ctx: DraftContext) -> int:
        if self.lm is None:
            return self._first_fill(len(ctx.tokens))
        return self.lm.missing(ctx.tokens)  # the root is always fed

    def begin(self, prompt_ids, target) -> None:
        # a fresh cache per sequence (for_sequence copies share the model, never the cache)
        self.lm = self._new_draft_lm(self._first_fill(len(prompt_ids)) + self._step_slots(self.cost.block) + _CACHE_HEADROOM)

    def _step_slots(self, budget: int) -> int:
        """Cache slots one proposal may write beyond the committed tokens."""
        if not self.tree:
            return budget
        # every fed node is a beam node or an ancestor of one: at most beam * depth slots
        return self.tree_beam * min(self.tree_depth, budget) + 1

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        if budget <= 0:
            return Draft.empty()
        if self.lm is None:
            self.begin(ctx.tokens, None)
        root_logits = self.lm.sync(ctx.tokens, self._step_slots(budget))  # [V] draft distribution after the root
        if self.tree:
            return self._propose_tree(ctx, budget, root_logits)
        return self._propose_chain(ctx, budget, root_logits)

    # ------------------------------------------------------------------ chain
    def _propose_chain(self, ctx: DraftContext, budget: int, logits: torch.Tensor) -> Draft:
        tokens: list[int] = []
        draft_rows: list[torch.Tensor] = []  # q each token was sampled from (temperature > 0)
        for index in range(budget):
            if ctx.sampling.greedy or not self.sample:  # a deterministic proposal
                token = int(logits.argmax())
            else:
                draft_probs = warp_logits_to_probs(logits, ctx.sampling)  # [V]
                token = int(sample_from_probs(draft_probs, ctx.generator))
                draft_rows.append(draft_probs)
            tokens.append(token)
            if index + 1 < budget:  # the last token's successor is not needed
                logits = self.lm.extend([token])
        token_tensor = torch.tensor(tokens, dtype=torch.long)
        return Draft.chain(token_tensor, torch.stack(draft_rows) if draft_rows else None)

    # ------------------------------------------------------------------ tree
    def _propose_tree(self, ctx: DraftContext, budget: int, root_logits: torch.Tensor) -> Draft:
        tree = _TreeBuilder(self.lm, ctx, self.tree_topk, self.sample)
        level = tree.expand(-1, root_logits)
        for _ in range(2, min(self.tree_depth, budget) + 1):
            frontier = tree.best(level, self.tree_beam)
            if not frontier or tree.cannot_improve(frontier, budget):
                break
            rows = tree.node_logits(frontier)  # [len(frontier), V], one draft forward
            level = [child for node, row in zip(frontier, rows) for child in tree.expand(node, row)]
        draft = tree.best_subtree(budget)
        tree.finish()
        return draft


class _TreeBuilder(ScoredTree):
    """A ScoredTree grown with a DraftLM: node slots live in the draft model's cache."""

    def __init__(self, lm: DraftLM, ctx: DraftContext, topk: int, sample: bool):
        super().__init__(topk, ctx.sampling, ctx.generator, sample)
        self.lm = lm
        self.slot_nodes: list[int] = []  # nodes written to the draft cache after the committed tokens
        self.last_logits: dict[int, torch.Tensor] = {}

    def node_logits(self, frontier: list[int]) -> torch.Tensor:
        """Draft logits [F, V] after each frontier node, from one forward under a tree mask.

        Node slots already in the cache stay only while they are ancestors of EVERY frontier
        node (the cache shows its slots to all new tokens); the rest of the frontier's paths is
        (re)written in this forward.
        """
        common = set(self.paths[frontier[0]][:-1])
        for node in frontier[1:]:
            common &= set(self.paths[node][:-1])
        kept = 0
        while kept < len(self.slot_nodes) and self.slot_nodes[kept] in common:
            kept += 1
        self.slot_nodes = self.slot_nodes[:kept]
        self.lm.keep_nodes(kept)
        needed = sorted({n for node in frontier for n in self.paths[node]} - set(self.slot_nodes))
        index_of = {node: i for i, node in enumerate(needed)}
        mask = torch.zeros(len(needed), len(needed), dtype=torch.bool)  # [T, T]
        for row, node in enumerate(needed):
            for ancestor in self.paths[node]:
                if ancestor in index_of:
                    mask[row, index_of[ancestor]] = True
        root_position = len(self.lm.tokens) - 1
        positions = torch.tensor([root_position + len(self.paths[n]) for n in needed])  # [T]
        logits = self.lm.run_nodes([self.tokens[n] for n in needed], positions, mask)  # [T, V]
        self.slot_nodes += needed
        for row, node in enumerate(needed):
            self.last_logits[node] = logits[row]
        return logits[[index_of[node] for node in frontier]]

    def finish(self) -> None:
        """Keep the written node slots when they form a plain chain from the root, else drop them."""
        is_chain = all(
            self.parents[node] == (self.slot_nodes[i - 1] if i else -1) for i, node in enumerate(self.slot_nodes)
        )
        if self.slot_nodes and is_chain:
            last = self.slot_nodes[-1]
            self.lm.adopt_nodes([self.tokens[n] for n in self.slot_nodes], self.last_logits[last])
        else:
            self.lm.drop_nodes()


# ---------------------------------------------------------------------------- small-model


def check_same_vocabulary(target, draft_target) -> None:
    """Raise ValueError unless draft and target tokenizers map every token string to the same id."""
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft_target.tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    only_target = sorted(set(target_vocab) - set(draft_vocab))[:5]
    only_draft = sorted(set(draft_vocab) - set(target_vocab))[:5]
    moved = sorted(t for t in set(target_vocab) & set(draft_vocab) if target_vocab[t] != draft_vocab[t])[:5]
    raise ValueError(
        f"draft model {getattr(draft_target, 'name', '?')!r} does not share the tokenizer of target "
        f"{getattr(target, 'name', '?')!r}: vocab sizes {len(draft_vocab)} vs {len(target_vocab)}; "
        f"only in target: {only_target}, only in draft: {only_draft}, different ids: {moved}. "
        "small-model drafting needs a draft model with the target's exact tokenizer."
    )


def decode_cost_bytes(model_target) -> float:
    """Bytes of weights one decode step reads (embedding lookups excluded): a memory-bound cost proxy."""
    model = getattr(model_target, "model", None)
    if not isinstance(model, torch.nn.Module):
        return float("nan")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None and hasattr(model, "model") and hasattr(model.model, "embed_tokens"):
        embed = model.model.embed_tokens
    head = model.lm_head if hasattr(model, "lm_head") else None
    if embed is not None and (head is None or head.weight is not embed.weight):
        total -= embed.weight.numel() * embed.weight.element_size()
    return float(total)


def frequent_token_ids(vocab_size: int, size: int, always: Sequence[int]) -> torch.Tensor | None:
    """A draft vocabulary of `size` frequent tokens: the lowest ids (a BPE tokenizer numbers its
    tokens in the order its merges were learnt, most frequent first), plus `always` (the end-of-text
    ids, so a draft can end); sorted [V']. None when that is the whole vocabulary."""
    if size >= vocab_size:
        return None
    ids = set(range(size)) | {int(token) for token in always if 0 <= int(token) < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


def reduced_lm_head(head: nn.Module, token_ids: torch.Tensor) -> nn.Module:
    """The LM head over the rows `token_ids` only, run by the same kernel as `head`: GGUF blocks
    hold whole rows, so the rows stay in their quantized format (GGUFLinear); dense rows keep the
    head's linear backend (FastLinear)."""
    from ..kernels.backends import FastLinear
    from ..kernels.gguf_linear import GGUFLinear

    rows = head.weight.detach().index_select(0, token_ids)  # [V', H] (GGUF: [V', row bytes] uint8)
    bias = None if head.bias is None else head.bias.detach().index_select(0, token_ids)
    if isinstance(head, GGUFLinear):
        return GGUFLinear(rows, head.ggml_type, head.in_features, bias, head.backend, head.activations)
    linear = nn.Linear(head.in_features, len(token_ids), bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(rows, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return FastLinear(linear, head.backend) if isinstance(head, FastLinear) else linear


def _draft_weights(requested: str, target, draft_model: str) -> str | None:
    """The draft model's weight mode: `requested`, else the target's block mode (gguf / gguf-a8) when
    the draft model has GGUF blocks too, else None (as stored)."""
    from ..models import has_gguf_blocks
    from ..models.llama import BLOCK_ACTIVATIONS

    if requested:
        return requested
    mode = getattr(target, "weights", None)
    return mode if mode in BLOCK_ACTIVATIONS and has_gguf_blocks(draft_model) else None


@register_drafter
class SmallModelDrafter(ModelDrafter):
    """Draft with an independent smaller model that shares the target's tokenizer.

    draft_model: registry name / HF directory / .gguf of the draft model (loaded with
        specdec.load_target), or pass `draft_target`, an already loaded Target.
    draft_dtype: dtype to load draft_model in (None = the target's dtype, float32 without target).
    gamma: chain length per step; tree / tree_*: see ModelDrafter (tree_nodes = node budget).
    sample: at temperature > 0, sample chains and trees from q with exact draft_probs (false: argmax
        chains and top-k trees, deterministic proposals).
    draft_weights: the draft model's weights (load_target's `weights`: gguf, gguf-a8, fp32); default:
        the target's block mode when both are GGUF-sourced (a gguf-a8 target drafts with a gguf-a8
        draft model: the same kernel path, about half the exact mode's step), else as stored.
    draft_vocab: propose only from the `draft_vocab` most frequent tokens (frequent_token_ids; 0 =
        the whole vocabulary), EAGLE-3's draft vocabulary: the draft model's LM head computes only
        those rows (reduced_lm_head; on a Qwen2.5 0.5B most of a step is its 151,936-row head) and
        q is exactly the warped softmax over them, zero elsewhere. Needs a draft model on the native
        runtime.
    context: the draft model reads at most the last `context` committed tokens in one go (0 = the
        whole prompt): its prefill costs that many tokens instead of the prompt's (module docstring).
    """

    name = "small-model"

    def __init__(
        self,
        target=None,
        draft_model: str = DEFAULT_DRAFT_MODEL,
        draft_target: Target | None = None,
        draft_dtype: str | None = None,
        gamma: int = 4,
        tree: bool = False,
        tree_nodes: int = 8,
        tree_depth: int = 4,
        tree_topk: int = 3,
        tree_beam: int = 1,
        sample: bool = True,
        draft_vocab: int = 0,
        draft_weights: str = "",
        context: int = 0,
    ):
        super().__init__(gamma, tree, tree_nodes, tree_depth, tree_topk, tree_beam, sample, context)
        check_int("draft_vocab (0 = the whole vocabulary)", draft_vocab, 0)
        if draft_target is None:
            if not isinstance(draft_model, str) or not draft_model:
                raise ValueError(f"draft_model must be a model name, directory or .gguf path, got {draft_model!r}")
            from ..models import load_target

            dtype = draft_dtype or (str(target.dtype).removeprefix("torch.") if target is not None else "float32")
            draft_target = load_target(draft_model, dtype=dtype, weights=_draft_weights(draft_weights, target, draft_model))
        elif draft_weights:
            raise ValueError("draft_weights goes with draft_model, not with a loaded draft_target")
        for method in ("forward", "new_cache"):
            if not callable(getattr(draft_target, method, None)):
                raise ValueError(f"draft_target must be a loaded Target (no {method}()), got {type(draft_target).__name__}")
        self.draft_target = draft_target
        self._checked_targets: list = []  # targets whose tokenizer matched (shared by sequence copies)
        self.target_vocab_size = None
        self.token_ids, self.lm_head = self._draft_vocabulary(draft_target, draft_vocab)
        if target is not None:
            self._check_target(target)
            per_token = self._step_cost_bytes() / decode_cost_bytes(target)
            if math.isnan(per_token):
                per_token = draft_target.num_layers * draft_target.hidden_size / (target.num_layers * target.hidden_size)
            self.cost = dataclasses.replace(self.cost, per_token=per_token)

    @staticmethod
    def _draft_vocabulary(draft_target, size: int) -> tuple[torch.Tensor | None, nn.Module | None]:
        """(the draft vocabulary's ids [V'], the LM head over them), or (None, None) for all tokens."""
        if size == 0:
            return None, None
        from ..models.llama import NativeTarget

        if not isinstance(draft_target, NativeTarget):
            raise ValueError(f"draft_vocab needs a draft model on the native runtime, got {type(draft_target).__name__}")
        head = draft_target.model.lm_head
        ids = frequent_token_ids(min(head.out_features, draft_target.vocab_size), size, draft_target.eos_token_ids)
        return (None, None) if ids is None else (ids, reduced_lm_head(head, ids))

    def _step_cost_bytes(self) -> float:
        """Weight bytes one draft step reads: the draft model's, with only the draft vocabulary's LM-head rows."""
        total = decode_cost_bytes(self.draft_target)
        if self.lm_head is None:
            return total
        full = self.draft_target.model.lm_head.weight
        reduced = sum(p.numel() * p.element_size() for p in self.lm_head.parameters())
        return total - full.numel() * full.element_size() + reduced

    def _check_target(self, target) -> None:
        if not any(target is seen for seen in self._checked_targets):
            check_same_vocabulary(target, self.draft_target)
            self._checked_targets.append(target)
        self.target_vocab_size = target.vocab_size

    def begin(self, prompt_ids, target) -> None:
        if target is not None:
            self._check_target(target)
        if self.target_vocab_size is None:
            raise ValueError("small-model drafting needs the target: pass target= to the drafter or begin()")
        super().begin(prompt_ids, target)

    def _new_draft_lm(self, capacity: int) -> DraftLM:
        draft = self.draft_target

        reduced = {} if self.lm_head is None else {"lm_head": self.lm_head}  # logits [1, T, V'] over token_ids

        def forward(tokens, positions, cache, attn_mask, last_only):
            return model_logits(draft, tokens, positions, cache, attn_mask, last_only, **reduced)

        new_cache = lambda max_len: draft.new_cache(1, max_len)  # noqa: E731
        return DraftLM(forward, new_cache, self.target_vocab_size, capacity, self.token_ids, self.context)
