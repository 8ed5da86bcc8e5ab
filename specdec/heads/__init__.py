"""Draft head modules on a frozen target (Medusa, MTP, EAGLE-1, EAGLE-3, DFlash, DSpark) and their checkpoints.

Model-side code: the `medusa` / `mtp` drafters load and run these modules, and the trainer
(specdec.train) builds and optimises the same classes. Both import from here; drafters never
import the trainer.
"""

from .checkpoint import (
    CONFIG_FILE, check_target_matches, load_checkpoint, read_checkpoint_config, save_checkpoint, target_description,
    target_fingerprint,
)
from .target_parts import DRAFT_WEIGHTS, DraftVocab, FrozenTargetParts, draft_linears
from .modules import (
    HEAD_TYPES, LABEL_CONVENTION, ChainedModule, DraftHeads, MedusaHeads, MTPParallelHeads, MTPSequentialModule, build_heads,
    grow_cache,
)
from .eagle import DEFAULT_EAGLE3_VOCAB, Eagle1Module, Eagle3Module, eagle3_config, eagle3_layers
from .dflash import DFlashModule, dflash_hidden_layers, dflash_target_layer_ids
from .dspark_module import DSparkModule

__all__ = [
    "CONFIG_FILE", "DRAFT_WEIGHTS", "draft_linears", "ChainedModule", "DFlashModule", "DSparkModule", "dflash_hidden_layers", "dflash_target_layer_ids", "DEFAULT_EAGLE3_VOCAB", "HEAD_TYPES", "Eagle1Module", "Eagle3Module", "eagle3_config", "eagle3_layers", "LABEL_CONVENTION", "DraftHeads", "DraftVocab", "FrozenTargetParts", "MTPParallelHeads",
    "MTPSequentialModule", "MedusaHeads", "build_heads", "check_target_matches", "grow_cache", "load_checkpoint",
    "read_checkpoint_config", "save_checkpoint", "target_description", "target_fingerprint",
]
