"""Self-speculative drafting with a subset of the target's own layers (`layer-skip`).

The draft model is the target with most blocks skipped: its embeddings, the chosen blocks (by
default the first ~quarter), the final norm and the LM head — the same weights, no extra memory
except the draft's own KV cache (one slot per chosen block). Drafting itself (chain / tree, greedy
one-hot or sampled with the exact q) is `ModelDrafter`'s, shared with `small-model`.

Needs a native target (`target.forward(..., layer_ids=[...])`, specdec.models.llama).
"""

from __future__ import annotations

import dataclasses
import inspect

from ..checks import check_int
from .base import register_drafter
from .small_model import DraftLM, ModelDrafter, decode_cost_bytes, model_logits

DEFAULT_LAYER_FRACTION = 0.25  # default draft depth: the first quarter of the target's blocks


def default_num_layers(total_layers: int) -> int:
    return max(1, round(total_layers * DEFAULT_LAYER_FRACTION))


def resolve_layer_ids(total_layers: int, num_layers: int | None, layers: list[int] | None) -> list[int]:
    """The block indices the draft runs: `layers` as given, else the first `num_layers` (default ~1/4)."""
    if layers is not None and num_layers is not None:
        raise ValueError("give either num_layers (the first n blocks) or layers (a list of block ids), not both")
    if layers is None:
        count = default_num_layers(total_layers) if num_layers is None else num_layers
        check_int("num_layers (the target's blocks to run)", count, 1, total_layers)
        return list(range(count))
    layer_ids = list(layers)
    if not layer_ids:
        raise ValueError("layers must list at least one block id")
    for layer in layer_ids:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < total_layers:
            raise ValueError(f"layer id {layer!r} is out of range: ids must be integers in [0, {total_layers - 1}]")
    if any(b <= a for a, b in zip(layer_ids, layer_ids[1:])):
        raise ValueError(f"layers must be strictly increasing block ids, got {layer_ids}")
    return layer_ids


def _supports_layer_ids(target) -> bool:
    try:
        return "layer_ids" in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        return False


@register_drafter
class LayerSkipDrafter(ModelDrafter):
    """Draft with the target's own first blocks (or any increasing subset) + final norm + LM head.

    num_layers: run the first n blocks (default ~1/4 of the target's blocks).
    layers: or an explicit increasing list of block ids, e.g. [0, 1, 2, 3, 28, 29].
    gamma / tree / tree_* / sample / context: see ModelDrafter and `small-model`.
    """

    name = "layer-skip"

    def __init__(
        self,
        target=None,
        num_layers: int | None = None,
        layers: list[int] | None = None,
        gamma: int = 4,
        tree: bool = False,
        tree_nodes: int = 8,
        tree_depth: int = 4,
        tree_topk: int = 3,
        tree_beam: int = 1,
        sample: bool = True,
        context: int = 0,
    ):
        super().__init__(gamma, tree, tree_nodes, tree_depth, tree_topk, tree_beam, sample, context)
        if target is None:
            raise ValueError("layer-skip drafts with the target's own layers: pass the target")
        if not _supports_layer_ids(target):
            raise ValueError(
                f"layer-skip needs a native target whose forward() takes layer_ids (Llama/Qwen/Mistral "
                f"family on specdec's own runtime); {type(target).__name__} {getattr(target, 'name', '')!r} does not"
            )
        self.target = target
        self.layer_ids = resolve_layer_ids(target.num_layers, num_layers, layers)
        self.cost = dataclasses.replace(self.cost, per_token=self._estimate_cost())

    def _estimate_cost(self) -> float:
        """Weight bytes read per draft step / per target step (blocks + head; embeddings are lookups)."""
        total = decode_cost_bytes(self.target)
        blocks = getattr(getattr(getattr(self.target, "model", None), "model", None), "layers", None)
        if blocks is None or total != total:  # no module tree to measure: count blocks only
            return len(self.layer_ids) / self.target.num_layers
        block_bytes = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks]
        skipped = sum(block_bytes) - sum(block_bytes[i] for i in self.layer_ids)
        return (total - skipped) / total

    def _new_draft_lm(self, capacity: int) -> DraftLM:
        target, layer_ids = self.target, self.layer_ids

        def forward(tokens, positions, cache, attn_mask, last_only):
            return model_logits(target, tokens, positions, cache, attn_mask, last_only, layer_ids=layer_ids)

        def new_cache(max_len: int):
            return target.new_cache(1, max_len, num_layers=len(layer_ids))

        return DraftLM(forward, new_cache, target.vocab_size, capacity, window=self.context)
