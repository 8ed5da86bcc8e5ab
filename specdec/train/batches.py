"""Training batches and their label rows, shared by the trainer and DSpark's calibration.

A batch is a few self-distilled samples, right-padded and cropped to a window (`make_batch`);
its label rows are the (head position k, row b, position t) whose label, the target's top-1
token at t + k + 1, lies in the row (`label_rows`). Block drafters draft from random anchors
(`pick_anchors`); chained modules compute only the positions a loss row reads (`chain_starts`).
`SampledVocab` is the optional sampled softmax of the training loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .data import Sample
from ..heads import FrozenTargetParts


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] long (0 = padding)
    hidden: torch.Tensor  # [B, T, H] float32: the heads' input layer
    positions: torch.Tensor  # [B, T] absolute positions
    lengths: torch.Tensor  # [B] valid tokens per row
    answer_start: torch.Tensor  # [B] first answer token index in the (cropped) row
    target_next: torch.Tensor  # [B, T] long: the target's top-1 token after each position
    top_hidden: torch.Tensor | None = None  # [B, T, H] float32: the target's top layer (feature targets)
    # [B, T] bool: tokens that may be labels (Sample.supervised: a conversation's assistant replies); all valid tokens
    # for other samples. False for padding.
    supervised: torch.Tensor | None = None
    # [B, T] float32: the target's logsumexp over the whole vocabulary at each position (Sample.target_log_normaliser)
    target_log_normaliser: torch.Tensor | None = None

    def __post_init__(self):
        if self.supervised is None:  # every valid token
            width = self.tokens.shape[1]
            self.supervised = torch.arange(width, device=self.tokens.device)[None, :] < self.lengths[:, None]  # [B, T]

    def labels_supervised(self, num_positions: int) -> torch.Tensor:
        """[B, T] bool: the labels of a chain from t, tokens t + 2 .. t + num_positions + 1, are all supervised
        (those past the row count as supervised: the callers check the length)."""
        padded = F.pad(self.supervised, (0, num_positions + 2), value=True)  # [B, T + K + 2]
        width = self.supervised.shape[1]
        ok = torch.ones_like(self.supervised)
        for k in range(1, num_positions + 1):
            ok &= padded[:, k + 1 : k + 1 + width]
        return ok



def crop_start(sample: Sample, max_seq_len: int, generator: torch.Generator, prompt_rows: bool = False) -> int:
    """Where a sample longer than max_seq_len is cropped: a window that holds as many rows the loss
    can use as fits. Without `prompt_rows` those are the answer's: an answer that fits is kept whole
    with the prompt tokens right before it (a uniformly random window over a 700-token RAG prompt
    and a 100-token answer would hold on average less than half of the answer, often none of it,
    and the step would be spent on context rows); a longer answer gets a random window inside it.
    With `prompt_rows` every row counts: a uniformly random window."""
    length = sample.tokens.shape[0]
    if length <= max_seq_len:
        return 0
    last_start = length - max_seq_len
    # row num_prompt_tokens - 1 predicts the first answer token, so the window may start there
    first_start = 0 if prompt_rows else min(max(0, sample.num_prompt_tokens - 1), last_start)
    return int(torch.randint(first_start, last_start + 1, (1,), generator=generator))


def make_batch(samples: list[Sample], layers: int | tuple[int, ...], max_seq_len: int, generator: torch.Generator, device,
               top_layer: int | None = None, prompt_rows: bool = False) -> Batch:
    """Right-padded batch; a sample longer than max_seq_len is cropped to a window (`crop_start`:
    the answer's rows first, or anywhere with `prompt_rows`).
    `hidden` holds `layers` concatenated in order (EAGLE-3 fuses three). `top_layer` also fills
    `top_hidden` (the feature loss's targets, the target's distribution for EAGLE-3)."""
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    rows = []
    for sample in samples:
        start = crop_start(sample, max_seq_len, generator, prompt_rows)
        rows.append((sample, start, min(sample.tokens.shape[0], start + max_seq_len)))
    width = max(stop - start for _, start, stop in rows)
    hidden_size = rows[0][0].hidden[layers[-1]].shape[1]
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    target_next = torch.zeros(len(rows), width, dtype=torch.long)
    hidden = torch.zeros(len(rows), width, hidden_size * len(layers))
    top_hidden = torch.zeros(len(rows), width, hidden_size) if top_layer is not None else None
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    supervised = torch.zeros(len(rows), width, dtype=torch.bool)
    with_normaliser = all(sample.target_log_normaliser is not None for sample in samples)
    log_normaliser = torch.full((len(rows), width), math.nan) if with_normaliser else None
    for row, (sample, start, stop) in enumerate(rows):
        tokens[row, : stop - start] = sample.tokens[start:stop]
        supervised[row, : stop - start] = True if sample.supervised is None else sample.supervised[start:stop]
        target_next[row, : stop - start] = sample.target_next[start:stop]
        hidden[row, : stop - start] = torch.cat([sample.hidden[layer][start:stop] for layer in layers], dim=-1).float()
        if top_hidden is not None:
            top_hidden[row, : stop - start] = sample.hidden[top_layer][start:stop].float()
        if log_normaliser is not None:
            log_normaliser[row, : stop - start] = sample.target_log_normaliser[start:stop]
        positions[row] = torch.arange(start, start + width)
    lengths = torch.tensor([stop - start for _, start, stop in rows])
    answer_start = torch.tensor([sample.num_prompt_tokens - start for sample, start, _ in rows])
    return Batch(tokens.to(device), hidden.to(device), positions.to(device), lengths.to(device), answer_start.to(device),
                 target_next.to(device), None if top_hidden is None else top_hidden.to(device), supervised.to(device),
                 None if log_normaliser is None else log_normaliser.to(device))


def label_positions(sample: Sample, prompt_rows: bool = False) -> torch.Tensor:
    """[T] bool: positions t whose next token t + 1 may be a label (`label_rows`' rule for one sample)."""
    length = sample.tokens.shape[0]
    after = torch.arange(1, length + 1) < length  # t + 1 is a token of the sample
    if prompt_rows:
        return after
    after &= torch.arange(1, length + 1) >= sample.num_prompt_tokens
    if sample.supervised is not None:
        after[:-1] &= sample.supervised[1:]
    return after


@torch.no_grad()
def attach_target_log_normalisers(samples: list[Sample], parts: FrozenTargetParts, top_layer: int, device,
                                  bf16: bool, prompt_rows: bool = False, progress: bool = True,
                                  chunk_rows: int = 1024) -> None:
    """Sets each sample's `target_log_normaliser` [T]: the logsumexp over the whole vocabulary of the
    target's logits at every position whose next token may be a label (NaN elsewhere), from its stored
    top layer through `parts`' LM head under the training's autocast, as a step would compute it.
    Once per run, so a step needs the draft vocabulary's rows of the head only (DSpark's loss: the
    target's probabilities on V' and its mass outside; on the 1.5B the whole head was ~28 % of a step)."""
    from tqdm.auto import tqdm

    wanted = [label_positions(sample, prompt_rows) for sample in samples]
    for sample, rows in zip(samples, wanted):
        sample.target_log_normaliser = torch.full(rows.shape, math.nan)
    pending: list[tuple[Sample, torch.Tensor]] = []  # (sample, its positions) of the next chunk

    def flush() -> None:
        states = torch.cat([sample.hidden[top_layer][index] for sample, index in pending]).to(device).float()  # [n, H]
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            log_normaliser = torch.logsumexp(parts.lm_head(states).float(), dim=-1).cpu()  # [n]
        for (sample, index), values in zip(pending, log_normaliser.split([index.numel() for _, index in pending])):
            sample.target_log_normaliser[index] = values
        pending.clear()
        bar.update(states.shape[0])

    bar = tqdm(total=int(sum(rows.sum() for rows in wanted)), desc="target logsumexp", unit="pos", disable=not progress)
    queued = 0
    for sample, rows in zip(samples, wanted):
        for index in rows.nonzero().squeeze(1).split(chunk_rows):
            pending.append((sample, index))
            queued += index.numel()
            if queued >= chunk_rows:
                flush()
                queued = 0
    if pending:
        flush()
    bar.close()


def label_rows(batch: Batch, num_positions: int, prompt_rows: bool = False,
               greedy_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N, 3] of (head k - 1, b, t), labels [N]) for every valid label position t + k + 1.

    The label is target_next[t + k]: the target's top-1 for position t + k + 1 given the tokens
    up to t + k. Valid where t + k + 1 is a token of the row (and of the answer, a supervised one:
    in a conversation an assistant token, unless prompt_rows).

    `greedy_from` = j0 also requires tokens t + j0 .. t + k to be the target's own greedy choices
    (tokens[i] == target_next[i - 1]): at drafting time head position k is judged only after the
    draft tokens before it were accepted, i.e. on the greedy path. Heads that read no token after
    t use j0 = 1; a head that reads the (committed) next token uses j0 = 2. On greedy answers every
    row passes; on sampled answers and corpus text the other rows' labels cannot be predicted from
    what the head sees. None = no such condition (evaluation).
    """
    width = batch.tokens.shape[1]
    t = torch.arange(width, device=batch.tokens.device)  # [T]
    k = torch.arange(1, num_positions + 1, device=t.device)  # [K]
    label_index = t[None, None, :] + k[:, None, None] + 1  # [K, 1, T]
    valid = label_index < batch.lengths[None, :, None]  # [K, B, T]
    if not prompt_rows:
        valid &= label_index >= batch.answer_start[None, :, None]
        label_supervised = F.pad(batch.supervised, (0, num_positions + 1), value=False)  # [B, T + K + 1]
        for position in range(1, num_positions + 1):  # label token t + position + 1
            valid[position - 1] &= label_supervised[:, position + 1 : position + 1 + width]
    if greedy_from is not None:
        greedy = torch.ones_like(batch.tokens, dtype=torch.bool)  # [B, T]: token i is the target's top-1 after i - 1
        greedy[:, 1:] = batch.tokens[:, 1:] == batch.target_next[:, :-1]
        on_path = torch.ones_like(greedy)  # [B, T]
        for position in range(1, num_positions + 1):
            if position >= greedy_from:
                on_path = on_path & F.pad(greedy[:, position:], (0, position), value=False)  # token t + position
            valid[position - 1] &= on_path
    rows = valid.nonzero()  # [N, 3]
    labels = batch.target_next[rows[:, 1], rows[:, 2] + rows[:, 0] + 1]  # [N]
    return rows, labels


class SampledVocab:
    """A sampled softmax for the training loss (evaluation always uses the full vocabulary).

    On CPU the [rows, V] LM-head product dominates a step (V = 151936 for Qwen). The target's
    answers use a few thousand distinct tokens, so the loss normalises over every token that is
    a label anywhere in the training data plus `negatives` other ids drawn fresh each step —
    those keep the logits of never-seen tokens from drifting up unpenalised. The same idea as
    EAGLE-3's reduced draft vocabulary, used here only to make training steps cheaper: the
    trained heads still score the full vocabulary when they draft.
    """

    def __init__(self, label_ids: torch.Tensor, vocab_size: int, negatives: int):
        self.label_ids = torch.unique(label_ids)  # [L] sorted
        is_label = torch.zeros(vocab_size, dtype=torch.bool)
        is_label[self.label_ids] = True
        self.others = (~is_label).nonzero().squeeze(1)  # [V - L]
        self.negatives = min(negatives, self.others.numel())
        self.vocab_size = vocab_size

    @classmethod
    def from_samples(cls, samples: list[Sample], vocab_size: int, negatives: int) -> SampledVocab:
        """Every label the samples can produce: the target's top-1 at each of their positions."""
        labels = [s.target_next for s in samples]
        return cls(torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long), vocab_size, negatives)

    def draw(self, parts: FrozenTargetParts, labels: torch.Tensor, generator: torch.Generator):
        """(parts with an LM head over this step's ids, labels as indices into those ids)."""
        pick = torch.randperm(self.others.numel(), generator=generator)[: self.negatives]
        ids = torch.cat([self.label_ids, self.others[pick]]).to(labels.device)  # [V']
        index_of = torch.full((self.vocab_size,), -1, dtype=torch.long, device=labels.device)
        index_of[ids] = torch.arange(ids.numel(), device=labels.device)
        local = index_of[labels]
        if bool((local < 0).any()):
            raise ValueError("a label is missing from the sampled vocabulary (build it from the training samples)")
        return parts.with_lm_rows(ids), local


def chain_starts(batch: Batch, rows: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[K, B, T] bool: where label rows [N, 3] of (k - 1, b, t) need features computed: chain start t
    at head position k and, since a chain is unrolled, at every position before it."""
    read = torch.zeros(num_positions, *batch.tokens.shape, dtype=torch.bool, device=batch.tokens.device)
    read[rows[:, 0], rows[:, 1], rows[:, 2]] = True
    return read.flip(0).cumsum(0).flip(0) > 0  # read at k -> read at 1 .. k


def pick_anchors(batch: Batch, count: int, generator: torch.Generator, prompt_rows: bool = False) -> torch.Tensor:
    """[B, count] random anchor indices t per row (block = context 0 .. t, anchor token t + 1) whose
    first label t + 2 is a token of the row (of its answer unless prompt_rows); drawn without
    replacement, repeated when a row has fewer (a repeat adds the same rows twice)."""
    t = torch.arange(batch.tokens.shape[1])
    lengths, answer_start = batch.lengths.cpu(), batch.answer_start.cpu()
    valid = t[None, :] + 2 < lengths[:, None]  # [B, T]
    if not prompt_rows:
        valid &= t[None, :] + 2 >= answer_start[:, None]
        valid &= F.pad(batch.supervised.cpu(), (0, 2), value=False)[:, 2:]  # the first label, token t + 2, is supervised
    picks = []
    for row in valid:
        choices = row.nonzero().squeeze(1)
        if choices.numel() == 0:
            choices = torch.zeros(1, dtype=torch.long)  # no label here: its rows are invalid anyway
        order = choices[torch.randperm(choices.numel(), generator=generator)]
        picks.append(order.repeat(-(-count // order.numel()))[:count])
    return torch.stack(picks).to(batch.tokens.device)
