"""DFlash (block diffusion drafting): one forward drafts a whole block of tokens.

The block is [anchor, MASK x (block_size - 1)] at positions p .. p + block_size - 1: the anchor is
the newest committed token (the loop's root, not yet in the target's cache) and MASK the target's
frozen embedding of `mask_token_id`. A few decoder layers run over the block with NON-causal
attention (every block row sees every other one), and each layer also attends to the target's
context: hidden states of several target layers at positions < p, concatenated -> fc ->
hidden_norm, projected by that layer's own k_proj / v_proj (+ k_norm, rope at their positions).
Queries come from the block only. The final norm's output of block row k is read by the target's
frozen LM head and proposes token p + k (k = 1 .. block_size - 1).

Layers are Qwen3-shaped (q_norm / k_norm per head) whatever the target family, so parameter names
ARE the `DFlashDraftModel` layout SGLang and vLLM load (see export.py): fc, hidden_norm,
layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}, norm. The target's embeddings and LM head are
never stored.

Fused target layers: `dflash_target_layer_ids` spreads one per draft layer evenly over target
blocks [1, N - 3] (0-based block ids, the engines' `target_layer_ids`); specdec's hidden-layer
index of block id i is i + 1 (0 = embeddings, i = output of block i).

Label convention (modules.LABEL_CONVENTION): with the context up to position t and the anchor =
token t + 1, block row k (head position k) predicts token t + k + 1. `prediction_offset` = 1 here;
a subclass with offset 0 (DSpark) treats the anchor row itself as the first prediction position
(`block_hidden` then returns rows 0 .. K - 1 of a block of K rows).
"""

from __future__ import annotations

import torch
from torch import nn

from ..checks import check_int, check_positive_int
from ..kernels.backends import rotate_half
from ..models.llama import Block, RMSNorm
from .modules import DraftHeads, TargetRope, register_head_type
from .target_parts import FrozenTargetParts, dense_state_dict

DEFAULT_BLOCK_SIZE = 8
# the anchor-feature variant's input layout as checkpoints name it: the anchor row's embedding through its own
# RMSNorm plus the newest context state. The first layout (the raw embedding plus the state, `true` in
# checkpoints) is retired: the state (RMS ~1) drowned the embedding (RMS ~0.017 on Qwen2.5).
ANCHOR_FEATURE_LAYOUT = "normed-embedding"
DEFAULT_DRAFT_LAYERS = 3
_DRAFT_CONFIG_KEYS = (  # what a checkpoint stores to rebuild the module without its target (export)
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "rope_parameters", "max_position_embeddings", "num_hidden_layers",
)


def dflash_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """0-based target block ids, one per draft layer, evenly spread over [1, N - 3] (one layer: N // 2)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, max(1, num_target_layers - 3)
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def dflash_hidden_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The same layers in specdec's hidden-layer convention (output of block i = hidden layer i + 1)."""
    return tuple(i + 1 for i in dflash_target_layer_ids(num_target_layers, num_draft_layers))


def dflash_config(target_config, num_draft_layers: int, intermediate_size: int | None = None):
    """The drafter's own Qwen3 config: the target's attention shape, rope and eps, `num_draft_layers` layers."""
    from transformers import Qwen3Config

    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    rope = dict(getattr(target_config, "rope_parameters", None) or {"rope_type": "default"})
    rope.setdefault("rope_theta", getattr(target_config, "rope_theta", 10000.0))
    return Qwen3Config(
        vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
        intermediate_size=intermediate_size or target_config.intermediate_size, num_hidden_layers=num_draft_layers,
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        head_dim=head_dim, rms_norm_eps=target_config.rms_norm_eps, rope_parameters=rope, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False,
        max_position_embeddings=getattr(target_config, "max_position_embeddings", 4096),
    )


def default_mask_token_id(embed_weight: torch.Tensor) -> int:
    """The highest token id with a non-zero embedding row (usually an unused or special token).

    A zero MASK embedding would make every mask row's query zero after the norms, i.e. the rows
    identical; any fixed non-zero row works, the draft layers learn what it means."""
    nonzero = (embed_weight.detach().abs().amax(dim=-1) > 0).nonzero()
    if nonzero.numel() == 0:
        raise ValueError("the target's embedding table is all zeros: no usable MASK token")
    return int(nonzero[-1])


class ContextKeys:
    """Duck-typed KVCache for one block pass: each layer's keys = its context keys + the block's.

    `context[layer]` = (keys, values) [B, H_kv, S, D] of the context rows (rope applied)."""

    def __init__(self, context: list[tuple[torch.Tensor, torch.Tensor]]):
        self.context = context

    def write(self, layer_slot: int, keys: torch.Tensor, values: torch.Tensor):
        context_keys, context_values = self.context[layer_slot]
        return torch.cat([context_keys, keys], dim=2), torch.cat([context_values, values], dim=2)


def anchor_feature_of(config: dict) -> bool:
    """Whether a head config (build_heads' options: a bool; a checkpoint's: the layout's name) uses the
    anchor-feature variant. A checkpoint of the retired layout (`true`) has no anchor_norm weights, so
    loading it fails on the missing `anchor_norm.weight` instead of drafting with other rows."""
    layout = config.get("anchor_feature", False)
    if layout not in (False, True, None, ANCHOR_FEATURE_LAYOUT):
        raise ValueError(f"unknown anchor_feature layout {layout!r} (this specdec knows {ANCHOR_FEATURE_LAYOUT!r})")
    return bool(layout)


@register_head_type
class DFlashModule(DraftHeads):
    """fc + hidden_norm over fused target layers, `num_draft_layers` Qwen3 blocks over the block, norm."""

    kind = "dflash"
    drafter = "dflash"
    tokens_read_ahead = 1  # the anchor (token t + 1) is committed when the block is drafted
    prediction_offset = 1  # block row 0 is the anchor; rows 1 .. K predict (DSpark: 0)
    trains_on_anchors = True  # the trainer samples anchors (TrainSettings.anchors_per_row)

    def __init__(self, target_config, block_size: int = DEFAULT_BLOCK_SIZE, num_draft_layers: int = DEFAULT_DRAFT_LAYERS,
                 mask_token_id: int | None = None, intermediate_size: int | None = None,
                 input_layers: tuple[int, ...] | None = None, anchor_feature: bool = False):
        block_size = check_int("block_size", block_size, 1 + self.prediction_offset, 256)
        num_draft_layers = check_positive_int("num_draft_layers", num_draft_layers)
        super().__init__(input_layer=0, num_positions=block_size - self.prediction_offset)
        self.block_size = block_size
        # specdec's variant (not in the published layouts): the anchor row also adds its newest context
        # state to its input, as EAGLE's rows do, instead of reaching it only through attention
        # (docs/dspark.md, "Why it trails EAGLE-3 on a CPU budget")
        self.anchor_feature = bool(anchor_feature)
        # None: chosen from the target's embeddings by init_from_target (default_mask_token_id)
        self.mask_token_id = None if mask_token_id is None else check_int("mask_token_id", mask_token_id, 0,
                                                                          target_config.vocab_size - 1)
        self.target_num_layers = target_config.num_hidden_layers
        self.fused_layers = tuple(input_layers or dflash_hidden_layers(self.target_num_layers, num_draft_layers))
        if not all(1 <= layer <= self.target_num_layers for layer in self.fused_layers):
            raise ValueError(f"fused target layers {[layer - 1 for layer in self.fused_layers]} (0-based block ids) must "
                             f"lie in 0 .. {self.target_num_layers - 1}: the target has {self.target_num_layers} blocks")
        self.config = dflash_config(target_config, num_draft_layers, intermediate_size)
        hidden_size = target_config.hidden_size
        self.fc = nn.Linear(len(self.fused_layers) * hidden_size, hidden_size, bias=False)
        self.hidden_norm = RMSNorm(hidden_size, target_config.rms_norm_eps)
        self.layers = nn.ModuleList(Block(self.config, qk_norm=True, qkv_bias=False) for _ in range(num_draft_layers))
        self.norm = RMSNorm(hidden_size, target_config.rms_norm_eps)
        self.rope = TargetRope(self.config)
        # the anchor row's embedding at the scale of the state it is added to (anchor_feature only)
        self.anchor_norm = RMSNorm(hidden_size, target_config.rms_norm_eps) if self.anchor_feature else None

    @classmethod
    def from_config(cls, config: dict, target_config) -> DFlashModule:
        """From a checkpoint's head config; target_config None: from the Qwen3 config it stores (export)."""
        if target_config is None:
            from transformers import Qwen3Config

            target_config = Qwen3Config.from_dict(config["draft_config"])
            target_config.num_hidden_layers = config["target_num_layers"]
        block_size = config.get("block_size", config["num_positions"] + cls.prediction_offset)
        input_layers = config.get("input_layers")
        return cls(target_config, block_size, config.get("num_draft_layers", DEFAULT_DRAFT_LAYERS),
                   config.get("mask_token_id"), config.get("intermediate_size"),
                   tuple(input_layers) if input_layers else None, anchor_feature_of(config))

    @property
    def input_layers(self) -> tuple[int, ...]:
        return self.fused_layers

    @property
    def target_layer_ids(self) -> list[int]:
        """The fused layers as 0-based target block ids (the engines' dflash_config.target_layer_ids)."""
        return [layer - 1 for layer in self.fused_layers]

    def head_config(self) -> dict:
        return {**super().head_config(), "block_size": self.block_size, "num_draft_layers": len(self.layers),
                "mask_token_id": self.mask_token_id, "input_layers": list(self.fused_layers),
                # only when set: checkpoints written before the option existed still resume
                **({"anchor_feature": ANCHOR_FEATURE_LAYOUT} if self.anchor_feature else {}),
                "intermediate_size": self.config.intermediate_size, "target_num_layers": self.target_num_layers,
                "draft_config": {key: value for key, value in self.config.to_dict().items() if key in _DRAFT_CONFIG_KEYS}}

    def init_from_target(self, target) -> None:
        """Layers start as copies of the target's last blocks with their output projections zeroed
        (the identity on the residual stream), fc passes the highest fused layer through, and norm
        is the target's final norm: at step 0 every row reads like the target's logit lens."""
        parts = FrozenTargetParts.from_target(target)
        if self.mask_token_id is None:
            self.mask_token_id = default_mask_token_id(parts.embed_weight)
        blocks = target.model.model.layers
        hidden_size = self.fc.weight.shape[0]
        with torch.no_grad():
            for layer, source in zip(self.layers, blocks[len(blocks) - len(self.layers):]):
                state = dense_state_dict(source)
                # q_norm / k_norm stay ones on targets without them; Qwen2's q/k/v biases have no place in the layout
                layer.load_state_dict(state, strict=False)
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            self.fc.weight.zero_()
            self.fc.weight[:, -hidden_size:].copy_(torch.eye(hidden_size))
            self.norm.weight.copy_(parts.final_norm_weight.float())

    # ---- the computation
    def context_states(self, features: torch.Tensor) -> torch.Tensor:
        """Fused target features [..., F*H] -> the context every layer reads [..., H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, states: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context states [B, S, H] at positions [B, S] -> per layer (keys, values) [B, H_kv, S, D], rope applied."""
        batch, length, _ = states.shape
        cos, sin = self.rope(positions, states.dtype)  # [B, 1, S, D]
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            keys = attn.k_norm(attn.k_proj(states).view(batch, length, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
            values = attn.v_proj(states).view(batch, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            out.append((keys * cos + rotate_half(keys) * sin, values))
        return out

    def run_block(self, block_tokens: torch.Tensor, block_positions: torch.Tensor, cache, mask: torch.Tensor | None,
                  parts: FrozenTargetParts, anchor_states: torch.Tensor | None = None) -> torch.Tensor:
        """Block rows [B, N] (token ids, MASK included; N = A blocks of block_size) at positions [B, N]
        -> final-normed hidden [B, N, H].

        `cache`: a KVCache holding the context keys (inference; the block's keys are written after
        them, the caller truncates) or a ContextKeys (training). `mask` [B or 1, 1, N, S + N]
        (True = may attend); None = every key (one block over its whole context). `anchor_states`
        [B, A, H]: with anchor_feature, each block's newest context state, added to its anchor row."""
        x = self.block_input(block_tokens, parts, anchor_states)  # [B, N, H]
        cos, sin = self.rope(block_positions, x.dtype)
        for slot, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, slot, mask)
        return self.norm(x)

    def block_input(self, block_tokens: torch.Tensor, parts: FrozenTargetParts,
                    anchor_states: torch.Tensor | None = None) -> torch.Tensor:
        """Block rows [B, N] -> the first layer's input [B, N, H]: the target's frozen embeddings; with
        anchor_feature each anchor row is anchor_norm(its embedding) + its newest context state [B, A, H]."""
        x = parts.embed(block_tokens).to(self.fc.weight.dtype)  # [B, N, H]
        if not self.anchor_feature:
            return x
        batch, rows, hidden = x.shape
        blocks = x.view(batch, rows // self.block_size, self.block_size, hidden)  # [B, A, size, H]
        anchor_rows = self.anchor_norm(blocks[:, :, :1]) + anchor_states[:, :, None].to(x.dtype)  # [B, A, 1, H]
        return torch.cat([anchor_rows, blocks[:, :, 1:]], dim=2).view_as(x)

    def block_tokens(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """anchor ids [...] -> [..., block_size]: the anchor, then MASK."""
        block = torch.full((*anchor_ids.shape, self.block_size), self.mask_token_id, dtype=torch.long,
                           device=anchor_ids.device)
        block[..., 0] = anchor_ids
        return block

    def block_hidden(self, context: torch.Tensor, anchor_ids: torch.Tensor, parts: FrozenTargetParts,
                     context_positions: torch.Tensor | None = None,
                     context_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states of the K prediction rows of one block per sequence (before the LM head).

        context [B, T, F*H]: the target's fused features of the positions before each anchor;
        anchor_ids [B]; context_positions [B, T] (default 0 .. T - 1); context_valid [B, T] bool
        (default all; padding rows are hidden). Each anchor sits one past its newest valid context
        position. Returns [B, K, H], K = num_positions (block rows prediction_offset ..)."""
        batch, length, _ = context.shape
        device = context.device
        if context_positions is None:
            context_positions = torch.arange(length, device=device).expand(batch, length)
        if context_valid is None:
            context_valid = torch.ones(batch, length, dtype=torch.bool, device=device)
        newest, newest_row = torch.where(context_valid, context_positions,
                                         torch.full_like(context_positions, -1)).max(dim=1)  # [B], [B]
        block_positions = newest[:, None] + 1 + torch.arange(self.block_size, device=device)  # [B, K + offset]
        states = self.context_states(context)  # [B, T, H]
        kv = self.context_kv(states, context_positions)
        anchor_states = states[torch.arange(batch, device=device), newest_row][:, None]  # [B, 1, H]
        mask = torch.cat([context_valid[:, None, :].expand(batch, self.block_size, length),
                          torch.ones(batch, self.block_size, self.block_size, dtype=torch.bool, device=device)], dim=2)
        hidden = self.run_block(self.block_tokens(anchor_ids), block_positions, ContextKeys(kv), mask[:, None], parts,
                                anchor_states)
        return hidden[:, self.prediction_offset :]  # [B, K, H]

    def forward(self, hidden, tokens, positions, parts, anchors: torch.Tensor | None = None) -> torch.Tensor:
        """Training: one block per anchor. anchors [B, A] (indices t: context rows 0 .. t, anchor =
        tokens[t + 1]; default every t). Returns features [K, B, T, H] (LABEL_CONVENTION); rows of
        positions that are no anchor are zero (the trainer only reads anchor rows)."""
        batch, length, _ = hidden.shape
        device = hidden.device
        if anchors is None:
            anchors = torch.arange(length, device=device).expand(batch, length)
        num_anchors, size = anchors.shape[1], self.block_size
        anchor_ids = tokens.gather(1, (anchors + 1).clamp(max=length - 1))  # [B, A]
        block = self.block_tokens(anchor_ids).reshape(batch, num_anchors * size)  # [B, A * size]
        anchor_positions = positions.gather(1, anchors) + 1  # [B, A]
        block_positions = (anchor_positions[:, :, None] + torch.arange(size, device=device)).reshape(batch, -1)
        # block (anchor a) sees context rows j <= a and its own block, nothing of the other blocks
        sees_context = torch.arange(length, device=device)[None, None, :] <= anchors[:, :, None]  # [B, A, T]
        sees_context = sees_context[:, :, None, :].expand(batch, num_anchors, size, length).reshape(batch, -1, length)
        own_block = torch.block_diag(*[torch.ones(size, size, dtype=torch.bool, device=device)] * num_anchors)
        mask = torch.cat([sees_context, own_block.expand(batch, -1, -1)], dim=2)[:, None]  # [B, 1, A*size, T + A*size]
        states = self.context_states(hidden)  # [B, T, H]
        kv = self.context_kv(states, positions)
        anchor_states = states.gather(1, anchors[:, :, None].expand(-1, -1, states.shape[-1]))  # [B, A, H]: row t
        out = self.run_block(block, block_positions, ContextKeys(kv), mask, parts, anchor_states)  # [B, A * size, H]
        rows = out.view(batch, num_anchors, size, -1)[:, :, self.prediction_offset :]  # [B, A, K, H]
        features = out.new_zeros(self.num_positions, batch, length, out.shape[-1])  # [K, B, T, H]
        index = anchors[None, :, :, None].expand(self.num_positions, batch, num_anchors, out.shape[-1])
        return features.scatter(2, index, rows.permute(2, 0, 1, 3))

    def readout(self, features, parts):
        return features  # already final-normed by the module's own norm
