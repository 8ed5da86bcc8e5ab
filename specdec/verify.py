"""The ONE lossless acceptance module (speculative / recursive rejection sampling).

Terms (per verify step):
  accepted tokens   — the draft tokens kept, a root-to-node path of the draft tree.
  correction token  — when verification stops because every candidate child of the current
                      node was rejected: one token sampled from the residual distribution
                      (what is left of the target after the rejected candidates).
  bonus token       — when verification stops at a node with no children (the end of a chain or
                      a tree leaf): one token sampled from the target row of that node.
A step always emits accepted + exactly one correction-or-bonus token, so it always makes progress,
and the emitted tokens are distributed exactly as the target would sample them.

Rules (p = current target distribution, q = the draft distribution a token was sampled from):
  * stochastic proposal x ~ q: accept with probability min(1, p(x) / q(x)); on rejection
    p <- norm(max(0, p - q)).
  * deterministic proposal (draft_probs None; q is one-hot at x): accept with probability p(x);
    on rejection p <- p with x removed, renormalised (the same formula with q = one-hot).
  * tree: at the current node try its children in node order against the current p, updating p
    with the rule above after each rejection (SpecInfer's multi-candidate / recursive rejection
    sampling); the first accepted child becomes the current node and p becomes the fresh target
    row of that node. If all children are rejected, the correction is sampled from the residual.

What this asks of drafters (stochastic trees): the draft_probs row of node i must be exactly the
distribution its token was sampled from, conditional on everything drawn before it (its ancestors
and its earlier siblings). Siblings drawn i.i.d. from q all carry q; siblings drawn WITHOUT
replacement must carry q with the earlier siblings' tokens removed and renormalised. A token
that was sampled must be verified (never dropped because of its own value), and a row must
never give its own token probability 0 (such a token could not have been sampled). A one-hot
row is a deterministic proposal.

Greedy (one-hot target rows) reduces to exact prefix matching: every acceptance probability is
0 or 1 and every residual is one-hot, so no randomness is drawn from the generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.draft import Draft
from specdec.sampling import sample_token

# A residual with less mass than this exists only through float error (the rejection that led
# to it had at most this probability), so we fall back to the distribution it came from.
RESIDUAL_MASS_EPS = 1e-6


@dataclass
class VerifyResult:
    """Outcome of one verify step.

    tokens: accepted draft tokens followed by exactly one bonus/correction token.
    num_accepted: number of accepted draft tokens (len(tokens) - 1).
    path: node indices of the accepted draft tokens, root to leaf (for a chain: 0..num_accepted-1).
    """

    tokens: list[int]
    num_accepted: int
    path: list[int]


# ------------------------------------------------------------------------ primitives
def _acceptance_from_values(target_prob: float, draft_prob: float) -> float:
    """min(1, p(x) / q(x)) with the edge cases made exact (p(x) = 0 never accepts)."""
    if target_prob <= 0.0:
        return 0.0
    if target_prob >= draft_prob:
        return 1.0
    return target_prob / draft_prob


def _as_probs(tensor: torch.Tensor) -> torch.Tensor:
    """Half-precision probabilities are upcast so residual arithmetic stays accurate."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def acceptance_probability(target_row: torch.Tensor, draft_row: torch.Tensor | None, token: int) -> float:
    """Probability of accepting `token` proposed from draft_row q [V] (None = deterministic)
    against target_row p [V]: min(1, p(x) / q(x)), or p(x) for a deterministic proposal."""
    target_prob = float(target_row[token])
    if draft_row is None:
        return _acceptance_from_values(target_prob, 1.0)
    draft_prob = float(draft_row[token])
    if draft_prob <= 0.0:
        raise ValueError(
            f"draft token {token} has draft probability {draft_prob}: a sampled token must have q(x) > 0 "
            "(pass draft_probs=None for deterministic proposals)"
        )
    return _acceptance_from_values(target_prob, draft_prob)


def residual_distribution(target_row: torch.Tensor, draft_row: torch.Tensor | None, token: int) -> torch.Tensor:
    """The distribution to continue with after rejecting `token`: norm(max(0, p - q)) [V].

    draft_row None = deterministic proposal, i.e. q one-hot at token: p with token removed.
    If the residual has (numerically) no mass, the rejection could only have happened through
    float error and p itself is returned (normalised).
    """
    target_row = _as_probs(target_row)
    if draft_row is None:
        residual = target_row.clone()
        residual[token] = 0.0
    else:
        residual = (target_row - _as_probs(draft_row)).clamp_(min=0.0)
    mass = float(residual.sum())
    if mass <= RESIDUAL_MASS_EPS:
        return target_row / target_row.sum()
    return residual.mul_(1.0 / mass)


def _is_accepted(probability: float, generator: torch.Generator | None) -> bool:
    """Bernoulli(probability); certain outcomes draw no randomness (keeps greedy deterministic)."""
    if probability >= 1.0:
        return True
    if probability <= 0.0:
        return False
    device = generator.device if generator is not None else "cpu"
    uniform = torch.rand(1, generator=generator, device=device, dtype=torch.float64)
    return float(uniform) < probability


def _check_target_probs(target_probs: torch.Tensor, num_nodes: int, draft_probs: torch.Tensor | None) -> None:
    if target_probs.dim() != 2 or target_probs.shape[0] != num_nodes + 1:
        raise ValueError(
            f"target_probs must have shape [N + 1 = {num_nodes + 1}, V] (row 0 = after the last committed "
            f"token, row i + 1 = after node i), got {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.shape[-1] != target_probs.shape[1]:
        raise ValueError(
            f"draft_probs and target_probs must share the vocabulary: V={draft_probs.shape[-1]} vs "
            f"V={target_probs.shape[1]}"
        )


# ------------------------------------------------------------------------ verification
def verify_chain(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Verify a chain draft.

    draft_tokens: [g] proposed ids; draft_probs: [g, V] the q each token was sampled from, or
    None for a deterministic proposal; target_probs: [g + 1, V] warped target rows (row i is the
    distribution at draft position i, row g is used for the bonus token).
    Equivalent to verify_tree(Draft.chain(...)) (same randomness consumption), but gathers all
    p(x_i), q(x_i) in one shot.
    """
    if not isinstance(draft_tokens, torch.Tensor):
        draft_tokens = torch.as_tensor(list(draft_tokens), dtype=torch.long)
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be 1-D [g], got shape {tuple(draft_tokens.shape)}")
    num_draft = draft_tokens.shape[0]
    if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[0] != num_draft):
        raise ValueError(f"draft_probs must have shape [g={num_draft}, V] or be None, got {tuple(draft_probs.shape)}")
    _check_target_probs(target_probs, num_draft, draft_probs)
    target_probs = _as_probs(target_probs)

    positions = torch.arange(num_draft, device=target_probs.device)
    token_ids = draft_tokens.to(target_probs.device).long()
    tokens = token_ids.tolist()
    target_at_draft = target_probs[positions, token_ids].tolist()  # p_i(x_i), [g]
    if draft_probs is None:
        draft_at_draft = [1.0] * num_draft
    else:
        draft_at_draft = draft_probs.to(target_probs.device)[positions, token_ids].tolist()  # q_i(x_i), [g]

    emitted: list[int] = []
    for position in range(num_draft):
        if draft_probs is not None and draft_at_draft[position] <= 0.0:
            raise ValueError(
                f"draft token {tokens[position]} at position {position} has draft probability 0: a sampled "
                "token must have q(x) > 0 (pass draft_probs=None for deterministic proposals)"
            )
        accept = _acceptance_from_values(target_at_draft[position], draft_at_draft[position])
        if _is_accepted(accept, generator):
            emitted.append(tokens[position])
            continue
        draft_row = None if draft_probs is None else draft_probs[position].to(target_probs.device)
        residual = residual_distribution(target_probs[position], draft_row, tokens[position])  # [V]
        emitted.append(sample_token(residual, generator))  # correction
        return VerifyResult(tokens=emitted, num_accepted=position, path=list(range(position)))

    emitted.append(sample_token(target_probs[num_draft], generator))  # bonus
    return VerifyResult(tokens=emitted, num_accepted=num_draft, path=list(range(num_draft)))


def verify_tree(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """Verify a tree draft with recursive (multi-candidate) rejection sampling.

    target_probs: [N + 1, V] warped target rows; row 0 = after the last committed token,
    row i + 1 = after node i. Children are tried in node order (see module docstring).
    """
    num_nodes = draft.num_nodes
    _check_target_probs(target_probs, num_nodes, draft.draft_probs)
    target_probs = _as_probs(target_probs)
    draft_probs = None if draft.draft_probs is None else _as_probs(draft.draft_probs).to(target_probs.device)
    tokens = draft.tokens.tolist()
    children = draft.children_lists

    emitted: list[int] = []
    path: list[int] = []
    node = -1  # the root: the last committed token
    while True:
        current = target_probs[node + 1]  # [V] fresh target row of the current node
        candidates = children[node + 1]
        if not candidates:
            emitted.append(sample_token(current, generator))  # bonus
            break
        for child in candidates:
            draft_row = None if draft_probs is None else draft_probs[child]  # [V]
            accept = acceptance_probability(current, draft_row, tokens[child])
            if _is_accepted(accept, generator):
                emitted.append(tokens[child])
                path.append(child)
                node = child
                break
            current = residual_distribution(current, draft_row, tokens[child])  # [V]
        else:
            emitted.append(sample_token(current, generator))  # correction
            break
    return VerifyResult(tokens=emitted, num_accepted=len(path), path=path)
