"""The speculative generation loop (batch >= 1), shared by every drafter and by plain decoding.

Per sequence the loop keeps: committed tokens (prompt + output), a KV cache row holding all of
them except the last ("root"), a per-sequence drafter, a seeded generator and SpecStats.
Plain decoding is the same loop with no drafter (every draft empty), so "speculative equals
plain" compares two runs of one code path that differ only in the draft.

    0. prefill every prompt (ragged, right-padded) and sample the first token
    loop:
      1-2. drafts = policy.draft(seqs, propose) (specdec.budget, the one place draft lengths are
         decided): each sequence's budget, drafter.propose(ctx, budget) -> Draft rooted at the
         root token, and drafts that carry confidences cut, across the batch, to the prefix worth
         verifying (specdec.schedule.admit)
      3. build one batch: [root, *draft nodes] per row, tree masks, positions
      4. ONE target forward over all rows (plus the hidden layers drafters asked for)
      5. verify each row (specdec.verify) -> accepted path + bonus/correction token
      6. commit token by token (EOS, stop strings, max_new_tokens), compact the KV cache to
         the accepted path (keep / truncate), update stats, policy.observe, drafter.on_verified
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from .budget import FixedBudget, PlanState
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


@dataclass(eq=False)  # identity semantics: sequences are handles (hashable)
class RunningSequence:
    """One generation in a batch: its context, drafter, stats, stopping rules and budget-planning state."""

    ctx: DraftContext
    drafter: Drafter | None
    stats: SpecStats
    max_new_tokens: int
    stop_strings: tuple[str, ...]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    last_committed: list[int] = field(default_factory=list)  # tokens gained in the latest step
    stop_text_cut: int | None = None  # output text length at which a stop string starts
    plan_state: PlanState = field(default_factory=PlanState)  # what the budget policy remembers of this sequence

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> int:
        return len(self.ctx.tokens) - self.ctx.num_prompt_tokens

    def output_text(self, target) -> str:
        """The decoded output, cut where a matched stop string starts."""
        text = target.decode(self.ctx.output_tokens)
        return text if self.stop_text_cut is None else text[: self.stop_text_cut]


def kv_room(policy, drafter: Drafter | None, prompt_len: int, max_new_tokens: int) -> int:
    """KV slots one sequence may need: prompt + output + the largest draft block + root and bonus."""
    return prompt_len + max_new_tokens + (policy.max_budget_for(drafter) if drafter is not None else 0) + 2


class SpecBatch:
    """Sequences that share one target forward per step; they can join and leave between steps.

    Row i of the KV cache belongs to `self.seqs[i]`; when a sequence leaves, the last row moves
    into its slot, so the running rows are always the prefix [0, n) and the forward runs on a
    view of exactly those rows (continuous batching without copying the cache each step).
    """

    def __init__(self, target, drafter: Drafter | None = None, budget_policy=None, max_batch: int = 8, max_len: int = 2048,
                 kv_budget_tokens: int | None = None):
        self.target = target
        self.drafter = drafter
        self.policy = budget_policy or FixedBudget()
        # the cache allocates as sequences grow; a KV budget caps its rows x slots (the scheduler admits within it)
        budget = {"max_tokens": kv_budget_tokens} if kv_budget_tokens is not None else {}
        self.cache = target.new_cache(max_batch, max_len, **budget)
        self.seqs: list[RunningSequence] = []
        self.eos_ids = set(target.eos_token_ids)
        self.hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()

    @property
    def max_batch(self) -> int:
        return self.cache.batch_size

    def room_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """KV slots one sequence may need (`kv_room` under this batch's policy and drafter)."""
        return kv_room(self.policy, self.drafter, prompt_len, max_new_tokens)

    def add(self, prompts: Sequence[list[int]], sampling: Sequence[SamplingParams], max_new_tokens: Sequence[int],
            stop: Sequence[Sequence[str]]) -> list[RunningSequence]:
        """0. Prefill new sequences (ragged, right-padded, one forward) and sample their first token."""
        first_row = len(self.seqs)
        if first_row + len(prompts) > self.max_batch:
            raise ValueError(f"batch full: {first_row} running + {len(prompts)} new > max_batch {self.max_batch}")
        for prompt, limit in zip(prompts, max_new_tokens):  # the one size rule, with this cache's slots
            self.target.check_fits(len(prompt), limit, kv_slots=self.cache.max_len, draft_room=self.room_needed(0, 0))
        new = []
        for prompt, param, limit, stops in zip(prompts, sampling, max_new_tokens, stop):
            ctx = DraftContext(list(prompt), len(prompt), param, make_generator(param.seed))
            seq_drafter = self.drafter.for_sequence() if self.drafter is not None else None
            if seq_drafter is not None:
                seq_drafter.begin(list(prompt), self.target)
            new.append(RunningSequence(ctx, seq_drafter, SpecStats(), limit, tuple(s for s in _as_stop_tuple(stops) if s)))
        # the LM head only for each prompt's last row, unless a drafter wants every row's logits
        last_only = getattr(self.target, "selects_logits", False) and not getattr(self.drafter, "wants_node_logits", False)
        with self.target.kernel_owns_threads():
            for start, end in _prefill_groups([len(p) for p in prompts], 1 if last_only else self.target.vocab_size):
                self._prefill(first_row + start, prompts[start:end], new[start:end], last_only)
        self.seqs.extend(new)
        self._drop_finished()
        return new

    def _prefill(self, first_row: int, prompts: Sequence[list[int]], new: list[RunningSequence], last_only: bool) -> None:
        """One ragged, right-padded forward over `prompts` (cache rows from first_row), then each
        sequence's first token."""
        rows = self.cache.rows(first_row, first_row + len(new))
        rows.truncate(0)
        with _timed_for_all(new, "verify"):
            lengths = torch.tensor([len(p) for p in prompts])
            width = int(lengths.max())
            tokens = torch.tensor([list(p) + [p[-1]] * (width - len(p)) for p in prompts])  # [b, T]
            positions = torch.arange(width).expand(len(new), -1)  # [b, T]
            extra = _skip_padding(self.target, lengths, width)
            if last_only:
                extra["logits_at"] = lengths - 1
            logits, hiddens = self.target.forward(tokens, positions, rows, hidden_layers=self.hidden_layers, **extra)
            rows.truncate(lengths)  # drop the padding slots
        for row, seq in enumerate(new):
            last_logits = logits[row, 0] if last_only else logits[row, lengths[row] - 1]  # [V]
            probs = warp_logits_to_probs(last_logits, seq.ctx.sampling)  # [V]
            first = int(sample_from_probs(probs, seq.ctx.generator))
            seq.stats.record_prefill(1)
            seq.ctx.new_hidden = {layer: h[row, : lengths[row]] for layer, h in hiddens.items()}
            if seq.drafter is not None and seq.drafter.wants_node_logits:
                seq.ctx.all_node_logits = logits[row, : lengths[row]]  # the prompt rows
            seq.last_committed = _commit(seq, [first], self.target, self.eos_ids)
            if seq.drafter is not None:
                seq.drafter.on_verified(VerifyResult([first], 0, []), seq.ctx)

    def step(self) -> list[RunningSequence]:
        """One draft -> verify -> commit step over every running sequence.

        Returns the sequences that ran; each one's `last_committed` holds the tokens it gained.
        Finished sequences leave the batch (their `finish_reason` is set)."""
        seqs = list(self.seqs)
        if not seqs:
            return []
        with self.target.kernel_owns_threads():  # the whole step: torch's ops between kernel calls on one thread
            # 1-2. the policy's drafts: budgets (it sees every running sequence: load-aware), proposals,
            # and the prefix of each draft worth verifying (one decision across the batch)
            drafts = self.policy.draft(seqs, _propose)
            rows = self.cache.rows(0, len(seqs))
            with _timed_for_all(seqs, "verify"):
                # 3. one batch: [root, *draft nodes, padding] per row, tree masks, positions
                starts = rows.lengths.clone()
                width = 1 + max(len(d) for d in drafts)
                tokens, positions, mask = _batch_inputs(seqs, drafts, starts, width)
                # 4. the one target forward (rows with shorter drafts are padded; a target that can
                # skips the padding's compute, so the cost follows the real token count)
                extra = _skip_padding(self.target, torch.tensor([1 + len(d) for d in drafts]), width)
                logits, hiddens = self.target.forward(tokens, positions, rows, attn_mask=mask, hidden_layers=self.hidden_layers,
                                                      **extra)
                # 5. verification per row
                results = []
                for row, (seq, draft) in enumerate(zip(seqs, drafts)):
                    target_probs = warp_logits_to_probs(logits[row, : len(draft) + 1], seq.ctx.sampling)  # [N+1, V]
                    results.append(_verify(draft, target_probs, seq.ctx.generator))
            # 6. commit, compact the cache to the accepted path, feed drafters
            for row, (seq, draft, result) in enumerate(zip(seqs, drafts, results)):
                kept = [0] + [1 + node for node in result.path]  # root + accepted path rows
                rows.keep(row, int(starts[row]), kept)
                with seq.stats.timer("other"):
                    seq.last_committed = _commit(seq, result.tokens, self.target, self.eos_ids)
                max_depth = int(draft.depths.max()) if len(draft) else 0
                seq.stats.record_step(len(draft), result.num_accepted, len(seq.last_committed), max_depth)
                if draft.sources is not None:  # a drafter merging several sources (hybrid): who proposed what
                    seq.stats.record_sources(draft.sources, result.path)
                self.policy.observe(seq, max_depth, result.num_accepted)
                if seq.drafter is not None:
                    seq.ctx.new_hidden = {layer: h[row, kept] for layer, h in hiddens.items()}
                    if seq.drafter.wants_node_logits:
                        seq.ctx.all_node_logits = logits[row, : len(draft) + 1]
                    with seq.stats.timer("draft"):
                        (seq.drafter.on_finished if seq.done else seq.drafter.on_verified)(result, seq.ctx)
        self._drop_finished()
        return seqs

    def remove(self, seq: RunningSequence) -> None:
        """Take a sequence out of the batch (finished, or its client went away) and free its row."""
        row = self.seqs.index(seq)
        last = len(self.seqs) - 1
        if row != last:
            self.cache.move_row(last, row)
            self.seqs[row] = self.seqs[last]
        self.seqs.pop()
        self.cache.rows(last, last + 1).truncate(0)
        if not self.seqs and hasattr(self.cache, "release"):
            self.cache.release()  # an idle batch holds no KV memory
        seq.finish_reason = seq.finish_reason or "cancelled"

    def _drop_finished(self) -> None:
        for seq in [s for s in self.seqs if s.done]:
            self.remove(seq)


def _skip_padding(target, real_lengths: torch.Tensor, width: int) -> dict:
    """forward() kwargs marking each row's first real_lengths[i] of `width` tokens as real, for
    targets that skip padding compute (rows of one batch are padded to the longest)."""
    if not getattr(target, "skips_padding", False) or len(real_lengths) < 2:
        return {}
    return {"token_valid": torch.arange(width)[None, :] < real_lengths[:, None]}  # [B, T]


PREFILL_LOGITS_BYTES = 1 << 30  # fp32 logits one prefill forward may return (every row's: a drafter wants them)


def _prefill_groups(lengths: Sequence[int], logits_per_row: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) groups of prompts to prefill in one forward each: as many as fit
    PREFILL_LOGITS_BYTES of [group, longest, logits_per_row] fp32 logits (at least one prompt).
    Every row of the batch-invariant forward is the same whichever group it is in; the bound
    matters when a drafter wants every prompt row's logits (32 prompts of 800 tokens x 151,936
    would be 15.6 GB)."""
    groups, start, longest = [], 0, 0
    for index, length in enumerate(lengths):
        wider = max(longest, length)
        if index > start and (index + 1 - start) * wider * logits_per_row * 4 > PREFILL_LOGITS_BYTES:
            groups.append((start, index))
            start, wider = index, length
        longest = wider
    groups.append((start, len(lengths)))
    return groups


def _as_stop_tuple(stops) -> tuple[str, ...]:
    return (stops,) if isinstance(stops, str) else tuple(stops)


class BatchRun:
    """One batch generation. Iterating runs it: after the prefill and after every step it yields
    the tokens each sequence committed then (one list per prompt). When the iteration has ended,
    `result` holds one Generation per prompt; `finish()` runs to the end and returns it."""

    def __init__(self, steps: Iterator[list[list[int]]]):
        self._steps = steps
        self._result: list[Generation] | None = None

    def __iter__(self) -> Iterator[list[list[int]]]:
        result = yield from self._steps
        if self._result is None:
            self._result = result

    def finish(self) -> list[Generation]:
        for _ in self:
            pass
        return self.result

    @property
    def result(self) -> list[Generation]:
        if self._result is None:
            raise RuntimeError("the run has not finished: iterate over it (or call finish()) first")
        return self._result


def run(
    target,
    prompts: Sequence[list[int]],
    drafter: Drafter | None = None,
    max_new_tokens: int = 128,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    stop: Sequence[str] = (),
    budget_policy=None,
) -> BatchRun:
    """Generate for a batch of prompts (token ids); nothing runs until the BatchRun is iterated."""
    return BatchRun(_run_steps(target, prompts, drafter, max_new_tokens, sampling, stop, budget_policy))


def _run_steps(target, prompts, drafter, max_new_tokens, sampling, stop, budget_policy):
    if not prompts:
        raise ValueError("no prompts given")
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    for prompt in prompts:  # the size rule before any allocation: the cache is sized from these numbers
        target.check_fits(len(prompt), max_new_tokens)
    policy = budget_policy or FixedBudget()
    longest = max(len(p) for p in prompts)
    max_len = kv_room(policy, drafter, longest, max_new_tokens)
    batch = SpecBatch(target, drafter, policy, max_batch=len(prompts), max_len=max_len)
    seqs = batch.add(prompts, params, [max_new_tokens] * len(prompts), [stop] * len(prompts))
    yield [seq.last_committed for seq in seqs]
    while batch.seqs:
        ran = set(map(id, batch.step()))
        yield [seq.last_committed if id(seq) in ran else [] for seq in seqs]
    return [Generation(seq.ctx.output_tokens, seq.output_text(target), seq.stats, seq.finish_reason or "length")
            for seq in seqs]


def _propose(seq: RunningSequence, budget: int) -> Draft:
    """The sequence's drafter's proposal of at most `budget` nodes (none for 0), timed as drafting."""
    with seq.stats.timer("draft"):
        if seq.drafter is None or budget <= 0:
            return Draft.empty()
        draft = seq.drafter.propose(seq.ctx, budget)
    if len(draft) > budget:
        raise RuntimeError(f"drafter {seq.drafter.name!r} proposed {len(draft)} nodes for a budget of {budget}")
    return draft


def _batch_inputs(seqs, drafts: list[Draft], starts: torch.Tensor, width: int):
    """tokens / positions [B, W] and tree masks [B, W, W] for rows [root, *nodes, padding]."""
    batch = len(seqs)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    positions = starts[:, None].repeat(1, width)  # padding: any position, it is masked and dropped
    mask = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)  # padding sees itself (no empty rows)
    for row, (seq, draft) in enumerate(zip(seqs, drafts)):
        tokens[row] = seq.ctx.tokens[-1]
        if not draft:
            continue
        n = len(draft)
        tokens[row, 1 : n + 1] = draft.tokens
        positions[row, : n + 1] = draft.positions(int(starts[row]))
        mask[row, : n + 1, : n + 1] = draft.tree_attention_mask()
    return tokens, positions, (mask if width > 1 else None)  # one new token per row: nothing to mask


def _verify(draft: Draft, target_probs: torch.Tensor, generator) -> VerifyResult:
    if draft.is_chain:
        return verify_chain(draft.tokens, draft.draft_probs, target_probs, generator)
    return verify_tree(draft, target_probs, generator)


def _commit(seq: RunningSequence, new_tokens: list[int], target, eos_ids: set[int]) -> list[int]:
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


def _hit_stop_string(seq: RunningSequence, target) -> bool:
    text = target.decode(seq.ctx.output_tokens)
    cuts = [text.find(s) for s in seq.stop_strings if s in text]
    if cuts:
        seq.stop_text_cut = min(cuts)
        return True
    return False


@contextmanager
def _timed_for_all(seqs, name: str) -> Iterator[None]:
    """Time one shared block into every listed sequence's stats (a batch step serves them all)."""
    with ExitStack() as timers:
        for seq in seqs:
            timers.enter_context(seq.stats.timer(name))
        yield
