"""One training loop for every head type (Medusa, MTP parallel / sequential, EAGLE-1 / EAGLE-3, DFlash).

The target stays frozen; only the head module trains. Labels are the target's own choices
(self-distilled data, specdec.train.data): head position k at position t learns the target's top-1
token at t + k + 1 given the data's tokens up to t + k (`target_next[t + k]`; on greedy answers
that is the answer's own token, on sampled answers and prompts it is what greedy verification
would accept there). Rows count where that label lies in the answer (or anywhere with
`prompt_rows`). Optionally (`feature_weight` > 0) the vector the LM head reads is also regressed
(smooth L1) to the target's own top-layer hidden state at t + k, the state that produced the
label: a dense target per row, EAGLE's feature loss, which learns more per token of data.

Per step: `batch_size` samples drawn with a generator seeded by (seed, step) (so a resumed run
sees the same batches), cropped to `max_seq_len`; the head module runs on the whole batch, then
at most `loss_rows` (head position, token) rows, picked at random, go through the frozen LM head
(the [rows, V] logits dominate the cost); cross-entropy (+ feature loss) per head position, weighted by
head_decay^(k - 1) (Medusa's 0.8^k) and averaged. AdamW, linear warmup then cosine decay to
`min_lr_ratio`, gradient clipping, bf16 autocast or fp32, a time budget, held-out evaluation
(top-1 agreement with the target's tokens per head position, and rank-r hit rates that the
drafters use to shape their trees), a progress bar, checkpoints, resume and a PNG plot.

Block drafters (`trains_on_anchors`, DFlash) compute only `anchors_per_row` random answer
positions per sequence per step (each a block drafted from there) and the rows are those anchors'.
Held-out evaluation also reports `tau`: the mean tokens per greedy verify step of a K-token chain
(leading head positions whose top-1 is the target's token, + 1), for every head type alike.

Schedule horizon: `steps` and / or `minutes`, both totals over the run and the runs it resumed, so a
resumed run continues the same schedule (the cosine follows the elapsed training time) and stops
where the uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checks import check_int, check_positive_int
from ..files import open_output_dir
from ..heads import DraftHeads, FrozenTargetParts, save_checkpoint
from .batches import Batch, SampledVocab, attach_target_log_normalisers, chain_starts, label_rows, make_batch, pick_anchors
from .data import Sample
from .heap import release_freed_memory

STATE_FILE = "trainer_state.pt"
HISTORY_FILE = "history.json"
PLOT_FILE = "training.png"
EVAL_RANKS = 10  # rank-r hit rates stored for r < EVAL_RANKS (tree shaping)


@dataclass
class TrainSettings:
    steps: int | None = None  # total optimizer steps (None: only the time budget)
    minutes: float | None = None  # time budget, the resumed runs' time included (None: only steps)
    lr: float = 1e-3
    batch_size: int = 8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    dtype: str = "fp32"  # "fp32" | "bf16" (autocast; master weights stay fp32)
    max_seq_len: int = 512
    loss_rows: int = 1024  # (head position, token) rows through the LM head per step
    # sampled softmax: 0 = the loss normalises over the whole vocabulary; N > 0 = over every token
    # that is a label in the training data plus N other ids drawn fresh each step (see SampledVocab)
    softmax_negatives: int = 0
    head_decay: float = 0.8
    # weight of the feature loss: smooth L1 between the head's readout and the target's top-layer
    # hidden state at the label's position (0 = token loss only)
    feature_weight: float = 0.0
    prompt_rows: bool = False  # also learn on rows whose label lies in the prompt (eval never does)
    # learn only on rows whose context follows the target's greedy path (label_rows' greedy_from);
    # needed for teacher-forced corpus data, harmless on greedy answers (eval counts every row)
    greedy_path_rows: bool = True
    # modules that draft a block per anchor (DFlash): blocks per sequence per step, anchored at
    # random answer positions (held-out evaluation uses at least this many per answer)
    anchors_per_row: int = 16
    eval_fraction: float = 0.1
    eval_rows: int = 4096
    eval_every: int = 100
    save_every: int = 200
    seed: int = 0
    device: str = "cpu"

    def validate(self) -> None:
        if self.steps is None and self.minutes is None:
            raise ValueError("give a training length: steps, minutes, or both")
        if self.steps is not None:
            check_positive_int("steps", self.steps)
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes!r}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be 'fp32' or 'bf16', got {self.dtype!r}")
        check_int("softmax_negatives", self.softmax_negatives, 0)
        for name in ("batch_size", "max_seq_len", "loss_rows", "eval_rows", "eval_every", "save_every", "anchors_per_row"):
            check_positive_int(name, getattr(self, name))
        if not self.feature_weight >= 0:
            raise ValueError(f"feature_weight must be >= 0, got {self.feature_weight!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction!r}")


@dataclass
class TrainResult:
    steps: int
    elapsed_s: float
    eval: dict
    checkpoint: Path
    history: dict = field(default_factory=dict)


def run_heads(heads: DraftHeads, batch: Batch, parts: FrozenTargetParts, generator: torch.Generator, anchors_per_row: int,
              prompt_rows: bool = False, read_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(features [K, B, T, H], is_anchor [B, T] or None): block drafters (`trains_on_anchors`) compute
    only random anchors' rows; modules that can (`computes_read_rows`) only `read_rows` [K, B, T] (the
    other features are zeros); the others every position."""
    if not heads.trains_on_anchors:
        if heads.computes_read_rows and read_rows is not None:
            return heads(batch.hidden, batch.tokens, batch.positions, parts, read_rows=read_rows), None
        return heads(batch.hidden, batch.tokens, batch.positions, parts), None
    anchors = pick_anchors(batch, anchors_per_row, generator, prompt_rows)  # [B, A]
    is_anchor = torch.zeros_like(batch.tokens, dtype=torch.bool).scatter_(1, anchors, True)
    return heads(batch.hidden, batch.tokens, batch.positions, parts, anchors=anchors), is_anchor


def heads_loss(heads: DraftHeads, batch: Batch, parts: FrozenTargetParts, settings: TrainSettings,
               generator: torch.Generator, vocab: SampledVocab | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted loss, correct [K], counted [K]) on at most `settings.loss_rows` random label rows.

    Block drafters compute their anchors' rows first (the label rows follow the anchors); the
    others pick the loss rows first and compute only the positions those read (`run_heads`)."""
    greedy_from = heads.greedy_path_from if settings.greedy_path_rows else None
    rows, labels = label_rows(batch, heads.num_positions, settings.prompt_rows, greedy_from)
    features = None
    if heads.trains_on_anchors:
        features, is_anchor = run_heads(heads, batch, parts, generator, settings.anchors_per_row, settings.prompt_rows)  # [K, B, T, H]
        keep = is_anchor[rows[:, 1], rows[:, 2]]
        rows, labels = rows[keep], labels[keep]
        own_loss = heads.training_loss(batch, features, rows, parts, settings, generator)
        if own_loss is not None:
            return own_loss
    proposable = heads.in_vocabulary(labels)  # EAGLE-3: rows whose label is outside the draft vocabulary are masked
    rows, labels = rows[proposable], labels[proposable]
    if rows.shape[0] > settings.loss_rows:
        pick = torch.randperm(rows.shape[0], generator=generator)[: settings.loss_rows].to(rows.device)
        rows, labels = rows[pick], labels[pick]
    if features is None:
        features, _ = run_heads(heads, batch, parts, generator, settings.anchors_per_row, settings.prompt_rows,
                                read_rows=chain_starts(batch, rows, heads.num_positions))  # [K, B, T, H]
    readout = heads.readout(features[rows[:, 0], rows[:, 1], rows[:, 2]], parts)  # [N, H]
    # the target's top-layer state at the position that produced each label
    producing = None if batch.top_hidden is None else batch.top_hidden[rows[:, 1], rows[:, 2] + rows[:, 0] + 1]  # [N, H]
    if vocab is not None:
        parts, labels = vocab.draw(parts, labels, generator)
    per_row, hits = heads.token_loss(readout, labels, parts, producing)  # [N], [N]
    if settings.feature_weight > 0:
        if producing is None:
            raise ValueError("the feature loss needs the target's top-layer hidden states in the batch (make_batch top_layer)")
        per_row = per_row + settings.feature_weight * F.smooth_l1_loss(readout.float(), producing, reduction="none").mean(-1)
    num_positions = heads.num_positions
    counted = torch.bincount(rows[:, 0], minlength=num_positions).float()  # [K]
    loss_sum = torch.zeros(num_positions, device=per_row.device).index_add(0, rows[:, 0], per_row)  # [K]
    weights = settings.head_decay ** torch.arange(num_positions, device=per_row.device, dtype=torch.float32)  # [K]
    present = counted > 0
    loss = (weights * loss_sum / counted.clamp(min=1))[present].sum() / weights[present].sum().clamp(min=1e-9)
    correct = torch.zeros(num_positions, device=per_row.device).index_add(0, rows[:, 0], hits.float())
    return loss, correct.detach().cpu(), counted.cpu()


@torch.no_grad()
def evaluate(heads: DraftHeads, samples: list[Sample], parts: FrozenTargetParts, settings: TrainSettings, device) -> dict:
    """Held-out loss, top-1 agreement per head position and rank-r hit rates (r < EVAL_RANKS)."""
    was_training = heads.training
    heads.eval()
    num_positions = heads.num_positions
    generator = torch.Generator().manual_seed(settings.seed + 7919)
    per_sample = max(1, settings.eval_rows // max(1, len(samples)))
    loss_sum, rows_total = 0.0, 0
    rank_hits = torch.zeros(num_positions, EVAL_RANKS)
    counted = torch.zeros(num_positions)
    path_hits, path_counted = torch.zeros(num_positions), torch.zeros(num_positions)
    tau_sum, tau_chains = 0.0, 0
    for sample in samples:
        batch = make_batch([sample], heads.input_layers, settings.max_seq_len, generator, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.dtype == "bf16"):
            anchors = max(settings.anchors_per_row, TAU_CHAINS_PER_SAMPLE)
            rows, labels = label_rows(batch, num_positions)
            features, is_anchor = run_heads(heads, batch, parts, generator, anchors, read_rows=chain_starts(batch, rows, heads.num_positions))  # [K, 1, T, H]
            path_rows, _ = label_rows(batch, num_positions, greedy_from=heads.greedy_path_from)
            chains, accepted = chain_acceptance(heads, batch, features, parts, is_anchor, generator)
            tau_sum += float(accepted.sum()) + chains
            tau_chains += chains
            if is_anchor is not None:
                keep = is_anchor[rows[:, 1], rows[:, 2]]
                rows, labels = rows[keep], labels[keep]
            on_path = torch.zeros(num_positions, batch.tokens.shape[1], dtype=torch.bool, device=rows.device)  # [K, T]
            on_path[path_rows[:, 0], path_rows[:, 2]] = True
            if rows.shape[0] > per_sample:
                pick = torch.randperm(rows.shape[0], generator=generator)[:per_sample].to(rows.device)
                rows, labels = rows[pick], labels[pick]
            for chunk in range(0, rows.shape[0], 512):
                part_rows, part_labels = rows[chunk : chunk + 512], labels[chunk : chunk + 512]
                logits = heads.label_logits(batch, features, part_rows, parts).float()
                # a label outside a reduced draft vocabulary (EAGLE-3) adds no loss but counts as missed
                loss_sum += float(F.cross_entropy(logits, heads.to_draft_indices(part_labels), reduction="sum", ignore_index=-100))
                rows_total += part_rows.shape[0]
                top = heads.to_target_ids(logits.topk(min(EVAL_RANKS, logits.shape[-1]), dim=-1).indices)  # [n, R] token ids
                hits = (top == part_labels[:, None]).float().cpu()  # [n, R]
                head = part_rows[:, 0].cpu()
                rank_hits[:, : hits.shape[1]].index_add_(0, head, hits)
                counted.index_add_(0, head, torch.ones(head.shape[0]))
                path = on_path[part_rows[:, 0], part_rows[:, 2]].cpu()  # [n]
                path_hits.index_add_(0, head[path], hits[path, 0])
                path_counted.index_add_(0, head[path], torch.ones(int(path.sum())))
    heads.train(was_training)
    rank_acc = (rank_hits / counted.clamp(min=1)[:, None]).tolist()
    return {
        "loss": loss_sum / max(1, rows_total),
        "top1": [row[0] for row in rank_acc],
        # top-1 agreement on the rows where the tokens before the label follow the target's greedy
        # path: the situation a draft token is judged in under greedy verification
        "top1_greedy_path": (path_hits / path_counted.clamp(min=1)).tolist(),
        "rank_acc": rank_acc,  # [K][r]: share of labels that are the head's rank-r candidate
        "rows": counted.long().tolist(),
        "rows_greedy_path": path_counted.long().tolist(),
        # mean tokens per greedy verify step of a K-token chain (accepted drafts + the target's own)
        "tau": tau_sum / max(1, tau_chains),
        "tau_chains": tau_chains,
    }


TAU_CHAINS_PER_SAMPLE = 32  # chain starts per held-out answer for the tau estimate


def chain_acceptance(heads: DraftHeads, batch: Batch, features: torch.Tensor, parts: FrozenTargetParts,
                     is_anchor: torch.Tensor | None, generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """(chains, accepted [chains]): greedy verification of the K-token chain drafted at answer
    positions t (anchors, or up to TAU_CHAINS_PER_SAMPLE random t) of a one-row batch: the number
    of leading head positions whose top-1 is the target's token while the text follows the target's
    greedy path (where the data leaves it, the draft could not have been judged further). Only
    starts whose K labels all lie in the answer count."""
    num_positions = heads.num_positions
    t = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)
    full = (t + num_positions + 1 < batch.lengths[0]) & (t + 2 >= batch.answer_start[0])  # [T]
    full &= batch.labels_supervised(num_positions)[0]  # in a conversation: labels in one assistant reply
    if is_anchor is not None:
        full &= is_anchor[0]
    starts = full.nonzero().squeeze(1)
    if is_anchor is None and starts.numel() > TAU_CHAINS_PER_SAMPLE:
        starts = starts[torch.randperm(starts.numel(), generator=generator)[:TAU_CHAINS_PER_SAMPLE].to(starts.device)]
    if starts.numel() == 0:
        return 0, torch.zeros(0)
    k_index = torch.arange(num_positions, device=starts.device).repeat_interleave(starts.numel())  # [K * n]
    chain_rows = torch.stack([k_index, torch.zeros_like(k_index), starts.repeat(num_positions)], dim=1)
    logits = heads.label_logits(batch, features, chain_rows, parts).float().view(num_positions, starts.numel(), -1)  # [K, n, V']
    proposed = heads.to_target_ids(logits.argmax(-1))  # [K, n]
    k = torch.arange(1, num_positions + 1, device=starts.device)[:, None]  # [K, 1]
    labels = batch.target_next[0, starts[None, :] + k]  # [K, n]: the target's token t + k + 1
    # the draft's tokens t + 2 .. t + k equal the data's only on the greedy path (tokens[i] == target_next[i - 1])
    greedy = batch.tokens[0, 1:] == batch.target_next[0, :-1]  # [T - 1]: token i + 1 is greedy
    on_path = torch.ones_like(labels, dtype=torch.bool)
    for depth in range(2, num_positions + 1):
        on_path[depth - 1] = on_path[depth - 2] & greedy[starts + depth - 1]
    accepted = ((proposed == labels) & on_path).long().cumprod(0).sum(0)  # [n]
    return int(starts.numel()), accepted.cpu().float()


def evaluate_by_source(heads: DraftHeads, samples: list[Sample], parts: FrozenTargetParts, settings: TrainSettings,
                       device) -> dict[str, dict]:
    """evaluate() on each prompt source's samples (Sample.source), plus "all": their rows pooled
    (top-1 agreement over every evaluated row, so long answers weigh more than in evaluate())."""
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.source or "unknown", []).append(sample)
    results = {name: evaluate(heads, group, parts, settings, device) for name, group in sorted(groups.items())}

    def pooled(rate_key: str, rows_key: str) -> tuple[list[float], list[int]]:
        rows = [sum(r[rows_key][k] for r in results.values()) for k in range(heads.num_positions)]
        hits = [sum(r[rate_key][k] * r[rows_key][k] for r in results.values()) for k in range(heads.num_positions)]
        return [h / max(1, n) for h, n in zip(hits, rows)], rows

    top1, rows = pooled("top1", "rows")
    on_path, path_rows = pooled("top1_greedy_path", "rows_greedy_path")
    chains = sum(r["tau_chains"] for r in results.values())
    tau = sum(r["tau"] * r["tau_chains"] for r in results.values()) / max(1, chains)
    results["all"] = {"top1": top1, "rows": rows, "top1_greedy_path": on_path, "rows_greedy_path": path_rows,
                      "tau": tau, "tau_chains": chains}
    for name, group in groups.items():
        results[name]["samples"] = len(group)
    results["all"]["samples"] = len(samples)
    return results


WARMUP_FRACTION = 0.05  # warmup also ends once this share of the horizon has passed (short timed runs)


def lr_factor(step: int, progress: float, settings: TrainSettings) -> float:
    """Linear warmup (warmup_steps, or 5% of the horizon if that is shorter), then cosine to min_lr_ratio."""
    warmup = min(1.0, max((step + 1) / max(1, settings.warmup_steps), progress / WARMUP_FRACTION))
    cosine = settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return warmup * cosine


COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384)


def rank_label_tokens(samples) -> tuple[list[int], list[int]]:
    """(token ids that are answer labels in `samples`, most frequent first; their counts)."""
    labels = [s.target_next[s.num_prompt_tokens - 1 : -1] for s in samples if s.num_prompt_tokens >= 1]
    if not labels:
        return [], []
    ids, counts = torch.unique(torch.cat(labels), return_counts=True)
    order = torch.argsort(counts, descending=True, stable=True)
    return ids[order].tolist(), counts[order].tolist()


def draft_vocab_summary(train_samples: list[Sample], eval_samples: list[Sample]) -> dict:
    """The checkpoint's "draft_vocab": training label tokens by frequency, and the share of held-out
    labels the first N of them cover (how much a reduced draft vocabulary can miss)."""
    ids, _ = rank_label_tokens(train_samples)
    held_out, held_out_counts = rank_label_tokens(eval_samples)
    rank_of = {token: rank for rank, token in enumerate(ids)}
    total = max(1, sum(held_out_counts))
    coverage = {}
    for size in (*[n for n in COVERAGE_SIZES if n < len(ids)], len(ids)):
        coverage[str(size)] = sum(c for t, c in zip(held_out, held_out_counts) if rank_of.get(t, size) < size) / total
    return {"ids": ids, "heldout_coverage": coverage}


def drop_repeated_prompts(samples: list[Sample]) -> tuple[list[Sample], int]:
    """(samples with one self-distilled answer per distinct prompt, how many were dropped).

    Two data jobs (other seeds, other directories) can draw the same prompt; its greedy answer is
    then the same text twice, and the held-out split would hold a copy of a training sample.
    Teacher-forced samples share their instruction prompt and are all kept."""
    seen: set[bytes] = set()
    kept = []
    for sample in samples:
        if not sample.teacher_forced:
            key = sample.tokens[: sample.num_prompt_tokens].to(torch.int64).numpy().tobytes()
            if key in seen:
                continue
            seen.add(key)
        kept.append(sample)
    return kept, len(samples) - len(kept)


def split_samples(samples: list[Sample], eval_fraction: float) -> tuple[list[Sample], list[Sample]]:
    """(train, held-out): a sample whose source fixes its side (Sample.held_out: ShareGPT, split by
    conversation) goes there; of the others, ceil(fraction * n) self-distilled samples, evenly
    spread over them, are held out (at least one when n >= 2); teacher-forced samples only ever
    train (held-out agreement is measured on the target's own answers, what drafting sees). Only
    teacher-forced data: held out from those. Nothing held out at all: the last training sample.

    Spread, not the last ones: the offline prompt mix is drawn from pools that run out at different
    times, so the tail of a large job is one source only (a 1440-prompt job ends with 144 code
    tasks) and would not be a sample of what the heads train on.
    """
    train_part, held_part = _spread_split([s for s in samples if s.held_out is None], eval_fraction)
    train_part = [s for s in samples if s.held_out is False] + train_part
    held_part = held_part + [s for s in samples if s.held_out]
    return train_part, held_part or train_part[-1:]


def _spread_split(samples: list[Sample], eval_fraction: float) -> tuple[list[Sample], list[Sample]]:
    own = [s for s in samples if not s.teacher_forced]
    corpus = [s for s in samples if s.teacher_forced]
    if not own:
        own, corpus = corpus, []
    if len(own) < 2 or eval_fraction <= 0:
        return corpus + own, own[-1:]  # too little data to hold any out: evaluate on the last sample
    num_eval = min(max(1, math.ceil(eval_fraction * len(own))), len(own) - 1)
    held = {int((i + 0.5) * len(own) / num_eval) for i in range(num_eval)}  # the middle of each 1/num_eval slice
    return corpus + [s for i, s in enumerate(own) if i not in held], [s for i, s in enumerate(own) if i in held]


# ----------------------------------------------------------------------------- the loop
def state_path_of(out_dir: Path) -> Path:
    return Path(out_dir) / STATE_FILE


def train(
    heads: DraftHeads,
    target,
    samples: list[Sample],
    out_dir: str | Path,
    settings: TrainSettings,
    target_info: dict,
    extra_config: dict | None = None,
    resume: bool = False,
    progress: bool = True,
    log=print,
    stop_after_steps: int | None = None,
) -> TrainResult:
    """Train `heads` on self-distilled `samples` and write a checkpoint to `out_dir` (see module doc).

    `stop_after_steps` ends this run after that many steps as if it were interrupted (the
    checkpoint and state are saved; a `resume=True` run continues the same schedule)."""
    settings.validate()
    # 1. the frozen target's parts, the heads on the device, the held-out split, the draft vocabulary, the optimizer
    out_dir = open_output_dir(out_dir, "checkpoint")  # never among files specdec did not write
    run = _TrainingRun(heads, target, samples, out_dir, settings, target_info, extra_config, progress)
    # 2. resume: the heads, optimizer, step, time and history an earlier run saved
    if resume:
        run.resume(log)
    corpus = sum(s.teacher_forced for s in run.train_samples)
    log(f"training {heads.kind} ({heads.num_positions} head positions, {sum(p.numel() for p in heads.parameters()) / 1e6:.2f}M "
        f"params) on {len(run.train_samples)} samples ({corpus} teacher-forced), held-out {len(run.eval_samples)}, "
        f"device {run.device}, {settings.dtype}")
    # 3. the held-out numbers before training
    if not run.history["eval"]:
        run.evaluate()
    # 4. steps until the step count, the time budget or stop_after_steps (Ctrl-C saves a resumable checkpoint)
    run.train_steps(progress, stop_after_steps, log)
    # 5. the held-out numbers after training, the final checkpoint and plot
    if run.history["eval"][-1]["step"] != run.step:
        run.evaluate()
    run.save(final=True)
    final_eval = run.history["eval"][-1]
    log(f"done: {run.step} steps; held-out loss {final_eval['loss']:.3f}, top-1 agreement per head "
        + ", ".join(f"{acc:.3f}" for acc in final_eval["top1"]) + " (on the greedy path: "
        + ", ".join(f"{acc:.3f}" for acc in final_eval["top1_greedy_path"]) + f"); {run.samples_per_minute():.1f} "
        f"training samples per minute; checkpoint in {run.out_dir}")
    return TrainResult(run.step, run.elapsed_s(), final_eval, run.out_dir, run.history)


class _TrainingRun:
    """One call of `train`: what its steps share (frozen target parts, data split, optimizer) and
    what it saves (step, time trained, history)."""

    def __init__(self, heads: DraftHeads, target, samples: list[Sample], out_dir: Path, settings: TrainSettings,
                 target_info: dict, extra_config: dict | None, progress: bool = True):
        self.heads, self.target, self.settings = heads, target, settings
        self.out_dir, self.target_info, self.extra_config = out_dir, target_info, extra_config or {}
        self.device = torch.device(settings.device)
        parts = FrozenTargetParts.from_target(target).to(self.device, torch.float32)
        if settings.dtype == "bf16":
            # autocast would re-cast the frozen [V, H] LM head to bf16 on every forward (it caches casts
            # of trainable weights only): ~17 % of a 1.5B EAGLE-1 step on CPU. The same bf16 copy, once.
            parts = parts.with_lm_head_dtype(torch.bfloat16)
        self.parts = parts
        heads.to(device=self.device, dtype=torch.float32).train()
        self.train_samples, self.eval_samples = split_samples(samples, settings.eval_fraction)
        if heads.reads_target_log_normaliser:  # once per run instead of the whole LM head in every step
            attach_target_log_normalisers(self.train_samples, parts, target.num_layers, self.device,
                                          settings.dtype == "bf16", settings.prompt_rows, progress)
        # the draft vocabulary (EAGLE-3's LM head, DSpark's loss vocabulary), before the optimizer; on
        # resume the loaded state then overwrites what the module stores of it (DSpark stores nothing)
        heads.fit_vocabulary(rank_label_tokens(self.train_samples)[0], target)
        self.vocab = None
        if settings.softmax_negatives and heads.reads_target_distribution:
            raise ValueError(f"{heads.kind} trains on its own reduced vocabulary: a sampled softmax does not apply")
        if settings.softmax_negatives:
            self.vocab = SampledVocab.from_samples(self.train_samples, parts.lm_head_weight.shape[0], settings.softmax_negatives)
        # fused: one pass per tensor instead of ~10 (5x faster on CPU for a 100M-parameter drafter)
        self.optimizer = torch.optim.AdamW(heads.parameters(), lr=settings.lr, betas=(0.9, 0.95),
                                           weight_decay=settings.weight_decay, fused=True)
        self.draft_vocab = draft_vocab_summary(self.train_samples, self.eval_samples)
        self.step, self.elapsed_before, self.history = 0, 0.0, {"train": [], "eval": []}
        self.started = time.perf_counter()  # restarted when the steps begin

    def resume(self, log) -> None:
        state_path = state_path_of(self.out_dir)
        if not state_path.is_file():
            log(f"nothing to resume in {self.out_dir}: starting from scratch")
            return
        state = torch.load(state_path, map_location=self.device, weights_only=False)
        if state["head"] != self.heads.head_config() or state["target_fingerprint"] != self.target_info["fingerprint"]:
            raise ValueError(f"{state_path} belongs to other heads or another target; use a new --out or drop --resume")
        self.heads.load_state_dict(state["heads"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed_before, self.history = state["step"], state["elapsed_s"], state["history"]
        log(f"resuming from step {self.step} ({self.elapsed_before / 60:.1f} min trained so far)")

    def samples_per_minute(self) -> float:
        """Training samples (batch rows) consumed per minute of training, evaluation included: beside the data's
        supervised positions per minute, it shows whether data or compute bounds a drafter."""
        return round(60 * self.step * self.settings.batch_size / max(self.elapsed_s(), 1e-9), 2)

    def elapsed_s(self) -> float:
        """Training time of this run and the runs it resumed."""
        return self.elapsed_before + (time.perf_counter() - self.started)

    def evaluate(self) -> None:
        self.history["eval"].append({"step": self.step, **evaluate(self.heads, self.eval_samples, self.parts, self.settings,
                                                                   self.device)})

    def train_steps(self, progress: bool, stop_after_steps: int | None, log) -> None:
        """Optimizer steps until the step count, the time budget or `stop_after_steps`; evaluates and
        saves every eval_every / save_every steps."""
        from tqdm.auto import tqdm

        settings = self.settings
        self.started = time.perf_counter()
        budget_s = settings.minutes * 60 if settings.minutes is not None else math.inf
        stop_at = math.inf if stop_after_steps is None else self.step + stop_after_steps
        bar = tqdm(total=settings.steps, initial=self.step, desc=f"train {self.heads.kind}", unit="step", disable=not progress)
        try:
            while ((settings.steps is None or self.step < settings.steps) and self.elapsed_s() < budget_s
                   and self.step < stop_at):
                loss, accuracy = self.train_step(budget_s)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", head1=f"{accuracy[0]:.2f}")
                if self.step % settings.eval_every == 0:
                    self.evaluate()
                if self.step % settings.save_every == 0:
                    self.save(final=False)
        except KeyboardInterrupt:
            bar.close()
            self.save(final=True)
            log(f"interrupted at step {self.step}: checkpoint saved in {self.out_dir} (continue with --resume)")
            raise
        bar.close()

    def train_step(self, budget_s: float) -> tuple[float, list[float]]:
        """One optimizer step on a batch seeded by (seed, step): (loss, top-1 accuracy per head position)."""
        settings, heads = self.settings, self.heads
        progress_fraction = max(self.step / settings.steps if settings.steps else 0.0, self.elapsed_s() / budget_s)
        for group in self.optimizer.param_groups:
            group["lr"] = settings.lr * lr_factor(self.step, progress_fraction, settings)
        generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + self.step)
        picks = torch.randint(0, len(self.train_samples), (settings.batch_size,), generator=generator).tolist()
        top_layer = self.target.num_layers if settings.feature_weight > 0 or heads.reads_target_distribution else None
        batch = make_batch([self.train_samples[i] for i in picks], heads.input_layers, settings.max_seq_len, generator,
                           self.device, top_layer=top_layer, prompt_rows=settings.prompt_rows)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=settings.dtype == "bf16"):
            loss, correct, counted = heads_loss(heads, batch, self.parts, settings, generator, self.vocab)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), settings.grad_clip)
        self.optimizer.step()
        self.step += 1
        loss_value = loss.item()
        del batch, loss  # the graph's tensors, before the trim
        release_freed_memory()
        accuracy = (correct / counted.clamp(min=1)).tolist()
        self.history["train"].append({"step": self.step, "loss": loss_value, "top1": accuracy,
                                      "lr": self.optimizer.param_groups[0]["lr"]})
        return loss_value, accuracy

    def save(self, final: bool) -> None:
        """The checkpoint (heads + config + latest held-out numbers), the resumable state and the history;
        the plot when final."""
        summary = {"steps": self.step, "elapsed_s": self.elapsed_s(), "samples_per_minute": self.samples_per_minute(),
                   "settings": asdict(self.settings)}
        save_checkpoint(self.out_dir, self.heads, self.target_info, {**self.extra_config, "training": summary,
                                                                     "eval": self.history["eval"][-1],
                                                                     "draft_vocab": self.draft_vocab})
        torch.save({"step": self.step, "heads": self.heads.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "history": self.history, "elapsed_s": summary["elapsed_s"], "head": self.heads.head_config(),
                    "target_fingerprint": self.target_info["fingerprint"]}, state_path_of(self.out_dir))
        (self.out_dir / HISTORY_FILE).write_text(json.dumps(self.history))
        if final:
            plot_history(self.history, self.out_dir / PLOT_FILE, self.heads.kind)


def plot_history(history: dict, path: Path, title: str) -> None:
    """Loss (train + held-out) and held-out top-1 agreement per head position vs step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    train_points = history["train"]
    if train_points:
        loss_ax.plot([p["step"] for p in train_points], [p["loss"] for p in train_points], alpha=0.5, label="train")
    eval_points = history["eval"]
    loss_ax.plot([p["step"] for p in eval_points], [p["loss"] for p in eval_points], "o-", label="held-out")
    loss_ax.set(xlabel="step", ylabel="cross-entropy", title=f"{title}: loss")
    loss_ax.legend()
    num_positions = len(eval_points[-1]["top1"]) if eval_points else 0
    for head in range(num_positions):
        acc_ax.plot([p["step"] for p in eval_points], [p["top1"][head] for p in eval_points], "o-", label=f"head {head + 1} (t+{head + 2})")
    acc_ax.set(xlabel="step", ylabel="top-1 agreement", title="held-out agreement with the target", ylim=(0, 1))
    acc_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
