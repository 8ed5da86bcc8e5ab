"""Cross-entropy of a draft LM head against the target's distribution, in row chunks.

EAGLE-3 learns q = softmax(lm_head(readout)) against p = softmax(target_rows @ target_top) over
its draft vocabulary. Written plainly that is four [N, V'] float tensors per step (logits, p,
log q, their product), and on a CPU those dominate a step once N reaches the thousands (a 1.5B
EAGLE-3 at N = 3,500: ~6 s of the 11 s step, mostly fresh pages and memory traffic). Here the rows
go through in chunks of `chunk_rows`: the forward keeps per-row losses and argmaxes only, the
backward recomputes the draft logits slice by slice of the vocabulary and forms (q - p) * grad directly.

p is computed once per distinct target state: the unrolled training reads one position's state at
every depth whose label it produced (depth d of chain start t and depth d - 1 of start t + 1), so a
batch of N rows holds ~N / depth distinct states. Their [U, V'] probabilities are kept from the
forward for the backward (~1/depth of the rows' size) instead of recomputed per chunk and depth.
Same values as the plain form (tested, fp32), any N in bounded memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_ROWS = 512


def _target_probs(target_top, target_rows, dtype, chunk_rows):
    """p [U, V'] fp32 of the distinct target states target_top [U, H], products in `dtype`."""
    return torch.cat([F.softmax(F.linear(target_top[start : start + chunk_rows].to(dtype), target_rows).float(), -1)
                      for start in range(0, target_top.shape[0], chunk_rows)])


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, readout, draft_weight, target_top, target_of_row, target_rows, dtype, chunk_rows):
        weight = draft_weight.to(dtype)  # [V', H] once per call (autocast would cast it per chunk)
        target_probs = _target_probs(target_top, target_rows, dtype, chunk_rows)  # [U, V']
        per_row = torch.empty(readout.shape[0], dtype=torch.float32, device=readout.device)  # [N]
        top = torch.empty(readout.shape[0], dtype=torch.long, device=readout.device)  # [N]
        log_normalizer = torch.empty_like(per_row)  # [N] logsumexp of each row's draft logits, for the backward
        for start in range(0, readout.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = F.linear(readout[rows].to(dtype), weight).float()  # [C, V']
            row_max, top[rows] = logits.max(-1)  # [C]: one pass for the max and the argmax
            shifted = logits.sub_(row_max[:, None])  # [C, V'] in place: the chunk's one float tensor
            # -(p * log q).sum = logsumexp - (p * logits).sum, since p sums to 1; the max cancels
            expected_logit = (target_probs[target_of_row[rows]] * shifted).sum(-1)  # [C]
            log_sum = shifted.exp_().sum(-1).log_()  # [C]
            per_row[rows] = log_sum - expected_logit
            log_normalizer[rows] = log_sum + row_max
        ctx.save_for_backward(readout, weight, target_probs, target_of_row, log_normalizer)
        ctx.dtype, ctx.chunk_rows, ctx.master_dtype = dtype, chunk_rows, draft_weight.dtype
        ctx.mark_non_differentiable(top)
        return per_row, top

    @staticmethod
    def backward(ctx, grad_per_row, _grad_top):
        # in slices of the vocabulary (the forward's log-normalizers make each slice's q exact): every
        # slice's rows of grad_weight are complete at once, where row chunks would add a [V', H] float
        # tensor per chunk; the [N, H] grad_readout is what accumulates
        readout, weight, target_probs, target_of_row, log_normalizer = ctx.saved_tensors
        rows_in_dtype = readout.to(ctx.dtype)  # [N, H]
        grad_readout = torch.zeros(readout.shape, dtype=torch.float32, device=readout.device)  # [N, H]
        grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)  # [V', H]
        num_rows, vocab = readout.shape[0], weight.shape[0]
        slice_size = max(1, ctx.chunk_rows * vocab // max(1, num_rows))
        for start in range(0, vocab, slice_size):
            ids = slice(start, start + slice_size)
            logits = F.linear(rows_in_dtype, weight[ids]).float()  # [N, S]
            draft_probs = logits.sub_(log_normalizer[:, None]).exp_()  # q over the slice, in place
            grad_logits = draft_probs.sub_(target_probs[:, ids][target_of_row]).mul_(grad_per_row[:, None]).to(ctx.dtype)
            grad_readout += (grad_logits @ weight[ids]).float()
            grad_weight[ids] = (grad_logits.t() @ rows_in_dtype).float()
        return grad_readout.to(readout.dtype), grad_weight.to(ctx.master_dtype), None, None, None, None, None


def soft_cross_entropy(readout: torch.Tensor, draft_weight: torch.Tensor, target_top: torch.Tensor,
                       target_rows: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss [N], draft top-1 index [N]) of q = softmax(readout @ draft_weight.T) against
    p = softmax(target_top @ target_rows.T); readout, target_top [N, H], both weights [V', H].
    Products run in bf16 under CPU/CUDA autocast, else in target_rows' dtype; gradients flow to
    readout and draft_weight."""
    device_type = readout.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else target_rows.dtype
    distinct_top, target_of_row = torch.unique(target_top, dim=0, return_inverse=True)  # [U, H], [N]
    with torch.autocast(device_type, enabled=False):
        return _ChunkedSoftCrossEntropy.apply(readout, draft_weight, distinct_top, target_of_row, target_rows.to(dtype),
                                              dtype, chunk_rows)
