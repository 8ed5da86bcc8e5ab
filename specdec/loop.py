"""The speculative generation loop (batch >= 1), shared by every drafter and by plain decoding.

Per sequence the loop keeps: committed tokens (prompt + output), a KV cache row holding all of
them except the last ("root"), a per-sequence drafter, a seeded generator and SpecStats.
Plain decoding is the same loop with no drafter (every draft empty), so "speculative equals
plain" compares two runs of one code path that differ only in the draft.

    0. prefill every prompt (ragged, right-padded) and sample the first token
    loop:
      1. choose each sequence's draft budget (fixed gamma, or the cost model's choice)
      2. propose: drafter.propose(ctx, budget) -> Draft rooted at the root token
      3. build one batch: [root, *draft nodes] per row, tree masks, positions
      4. ONE target forward over all rows (plus the hidden layers drafters asked for)
      5. verify each row (specdec.verify) -> accepted path + bonus/correction token
      6. commit token by token (EOS, stop strings, max_new_tokens), compact the KV cache to
         the accepted path (keep / truncate), update stats, drafter.on_verified
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .budget import FixedBudget
from .draft import Draft
from .drafters.base import DraftContext, Drafter
from .sampling import SamplingParams, make_generator, sample_from_probs, warp_logits_to_probs
from .stats import SpecStats
from .verify import VerifyResult, verify_chain, verify_tree


@dataclass
class Generation:
    tokens: list[int]  # generated token ids (EOS included when it ended the sequence)
    text: str  # decoded output (a matched stop string is cut off)
    stats: SpecStats
    finish_reason: str = "length"  # "stop" (EOS or stop string) | "length" (max_new_tokens)


@dataclass
class _Sequence:
    ctx: DraftContext
    drafter: Drafter | None
    stats: SpecStats
    max_new_tokens: int
    stop_strings: tuple[str, ...]
    finish_reason: str | None = None
    stop_text_cut: int | None = None  # output text length at which a stop string starts

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> int:
        return len(self.ctx.tokens) - self.ctx.num_prompt_tokens


def run(
    target,
    prompts: Sequence[list[int]],
    drafter: Drafter | None = None,
    max_new_tokens: int = 128,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    stop: Sequence[str] = (),
    budget_policy=None,
) -> Iterator[list[list[int]]]:
    """Generate for a batch of prompts (token ids). Yields, after every step, the tokens each
    sequence committed in that step; returns (via StopIteration.value) the list of Generation."""
    if not prompts:
        raise ValueError("no prompts given")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    policy = budget_policy or FixedBudget()
    eos_ids = set(target.eos_token_ids)
    hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()
    seqs = []
    for prompt, param in zip(prompts, params):
        ctx = DraftContext(list(prompt), len(prompt), param, make_generator(param.seed))
        seq_drafter = drafter.for_sequence() if drafter is not None else None
        if seq_drafter is not None:
            seq_drafter.begin(list(prompt), target)
        seqs.append(_Sequence(ctx, seq_drafter, SpecStats(), max_new_tokens, tuple(s for s in stop if s)))
    max_budget = max((policy.max_budget(s) for s in seqs), default=0)
    cache = target.new_cache(len(seqs), max(len(p) for p in prompts) + max_new_tokens + max_budget + 2)

    # 0. prefill (ragged prompts, right-padded; padding slots are dropped by truncate)
    with _timers(seqs, "verify"):
        lengths = torch.tensor([len(p) for p in prompts])
        width = int(lengths.max())
        tokens = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts])  # [B, T]
        positions = torch.arange(width).expand(len(seqs), -1)  # [B, T]
        logits, hiddens = target.forward(tokens, positions, cache, hidden_layers=hidden_layers)
        cache.truncate(lengths)
    committed = []
    for row, seq in enumerate(seqs):
        probs = warp_logits_to_probs(logits[row, lengths[row] - 1], seq.ctx.sampling)  # [V]
        first = int(sample_from_probs(probs, seq.ctx.generator))
        seq.stats.record_prefill(1)
        seq.ctx.new_hidden = {layer: h[row, : lengths[row]] for layer, h in hiddens.items()}
        committed.append(_commit(seq, [first], target, eos_ids))
        if seq.drafter is not None:
            seq.drafter.on_verified(VerifyResult([first], 0, []), seq.ctx)
    yield committed

    while not all(seq.done for seq in seqs):
        active = [row for row, seq in enumerate(seqs) if not seq.done]
        # 1-2. budgets and proposals
        drafts: dict[int, Draft] = {}
        for row in active:
            seq = seqs[row]
            with seq.stats.timer("draft"):
                drafts[row] = _propose(seq, policy, len(active))
        # 3. one batch over all rows (finished rows get just their root and are ignored)
        with _timers([seqs[r] for r in active], "verify"):
            starts = cache.lengths.clone()
            width = 1 + max(len(d) for d in drafts.values())
            tokens, positions, mask = _batch_inputs(seqs, drafts, starts, width)
            # 4. the one target forward
            logits, hiddens = target.forward(tokens, positions, cache, attn_mask=mask, hidden_layers=hidden_layers)
            # 5. verification per row
            results = {}
            for row in active:
                draft = drafts[row]
                target_probs = warp_logits_to_probs(logits[row, : len(draft) + 1], seqs[row].ctx.sampling)
                results[row] = _verify(draft, target_probs, seqs[row].ctx.generator)
        # 6. commit, compact caches, feed drafters
        committed = [[] for _ in seqs]
        for row in active:
            seq, draft, result = seqs[row], drafts[row], results[row]
            kept = [0] + [1 + node for node in result.path]  # root + accepted path rows
            cache.keep(row, int(starts[row]), kept)
            with seq.stats.timer("other"):
                new_tokens = _commit(seq, result.tokens, target, eos_ids)
            max_depth = int(draft.depths.max()) if len(draft) else 0
            seq.stats.record_step(len(draft), result.num_accepted, len(new_tokens), max_depth)
            policy.observe(seq, max_depth, result.num_accepted)
            committed[row] = new_tokens
            if seq.drafter is not None and not seq.done:
                seq.ctx.new_hidden = {layer: h[row, kept] for layer, h in hiddens.items()}
                if seq.drafter.wants_node_logits:
                    seq.ctx.all_node_logits = logits[row, : len(draft) + 1]
                with seq.stats.timer("draft"):
                    seq.drafter.on_verified(result, seq.ctx)
        finished_before = [row for row in range(len(seqs)) if row not in drafts]
        if finished_before:  # their rows only carried a placeholder root: roll it back
            lengths = cache.lengths.clone()
            lengths[finished_before] = starts[finished_before]
            cache.truncate(lengths)
        yield committed

    return [_finish(seq, target) for seq in seqs]


def _propose(seq: _Sequence, policy, num_active: int) -> Draft:
    if seq.drafter is None:
        return Draft.empty()
    # never draft past max_new_tokens: the bonus token already fills the last slot
    room = seq.max_new_tokens - seq.generated - 1
    budget = min(policy.budget(seq, num_active), room)
    if budget <= 0:
        return Draft.empty()
    draft = seq.drafter.propose(seq.ctx, budget)
    if len(draft) > budget:
        raise RuntimeError(f"drafter {seq.drafter.name!r} proposed {len(draft)} nodes for a budget of {budget}")
    return draft


def _batch_inputs(seqs, drafts: dict[int, Draft], starts: torch.Tensor, width: int):
    """tokens / positions [B, W] and tree masks [B, W, W] for rows [root, *nodes, padding]."""
    batch = len(seqs)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    positions = starts[:, None].repeat(1, width)  # padding: any position, it is masked and dropped
    mask = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)  # padding sees itself (no empty rows)
    for row, seq in enumerate(seqs):
        tokens[row] = seq.ctx.tokens[-1]
        draft = drafts.get(row)
        if not draft:
            continue
        n = len(draft)
        tokens[row, 1 : n + 1] = draft.tokens
        positions[row, : n + 1] = draft.positions(int(starts[row]))
        mask[row, : n + 1, : n + 1] = draft.tree_attention_mask()
    return tokens, positions, mask


def _verify(draft: Draft, target_probs: torch.Tensor, generator) -> VerifyResult:
    if draft.is_chain:
        return verify_chain(draft.tokens, draft.draft_probs, target_probs, generator)
    return verify_tree(draft, target_probs, generator)


def _commit(seq: _Sequence, new_tokens: list[int], target, eos_ids: set[int]) -> list[int]:
    """Append tokens one at a time, stopping exactly where plain decoding would."""
    taken = []
    for token in new_tokens:
        seq.ctx.tokens.append(token)
        taken.append(token)
        if token in eos_ids:
            seq.finish_reason = "stop"
        elif seq.stop_strings and _hit_stop_string(seq, target):
            seq.finish_reason = "stop"
        elif seq.generated >= seq.max_new_tokens:
            seq.finish_reason = "length"
        if seq.done:
            break
    return taken


def _hit_stop_string(seq: _Sequence, target) -> bool:
    text = target.decode(seq.ctx.output_tokens)
    cuts = [text.find(s) for s in seq.stop_strings if s in text]
    if cuts:
        seq.stop_text_cut = min(cuts)
        return True
    return False


def _finish(seq: _Sequence, target) -> Generation:
    output = seq.ctx.output_tokens
    text = target.decode(output)
    if seq.stop_text_cut is not None:
        text = text[: seq.stop_text_cut]
    return Generation(output, text, seq.stats, seq.finish_reason or "length")


class _timers:
    """Time one shared block into every listed sequence's stats (a batch step serves them all)."""

    def __init__(self, seqs, name: str):
        self.seqs, self.name = seqs, name

    def __enter__(self):
        self.contexts = [seq.stats.timer(self.name) for seq in self.seqs]
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc):
        for context in self.contexts:
            context.__exit__(*exc)
        return False
