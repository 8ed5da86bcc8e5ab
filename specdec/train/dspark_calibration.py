"""DSpark after training: held-out block statistics and sequential temperature scaling.

`evaluate_blocks` drafts teacher-forced blocks at answer positions of held-out samples (every
block's K labels inside the answer, at most BLOCKS_PER_SAMPLE per sample) with the exact q
(backbone logits + the sequential bias given the previous token) and measures:
  * tau: greedy verification of the K-token chain, 1 + the number of leading positions whose argmax
    is the target's token while the text stays on the target's greedy path (the dflash trainer's
    definition, so the two are comparable);
  * per-position acceptance: the mean analytic acceptance 1 - TV(q_k, p_k) of a SAMPLED token at
    temperature 1, over blocks whose earlier positions are on the greedy path;
  * the confidence logits and those acceptances, for calibration.

`calibrate` fits the per-position temperatures on one half of the held-out samples and reports the
survival ECE (prod c vs prod acceptance, per position) before and after on the other half, then
stores the temperatures in the module (and `calibrate_checkpoint` in the checkpoint, with the report).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..heads import DSparkModule, FrozenTargetParts, read_checkpoint_config, save_checkpoint
from ..heads.dspark_module import analytic_acceptance, fit_sequential_temperatures, survival_ece, target_on_vocabulary
from .batches import label_rows, make_batch
from .data import Sample
from .trainer import TrainSettings

BLOCKS_PER_SAMPLE = 32
CALIBRATION_FILE = "calibration.json"
_CHECKPOINT_KEYS = ("format", "format_version", "drafter", "head", "label_convention", "target")


@torch.no_grad()
def evaluate_blocks(module: DSparkModule, samples: list[Sample], parts: FrozenTargetParts, settings: TrainSettings,
                    device) -> dict:
    """Held-out tau, per-position acceptance, and the raw (confidence logits, acceptance, valid) [N, K]."""
    was_training = module.training
    module.eval()
    generator = torch.Generator().manual_seed(settings.seed + 104729)
    num_positions = module.num_positions
    logits_all, acceptance_all, valid_all, accepted_all = [], [], [], []
    for sample in samples:
        batch = make_batch([sample], module.input_layers, settings.max_seq_len, generator, device,
                           top_layer=module.target_num_layers)
        t = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)
        full = (t + num_positions + 1 < batch.lengths[0]) & (t + 2 >= batch.answer_start[0])  # [T]: K labels in the answer
        full &= batch.labels_supervised(num_positions)[0]  # in a conversation: labels in one assistant reply
        starts = full.nonzero().squeeze(1)
        if starts.numel() == 0:
            continue
        if starts.numel() > BLOCKS_PER_SAMPLE:
            starts = starts[torch.randperm(starts.numel(), generator=generator)[:BLOCKS_PER_SAMPLE].to(starts.device)].sort().values
        features = module(batch.hidden, batch.tokens, batch.positions, parts, anchors=starts[None])  # [K, 1, T, H]
        rows, _ = label_rows(batch, num_positions, greedy_from=module.greedy_path_from)  # on the target's greedy path
        valid, _ = module.valid_blocks(batch, rows)
        anchors = torch.stack([torch.zeros_like(starts), starts], dim=1)  # [N, 2]
        blocks = module.anchor_blocks(batch, features, anchors, valid)
        draft_logits, confidence = module.block_logits(blocks, parts)  # [N, K, V'] over module.draft_ids, [N, K]
        target_probs, outside = target_on_vocabulary(parts.lm_head(blocks["top"]), module.draft_ids)  # [N, K, V'], [N, K]
        acceptance = analytic_acceptance(F.softmax(draft_logits.float(), dim=-1), target_probs, outside)  # [N, K]
        hits = (module.to_target_ids(draft_logits.argmax(-1)) == blocks["labels"]) & blocks["valid"]
        accepted_all.append(hits.long().cumprod(-1).sum(-1).cpu())
        logits_all.append(confidence.float().cpu())
        acceptance_all.append(acceptance.cpu())
        valid_all.append(blocks["valid"].cpu())
    module.train(was_training)
    if not logits_all:
        raise ValueError("no held-out answer is long enough for one DSpark block: generate longer answers or more data")
    accepted, valid = torch.cat(accepted_all), torch.cat(valid_all)
    acceptance = torch.cat(acceptance_all)
    counted = valid.sum(0).clamp(min=1)
    return {
        "tau": 1.0 + float(accepted.float().mean()),
        "blocks": int(accepted.numel()),
        "acceptance": ((acceptance * valid).sum(0) / counted).tolist(),  # [K] mean 1 - TV where the prefix is on path
        "greedy_accept": [float((accepted > k).float().mean()) for k in range(num_positions)],  # P(position k accepted)
        "confidence_logits": torch.cat(logits_all), "acceptance_raw": acceptance, "valid": valid,
    }


def calibrate(module: DSparkModule, samples: list[Sample], parts: FrozenTargetParts, settings: TrainSettings,
              device) -> dict:
    """Fit the temperatures on the even held-out samples, report survival ECE before / after on the
    odd ones (both halves are the same sample when there is only one), set them in the module."""
    fit_samples, report_samples = samples[0::2], samples[1::2] or samples[0::2]
    fit = evaluate_blocks(module, fit_samples, parts, settings, device)
    report = evaluate_blocks(module, report_samples, parts, settings, device)
    temperatures = fit_sequential_temperatures(fit["confidence_logits"], fit["acceptance_raw"], fit["valid"])
    ones = torch.ones_like(temperatures)
    before = survival_ece(report["confidence_logits"], report["acceptance_raw"], ones, report["valid"])
    after = survival_ece(report["confidence_logits"], report["acceptance_raw"], temperatures, report["valid"])
    module.sequential.confidence_temperatures.copy_(temperatures.to(module.sequential.confidence_temperatures))
    everything = evaluate_blocks(module, samples, parts, settings, device)
    return {
        "temperatures": temperatures.tolist(),
        "ece_before": before, "ece_after": after,
        "ece_before_mean": sum(before) / len(before), "ece_after_mean": sum(after) / len(after),
        "fit_blocks": fit["blocks"], "report_blocks": report["blocks"],
        "tau": everything["tau"], "blocks": everything["blocks"], "acceptance": everything["acceptance"],
        "greedy_accept": everything["greedy_accept"],
    }


def calibrate_checkpoint(module: DSparkModule, samples: list[Sample], parts: FrozenTargetParts, settings: TrainSettings,
                         out_dir: str | Path, device="cpu") -> dict:
    """`calibrate`, then rewrite the checkpoint in `out_dir` with the temperatures and the report
    (config.json "calibration", and calibration.json beside it)."""
    out_dir = Path(out_dir)
    report = calibrate(module, samples, parts, settings, torch.device(device))
    config = read_checkpoint_config(out_dir)
    extra = {key: value for key, value in config.items() if key not in _CHECKPOINT_KEYS}
    save_checkpoint(out_dir, module, config["target"], {**extra, "calibration": report})
    (out_dir / CALIBRATION_FILE).write_text(json.dumps(report, indent=2))
    return report


def describe(report: dict) -> str:
    """The report as the trainer prints it."""
    fmt = lambda values: " ".join(f"{v:.3f}" for v in values)  # noqa: E731
    return (f"held-out tau {report['tau']:.3f} over {report['blocks']} blocks (greedy chain of {len(report['acceptance'])})\n"
            f"  acceptance per position (1 - TV, sampled):  {fmt(report['acceptance'])}\n"
            f"  P(position accepted), greedy:              {fmt(report['greedy_accept'])}\n"
            f"  survival ECE per position before:          {fmt(report['ece_before'])}  (mean {report['ece_before_mean']:.4f})\n"
            f"  survival ECE per position after:           {fmt(report['ece_after'])}  (mean {report['ece_after_mean']:.4f})\n"
            f"  temperatures:                              {fmt(report['temperatures'])}")
