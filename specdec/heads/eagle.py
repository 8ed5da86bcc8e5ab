"""EAGLE-1 and EAGLE-3 draft modules: one decoder layer autoregressing in the target's feature space.

Both are chained modules (modules.ChainedModule): the row at position p reads a feature and the
token p + 1 and predicts token p + 2; depth 1 reads the target's own hidden state, deeper depths
the module's previous output (trained unrolled, "training-time test").

* `eagle1` (Li et al. 2024): fc(cat(embed(token), feature)) -> one decoder layer -> the next
  feature, read by the target's own LM head (or the rows of a reduced draft vocabulary). Feature =
  the target's top hidden state (layer num_layers, after the final norm), so the trainer can regress
  it (smooth L1) besides the token loss.
* `eagle3` (Li et al. 2025): depth 1 fuses three target layers — hidden_layers 2, N // 2, N - 3 in
  specdec's convention (0 = embeddings, i = output of block i; transformers' hidden_states indices;
  the outputs of blocks 1, N/2 - 1, N - 4), concatenated low, mid, high — with fc [H, 3H]. The
  layer's attention reads cat(input_layernorm(embeds), hidden_norm(state)) (width 2H), the residual
  is the un-normed state; logits = lm_head(norm(state)) over a reduced draft vocabulary
  (`d2t`: target id = i + d2t[i]; `t2d`: target id -> in the draft vocabulary). The parameter names
  ARE the layout SGLang and vLLM load (LlamaForCausalLMEagle3; see export.py); the token embeddings
  are the target's and never stored.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checks import check_positive_int
from ..models.llama import MLP, Attention, Block, RMSNorm, block_flags, packed_linear
from .modules import ChainedModule, register_head_type
from .soft_ce import soft_cross_entropy
from .target_parts import FrozenTargetParts, dense_state_dict

DEFAULT_EAGLE3_VOCAB = 32000  # draft vocabulary size of the published EAGLE-3 drafters
_DRAFT_CONFIG_KEYS = (  # what an EAGLE-3 checkpoint stores to rebuild the module without its target (export)
    "vocab_size", "draft_vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "model_type",
)


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The target hidden layers EAGLE-3 fuses, low, mid, high (what SGLang and vLLM capture by default)."""
    return (min(2, num_layers), num_layers // 2, max(0, num_layers - 3))


def eagle3_config(target_config, draft_vocab_size: int, intermediate_size: int | None = None):
    """The drafter's own Llama config: one layer with the target's attention shape, rope and eps."""
    from transformers import LlamaConfig

    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    rope = dict(getattr(target_config, "rope_parameters", None) or {"rope_type": "default"})
    rope.setdefault("rope_theta", getattr(target_config, "rope_theta", 10000.0))
    return LlamaConfig(
        vocab_size=target_config.vocab_size, draft_vocab_size=draft_vocab_size, hidden_size=target_config.hidden_size,
        intermediate_size=intermediate_size or target_config.intermediate_size, num_hidden_layers=1,
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        head_dim=head_dim, rms_norm_eps=target_config.rms_norm_eps, rope_parameters=rope, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        max_position_embeddings=getattr(target_config, "max_position_embeddings", 4096),
    )


@register_head_type
class Eagle1Module(ChainedModule):
    """EAGLE-1: fc(cat(embed(token), feature)) -> a copy of the target's block -> the next feature."""

    kind = "eagle1"
    drafter = "eagle1"

    def __init__(self, target_config, depth: int = 3):
        super().__init__(target_config, input_layer=target_config.num_hidden_layers, depth=depth)
        hidden_size = target_config.hidden_size
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=True)
        self.block = Block(target_config, *block_flags(target_config))

    def init_from_target(self, target) -> None:
        """Start as the identity on the feature (token half and residual branches zeroed), like MTP."""
        self.block.load_state_dict(dense_state_dict(target.model.model.layers[-1]))
        hidden_size = self.fc.weight.shape[0]
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.zero_()
            self.fc.weight[:, hidden_size:].copy_(torch.eye(hidden_size))
            for output in (self.block.self_attn.o_proj, self.block.mlp.down_proj):
                output.weight.zero_()
                if output.bias is not None:
                    output.bias.zero_()

    @property
    def decoder(self) -> nn.Module:
        return self.block

    def attention_input(self, previous, next_tokens, parts, rows=None):
        embeds = parts.embed(next_tokens).to(previous.dtype)  # [B, T, H]
        residual = packed_linear(self.fc, torch.cat([embeds, previous], dim=-1), rows)  # [B, T, H]
        return self.block.input_layernorm(residual), residual

    def readout(self, features, parts):
        return features  # a predicted top-layer feature (after the target's final norm)


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer (`midlayer`): the target's attention / MLP code, q/k/v over 2H."""

    def __init__(self, cfg):
        super().__init__()
        hidden_size = cfg.hidden_size
        self.input_layernorm = RMSNorm(hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qk_norm=False, qkv_bias=False)
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * hidden_size, attn.num_heads * attn.head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * hidden_size, attn.num_kv_heads * attn.head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * hidden_size, attn.num_kv_heads * attn.head_dim, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attention_input(self, embeds, state) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(state)], dim=-1)  # [B, T, 2H], embeddings first


@register_head_type
class Eagle3Module(ChainedModule):
    """EAGLE-3: three fused target layers -> fc -> `midlayer`, chained; own norm + reduced-vocab LM head."""

    kind = "eagle3"
    drafter = "eagle3"
    reads_target_distribution = True

    def __init__(self, target_config, depth: int = 7, draft_vocab_size: int = DEFAULT_EAGLE3_VOCAB,
                 intermediate_size: int | None = None):
        check_positive_int("draft_vocab_size", draft_vocab_size)
        layers = eagle3_layers(target_config.num_hidden_layers)
        super().__init__(target_config, input_layer=layers[0], depth=depth)
        self.fused_layers = layers
        self.target_num_layers = target_config.num_hidden_layers
        vocab_size, hidden_size = target_config.vocab_size, target_config.hidden_size
        self.config = eagle3_config(target_config, min(draft_vocab_size, vocab_size), intermediate_size)
        draft_vocab = self.config.draft_vocab_size
        self.fc = nn.Linear(3 * hidden_size, hidden_size, bias=False)
        self.midlayer = Eagle3Layer(self.config)
        self.norm = RMSNorm(hidden_size, target_config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))  # [V'] target id = i + d2t[i]
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))  # [V] in the draft vocabulary
        self.t2d[:draft_vocab] = True

    @classmethod
    def from_config(cls, config: dict, target_config) -> Eagle3Module:
        """From a checkpoint's head config; target_config None: from the Llama config it stores (export)."""
        if target_config is None:
            from transformers import LlamaConfig

            target_config = LlamaConfig.from_dict(config["draft_config"])
            target_config.num_hidden_layers = config["target_num_layers"]
        module = cls(target_config, config["num_positions"], config.get("draft_vocab_size", DEFAULT_EAGLE3_VOCAB),
                     config.get("intermediate_size"))
        module.fused_layers = tuple(config.get("input_layers", module.fused_layers))
        return module

    @property
    def input_layers(self) -> tuple[int, ...]:
        return self.fused_layers

    def head_config(self) -> dict:
        return {**super().head_config(), "input_layers": list(self.fused_layers),
                "draft_vocab_size": self.config.draft_vocab_size, "intermediate_size": self.config.intermediate_size,
                "target_num_layers": self.target_num_layers,
                "draft_config": {key: value for key, value in self.config.to_dict().items() if key in _DRAFT_CONFIG_KEYS}}

    # ---- the reduced draft vocabulary
    @property
    def draft_ids(self) -> torch.Tensor:
        """[V'] the target token id of each draft logit (ascending)."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, ranked_ids: list[int]) -> None:
        """Draft vocabulary = the first V' of `ranked_ids` (most frequent first), topped up with the
        lowest unused ids, sorted ascending (EAGLE-3's d2t / t2d)."""
        size, vocab_size = self.d2t.shape[0], self.t2d.shape[0]
        chosen = list(dict.fromkeys(int(t) for t in ranked_ids if 0 <= int(t) < vocab_size))[:size]
        if len(chosen) < size:
            taken = set(chosen)
            chosen += [t for t in range(vocab_size) if t not in taken][: size - len(chosen)]
        ids = torch.tensor(sorted(chosen), dtype=torch.long, device=self.d2t.device)
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(size, device=ids.device))
            self.t2d.zero_()
            self.t2d[ids] = True

    def fit_vocabulary(self, ranked_ids: list[int], target) -> None:
        """Before training: choose the draft vocabulary from the data and start its LM head as the target's rows."""
        self.set_draft_vocab(ranked_ids)
        with torch.no_grad():
            self.lm_head.weight.copy_(FrozenTargetParts.from_target(target).lm_head_weight[self.draft_ids].float())

    def to_target_ids(self, indices: torch.Tensor) -> torch.Tensor:
        return self.draft_ids[indices]

    def in_vocabulary(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.t2d[token_ids]

    def to_draft_indices(self, token_ids: torch.Tensor) -> torch.Tensor:
        index = torch.cumsum(self.t2d.long(), 0) - 1  # [V]: position of each draft token among the ascending ids
        return torch.where(self.t2d[token_ids], index[token_ids], torch.full_like(token_ids, -100))

    def init_from_target(self, target) -> None:
        """Start from a logit lens: fc passes the high fused layer through, the layer is the identity
        (output projections zeroed), norm = the target's final norm, lm_head = its rows."""
        hidden_size = self.fc.weight.shape[0]
        parts = FrozenTargetParts.from_target(target)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * hidden_size :].copy_(torch.eye(hidden_size))
            for output in (self.midlayer.self_attn.o_proj, self.midlayer.mlp.down_proj):
                output.weight.zero_()
            self.norm.weight.copy_(parts.final_norm_weight.float())
            self.lm_head.weight.copy_(parts.lm_head_weight[self.draft_ids].float())

    # ---- the chained computation
    def first_state(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(hidden)  # [..., 3H] -> [..., H]

    @property
    def decoder(self) -> nn.Module:
        return self.midlayer

    def attention_input(self, previous, next_tokens, parts, rows=None):
        embeds = parts.embed(next_tokens).to(previous.dtype)  # [B, T, H]: the target's embeddings
        return self.midlayer.attention_input(embeds, previous), previous  # residual: the un-normed state

    def readout(self, features, parts):
        return self.norm(features)

    def project(self, features, parts) -> torch.Tensor:
        return self.lm_head(self.norm(features))  # [..., V'] over the draft vocabulary

    def target_rows(self, parts: FrozenTargetParts) -> torch.Tensor:
        """The target's LM-head rows of the draft vocabulary [V', H], gathered once per (head, vocabulary)
        instead of every step (a [32000, H] copy)."""
        key = (parts.lm_head_weight.data_ptr(), parts.lm_head_weight.dtype, self.d2t.data_ptr(), self.d2t._version)
        cached = getattr(self, "_target_rows", None)
        if cached is None or cached[0] != key:
            cached = (key, parts.lm_head_weight[self.draft_ids])
            self._target_rows = cached
        return cached[1]

    def token_loss(self, readout, labels, parts, target_top):
        """Cross-entropy against the target's distribution restricted to the draft vocabulary
        (its logits at those ids, softmaxed), and whether the draft's top token is the label."""
        if target_top is None:
            raise ValueError("eagle3 training needs the target's top-layer hidden states in the batch (its distribution)")
        per_row, top = soft_cross_entropy(readout, self.lm_head.weight, target_top, self.target_rows(parts))  # [N], [N]
        return per_row, self.draft_ids[top] == labels
