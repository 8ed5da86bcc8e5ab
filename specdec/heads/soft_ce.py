"""Cross-entropy of a draft LM head against the target's distribution, in row chunks.

EAGLE-3 learns q = softmax(lm_head(readout)) against p = softmax(target_rows @ target_top) over
its draft vocabulary. Written plainly that is four [N, V'] float tensors per step (logits, p,
log q, their product), and on a CPU those dominate a step once N reaches the thousands (a 1.5B
EAGLE-3 at N = 3,500: ~6 s of the 11 s step, mostly fresh pages and memory traffic). Here the rows
go through in chunks of `chunk_rows`: the forward keeps per-row losses and argmaxes only, the
backward recomputes each chunk's logits and p (two more [C, H] x [H, V'] products) and forms
(q - p) * grad directly. Same values as the plain form (tested, fp32), any N in bounded memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_ROWS = 512


def _chunk_logits(readout, draft_weight, target_top, target_rows, dtype):
    """(draft logits [C, V'] fp32, target probabilities p [C, V'] fp32) of one chunk, products in `dtype`."""
    logits = F.linear(readout.to(dtype), draft_weight).float()
    target_probs = F.softmax(F.linear(target_top.to(dtype), target_rows).float(), -1)
    return logits, target_probs


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, readout, draft_weight, target_top, target_rows, dtype, chunk_rows):
        weight = draft_weight.to(dtype)  # [V', H] once per call (autocast would cast it per chunk)
        per_row = torch.empty(readout.shape[0], dtype=torch.float32, device=readout.device)  # [N]
        top = torch.empty(readout.shape[0], dtype=torch.long, device=readout.device)  # [N]
        for start in range(0, readout.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits, target_probs = _chunk_logits(readout[rows], weight, target_top[rows], target_rows, dtype)
            # -(p * log q).sum = logsumexp(logits) - (p * logits).sum, since p sums to 1
            per_row[rows] = torch.logsumexp(logits, -1) - (target_probs * logits).sum(-1)
            top[rows] = logits.argmax(-1)
        ctx.save_for_backward(readout, weight, target_top, target_rows)
        ctx.dtype, ctx.chunk_rows, ctx.master_dtype = dtype, chunk_rows, draft_weight.dtype
        ctx.mark_non_differentiable(top)
        return per_row, top

    @staticmethod
    def backward(ctx, grad_per_row, _grad_top):
        readout, weight, target_top, target_rows = ctx.saved_tensors
        grad_readout = torch.empty_like(readout)  # [N, H]
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # [V', H]
        for start in range(0, readout.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            logits, target_probs = _chunk_logits(readout[rows], weight, target_top[rows], target_rows, ctx.dtype)
            grad_logits = ((F.softmax(logits, -1) - target_probs) * grad_per_row[rows, None]).to(ctx.dtype)  # [C, V']
            grad_readout[rows] = (grad_logits @ weight).to(readout.dtype)
            grad_weight += (grad_logits.t() @ readout[rows].to(ctx.dtype)).float()
        return grad_readout, grad_weight.to(ctx.master_dtype), None, None, None, None


def soft_cross_entropy(readout: torch.Tensor, draft_weight: torch.Tensor, target_top: torch.Tensor,
                       target_rows: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss [N], draft top-1 index [N]) of q = softmax(readout @ draft_weight.T) against
    p = softmax(target_top @ target_rows.T); readout, target_top [N, H], both weights [V', H].
    Products run in bf16 under CPU/CUDA autocast, else in target_rows' dtype; gradients flow to
    readout and draft_weight."""
    device_type = readout.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else target_rows.dtype
    with torch.autocast(device_type, enabled=False):
        return _ChunkedSoftCrossEntropy.apply(readout, draft_weight, target_top, target_rows.to(dtype), dtype, chunk_rows)
