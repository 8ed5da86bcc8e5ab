"""Trained drafters: self-distillation data, the head modules and one shared training loop.

    specdec train data   --model NAME --out DIR      # the target answers offline prompts
    specdec train data   --model NAME --out DIR --corpus FILES   # teacher-forced text
    specdec train data   --model NAME --out DIR --conversations sharegpt   # teacher-forced ShareGPT
    specdec train medusa --model NAME --data DIR --out CKPT
    specdec train mtp    --model NAME --data DIR --out CKPT --flavour parallel|sequential
    specdec train eagle1|eagle3 --model NAME --data DIR --out CKPT   # data: `train data --for eagle3` for EAGLE-3
    specdec train dflash|dspark --model NAME --data DIR --out CKPT   # data: `train data --for dflash`

Modules: prompts (offline prompt sources), data (generation + reading), teacher_forced (corpus and
conversation data), sharegpt (the ShareGPT reader), trainer (the loop), cli.
The trainable modules and their checkpoints live on the model side, in specdec.heads (shared with
the `medusa` / `mtp` / `eagle1` / `eagle3` / `dflash` / `dspark` drafters).
"""

from .data import DataSettings, build_dataset, load_samples
from .teacher_forced import CorpusSettings, build_corpus_dataset
from ..heads import HEAD_TYPES, FrozenTargetParts, build_heads, load_checkpoint, save_checkpoint, target_fingerprint
from .trainer import TrainSettings, train

__all__ = [
    "HEAD_TYPES", "CorpusSettings", "DataSettings", "FrozenTargetParts", "TrainSettings", "build_corpus_dataset",
    "build_dataset", "build_heads",
    "load_checkpoint", "load_samples", "save_checkpoint", "target_fingerprint", "train",
]
