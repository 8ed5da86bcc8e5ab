"""What each part of a DSpark drafter's q contributes: held-out top-1 per block position of the exact
q (backbone logits + the sequential head's bias), the backbone's logits alone, and the bias alone
(the sequential head given the teacher-forced previous token: a bigram for a Markov head).

    python scripts/dspark_parts.py --checkpoint OUT --data DATA [--model qwen2.5-coder-1.5b]

Blocks at up to --blocks random answer positions per held-out conversation (the trainer's split),
rows counted while the text before them stays on the target's greedy path (as the trainer's numbers).
"""

from __future__ import annotations

import argparse

import torch

from specdec.api import load_target
from specdec.heads import FrozenTargetParts
from specdec.heads.checkpoint import load_checkpoint
from specdec.train import load_samples
from specdec.train.batches import label_rows, make_batch
from specdec.train.trainer import TrainSettings, split_samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a `specdec train dspark` checkpoint")
    parser.add_argument("--data", required=True, help="the data it was trained on (its held-out split is read)")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", default=None, help="the target's weights (default: the model's own default)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per held-out conversation")
    args = parser.parse_args(argv)

    target = load_target(args.model, weights=args.weights, progress=False)
    module, config = load_checkpoint(args.checkpoint, target, drafter="dspark")
    module = module.float().eval()
    module.fit_vocabulary(config["draft_vocab"]["ids"], target)  # the q that was trained lives on this vocabulary
    _, samples = load_samples(args.data, sorted({*module.input_layers, target.num_layers}), target)
    held_out = split_samples(samples, TrainSettings().eval_fraction)[1]
    parts = FrozenTargetParts.from_target(target).to(dtype=torch.float32)
    vocab_parts = parts.with_lm_rows(module.draft_ids)
    positions = module.num_positions
    hits = {name: torch.zeros(positions) for name in ("exact q", "backbone", "sequential bias")}
    counted = torch.zeros(positions)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for sample in held_out:
            batch = make_batch([sample], module.input_layers, 512, generator, "cpu", top_layer=target.num_layers)
            rows, _ = label_rows(batch, positions, greedy_from=module.greedy_path_from)
            valid, anchors = module.valid_blocks(batch, rows)  # anchors [A, 2] (b, t)
            if anchors.shape[0] == 0:
                continue
            anchors = anchors[torch.randperm(anchors.shape[0], generator=generator)[: args.blocks]]
            features = module(batch.hidden, batch.tokens, batch.positions, parts, anchors=anchors[:, 1][None])
            blocks = module.anchor_blocks(batch, features, anchors, valid)
            exact, _ = module.block_logits(blocks, parts)  # [N, K, V']
            hidden = blocks["hidden"]  # [N, K, H]
            backbone = vocab_parts.lm_head(hidden.reshape(-1, hidden.shape[-1])).view_as(exact)
            for name, logits in (("exact q", exact), ("backbone", backbone), ("sequential bias", exact - backbone)):
                right = module.to_target_ids(logits.argmax(-1)) == blocks["labels"]
                hits[name] += (right & blocks["valid"]).sum(0).float()
            counted += blocks["valid"].sum(0).float()
    print(f"{len(held_out)} held-out conversations; rows per position {counted.long().tolist()}")
    print("top-1 per position:")
    for name, value in hits.items():
        print(f"  {name:16s}", " ".join(f"{rate:.3f}" for rate in (value / counted.clamp(min=1)).tolist()))


if __name__ == "__main__":
    main()
