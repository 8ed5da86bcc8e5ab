"""What a draft head borrows from its FROZEN target (embeddings, final norm, LM head: never
trained, never saved), the draft vocabulary whose LM-head rows a drafter computes, and how a
drafter's linears run through the CPU kernel while drafting.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_int
from ..models.llama import rms_norm


@dataclass
class FrozenTargetParts:
    """The target's embeddings, final norm and LM head, detached (no gradients, never saved)."""

    embed_weight: torch.Tensor  # [V, H]
    lm_head_weight: torch.Tensor  # [V, H]
    final_norm_weight: torch.Tensor  # [H]
    norm_eps: float
    linear_backend: object | None = None  # None: F.linear (training); else a specdec.kernels backend

    @classmethod
    def from_target(cls, target) -> FrozenTargetParts:
        model = getattr(target, "model", None)
        backbone = getattr(model, "model", None)
        norm = getattr(backbone, "norm", None)
        embed = getattr(backbone, "embed_tokens", None)
        lm_head = getattr(model, "lm_head", None)
        if norm is None or embed is None or lm_head is None:
            raise ValueError(
                f"trained heads need a Llama-family target exposing model.model.embed_tokens, model.model.norm and "
                f"model.lm_head (specdec's native runtime); {type(target).__name__} {getattr(target, 'name', '')!r} does not"
            )
        eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None) or 1e-6
        # GGUF-block modules (weights="gguf") hold uint8 blocks: the heads train on the dense matrices
        dense = lambda module: module.fp32_weight() if hasattr(module, "fp32_weight") else module.weight.detach()  # noqa: E731
        embed_weight = dense(embed)
        # tied embeddings: one dense copy serves both (a GGUF-block target would dequantize it twice: 933 MB on the 1.5B)
        tied = lm_head.weight.data_ptr() == embed.weight.data_ptr() and lm_head.weight.shape == embed.weight.shape
        return cls(embed_weight, embed_weight if tied else dense(lm_head), norm.weight.detach(), float(eps))

    def with_lm_rows(self, token_ids: torch.Tensor) -> FrozenTargetParts:
        """The same parts with an LM head over `token_ids` only (logits [..., len(token_ids)])."""
        return replace(self, lm_head_weight=self.lm_head_weight.index_select(0, token_ids))

    def with_lm_head_dtype(self, dtype: torch.dtype) -> FrozenTargetParts:
        """The same parts with the LM head stored in `dtype` (a copy; the embeddings stay as they are):
        under autocast to that dtype the logits and gradients are the same, without a cast per call."""
        return replace(self, lm_head_weight=self.lm_head_weight.to(dtype))

    def to(self, device=None, dtype=None) -> FrozenTargetParts:
        move = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
        return replace(self, embed_weight=move(self.embed_weight), lm_head_weight=move(self.lm_head_weight),
                       final_norm_weight=move(self.final_norm_weight))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_weight)  # [..., H]

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.final_norm_weight, self.norm_eps)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear_backend is not None:  # drafting (see draft_linears): the kernel, maybe int8
            return self.linear_backend.linear(x, self.lm_head_weight, None)  # [..., V]
        return F.linear(x, self.lm_head_weight)  # [..., V]

    def with_linear_backend(self, backend) -> FrozenTargetParts:
        """The same parts with the LM head run by a linear backend (specdec.kernels)."""
        return replace(self, linear_backend=backend)


def dense_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state dict in fp32 with GGUF-block weights dequantized (weights="gguf" targets),
    so a head can start as a copy of one of the target's blocks whatever its weight format."""
    state = {name: tensor.detach().float() for name, tensor in module.state_dict().items()}
    for name, sub in module.named_modules():
        if hasattr(sub, "fp32_weight"):
            state[f"{name}.weight" if name else "weight"] = sub.fp32_weight()
    return state


class DraftVocab:
    """The tokens a drafter may propose: only their LM-head rows are computed while drafting.

    On small targets the LM head is a large share of the model (Qwen2.5-0.5B: 136M of 494M
    parameters), so scoring every head position over the full vocabulary costs a quarter of a
    target forward each. The trainer ranks the tokens that are labels in its data by frequency
    (checkpoint config "draft_vocab"); a drafter keeps the first `size` of them, EAGLE-3's reduced
    draft vocabulary. Proposals outside it are simply never made; verification is unchanged, so
    output stays exactly the target's (a sampled proposal's q is zero outside the draft vocabulary).
    """

    def __init__(self, parts: FrozenTargetParts, ids: torch.Tensor | None, own_head: bool = False):
        self.ids = ids  # [V'] long token ids, or None = the full vocabulary
        self.vocab_size = parts.lm_head_weight.shape[0]
        # own_head: the module has its own LM head over `ids` (EAGLE-3), the target's rows are not needed
        self.parts = parts if ids is None or own_head else parts.with_lm_rows(ids.to(parts.lm_head_weight.device))

    @classmethod
    def from_config(cls, parts: FrozenTargetParts, config: dict, size: int | None) -> DraftVocab:
        """`size` tokens of the checkpoint's ranking (None or 0: the full vocabulary; also when the
        checkpoint has no ranking)."""
        if size is not None:
            check_int("draft_vocab (0 = the full vocabulary)", size, 0)
        ranked = (config.get("draft_vocab") or {}).get("ids")
        if not size or not ranked or size >= parts.lm_head_weight.shape[0]:
            return cls(parts, None)
        return cls(parts, torch.tensor(ranked[:size], dtype=torch.long))

    @property
    def rows(self) -> int:
        return self.vocab_size if self.ids is None else int(self.ids.numel())

    def token(self, index: int) -> int:
        """Index into the draft logits -> token id."""
        return int(index) if self.ids is None else int(self.ids[index])

    def tokens(self, indices: torch.Tensor) -> list[int]:
        return indices.tolist() if self.ids is None else self.ids[indices].tolist()

    def full_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary [V'] -> the same over the whole vocabulary [V]."""
        if self.ids is None:
            return probs
        return torch.zeros(self.vocab_size, dtype=probs.dtype, device=probs.device).index_copy_(0, self.ids.to(probs.device), probs)


DRAFT_WEIGHTS = {"int8": "int8", "fp32": "auto"}  # drafter option -> specdec.kernels linear backend


def draft_linears(heads: nn.Module, vocab: DraftVocab, draft_weights: str) -> str:
    """Run a drafter's linears — the module's own and its draft-vocabulary LM-head rows — through
    the CPU kernel while drafting; returns the backend's name.

    A draft forward reads one or more decoder layers (and LM rows) for a handful of rows, so like a
    decode step it is bound by the weight bytes: "int8" (weight-only, a scale per row; default)
    reads a quarter of fp32's, "fp32" runs the fp32 kernel. Drafts are proposals that the target
    verifies, so either keeps the output exact; int8 may change which tokens are proposed (the
    trainer's held-out numbers are fp32). Autograd and non-fp32 inputs still go through F.linear,
    so a module being trained is unaffected. $SPECDEC_LINEAR=torch, or no C++ compiler, keeps torch.
    """
    from ..kernels import KernelUnavailable, fast_linear_modules, make_backend

    if draft_weights not in DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {draft_weights!r}")
    # torch when the environment forces it or there is no kernel here
    name = "torch" if make_backend("auto").backend.name == "torch" else DRAFT_WEIGHTS[draft_weights]
    try:
        backend = make_backend(name).backend
    except KernelUnavailable:
        backend = make_backend("torch").backend
    fast_linear_modules(heads, backend=backend)  # one backend (one int8 copy cache) for the module and its LM rows
    for module in heads.modules():  # the module's int8 copies at load, not in a request's first draft
        if isinstance(module, nn.Linear):
            backend.prepare(module.weight)
    vocab.parts = vocab.parts.with_linear_backend(backend)
    return backend.name
