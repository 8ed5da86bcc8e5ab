"""DSpark's light sequential parts on a block drafter: the sequential head, the confidence head,
the training loss and the sequential temperature scaling of the confidences.

A block backbone (DFlash) gives one hidden row h_k per draft position k = 0..K-1 in one forward;
in DSpark the anchor (the root, the last committed token) is itself the first prediction position,
so row k predicts draft token k + 1 and all K rows are drafted. Rows are independent given the
context, so the backbone alone cannot make token k depend on the token drafted at k - 1. The
sequential head adds that dependency cheaply, left to right:

    q_k = softmax(lm_head(h_k) + bias_k),  bias_k = f(x_{k-1}, h_k, state)

* `markov`: a rank-r bias from the previous token only, bias_k = W2 W1[x_{k-1}]
  (W1: an [V, r] embedding, W2: [V, r]); x_{-1} is the anchor.
* `rnn`: a gated recurrent state s_k over the drafted prefix, s_k = g * s_{k-1} + (1 - g) * c with
  [g; c; o] = joint([s_{k-1}; W1[x_{k-1}]; h_k]) (sigmoid, tanh, tanh), bias_k = W2 o.

Confidence head: c_k = sigmoid((w . [h_k ; W1[x_{k-1}]] + b) / T_k), the predicted probability
that draft token k is accepted given the tokens before it were. It is trained (BCE) against the
analytic acceptance of the sampled draft, 1 - TV(q_k, p_k) = 1 - 0.5 ||q_k - p_k||_1; T_k are the
per-position temperatures fitted afterwards on held-out data (`fit_sequential_temperatures`), and
the product c_1 ... c_k is what the scheduler reads as the survival of position k.

Parameter names follow DeepSpec's public checkpoints (markov_head.markov_w1 / markov_w2 /
joint_proj, confidence_head.proj), so export is a rename of the backbone only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_positive_int
from .dflash import DEFAULT_BLOCK_SIZE, DEFAULT_DRAFT_LAYERS, DFlashModule
from .modules import register_head_type

# loss weights of DSpark's published recipe (DeepSpec's ce / l1 / confidence alphas): 0.1 cross-entropy
# + 0.9 x the L1 distance ||q - p||_1 (= 2 TV, hence 1.8 on the TV) + 1.0 BCE
LOSS_WEIGHTS = {"ce": 0.1, "tv": 1.8, "bce": 1.0}
ECE_BINS = 10
DEFAULT_MARKOV_RANK = 64
# training's draft vocabulary: the most frequent label tokens, as many as the dspark drafter's
# default `draft_vocab` proposes from, so the q that is trained is the q that drafts
TRAIN_DRAFT_VOCAB = 8192


# ----------------------------------------------------------------------------- sequential heads
class MarkovHead(nn.Module):
    """bias_k = W2 W1[x_{k-1}]: a rank-r bigram correction of the block logits."""

    kind: ClassVar[str] = "markov"
    deepspec_type: ClassVar[str] = "vanilla"  # DeepSpec's config value (markov_head_type)

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        check_positive_int("markov rank", rank)
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # [V, r]
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # [V, r]
        nn.init.normal_(self.markov_w1.weight, std=rank ** -0.5)
        nn.init.zeros_(self.markov_w2.weight)  # starts as the bare backbone: bias 0

    def initial_state(self, rows: int, like: torch.Tensor) -> torch.Tensor | None:
        return None

    def previous_embedding(self, previous_tokens: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(previous_tokens)  # [..., r]

    def step_input(self, state, previous_tokens: torch.Tensor, hidden: torch.Tensor):
        """(next state, the [..., r] vector W2 reads) for one position; previous_tokens [...], hidden [..., H]."""
        return state, self.previous_embedding(previous_tokens)

    def bias(self, inputs: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """W2 inputs: [..., r] -> [..., V'] over the token ids `ids` [V'] (None = every id; only those
        rows of W2 are multiplied, and only they get a gradient). Over every id it is the module itself,
        so a drafter's linear backend (draft_linears) runs it; over V' the [V', r] rows are fp32."""
        return self.bias_over(ids)(inputs)

    def bias_over(self, ids: torch.Tensor | None = None):
        """`bias` over the token ids `ids` as a function of the [..., r] inputs, its [V', r] rows of W2
        gathered once (a block drafted left to right reuses them at every position)."""
        if ids is None:
            return self.markov_w2
        rows = self.markov_w2.weight[ids]  # [V', r]
        return lambda inputs: F.linear(inputs, rows)

    def step(self, state, previous_tokens: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor | None = None, bias=None):
        """(next state, bias [..., V']) for one position; previous_tokens [...], hidden [..., H].
        `bias`: a `bias_over(ids)` to reuse (else one is made)."""
        state, inputs = self.step_input(state, previous_tokens, hidden)
        return state, (self.bias_over(ids) if bias is None else bias)(inputs)

    def block_bias(self, previous_tokens: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced biases of a whole block: previous_tokens [N, K], hidden [N, K, H] -> [N, K, V']
        (the recurrence runs over the [r]-sized inputs, W2 once over the whole block)."""
        state = self.initial_state(previous_tokens.shape[0], hidden)
        inputs = []
        for k in range(previous_tokens.shape[1]):
            state, step_inputs = self.step_input(state, previous_tokens[:, k], hidden[:, k])
            inputs.append(step_inputs)
        return self.bias(torch.stack(inputs, dim=1), ids)


class RNNHead(MarkovHead):
    """A gated recurrent state over the drafted prefix: position k sees every x_{<k}, not only x_{k-1}."""

    kind = "rnn"
    deepspec_type = "rnn"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank, hidden_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [s; W1[x]; h] -> [gate; candidate; output]

    def initial_state(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(rows, self.rank)  # [N, r]

    def step_input(self, state, previous_tokens, hidden):
        joint = self.joint_proj(torch.cat([state, self.previous_embedding(previous_tokens), hidden], dim=-1))
        gate, candidate, output = joint.chunk(3, dim=-1)  # [..., r] each
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return state, torch.tanh(output)


SEQUENTIAL_HEADS = {cls.kind: cls for cls in (MarkovHead, RNNHead)}


class ConfidenceHead(nn.Module):
    """Logit of P(draft token k accepted | the ones before were): w . [h_k ; W1[x_{k-1}]] + b."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden: torch.Tensor, previous_embedding: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, previous_embedding], dim=-1)).squeeze(-1)  # [...]


class SequentialParts(nn.Module):
    """The sequential head + the confidence head + the calibration temperatures of one DSpark drafter."""

    def __init__(self, vocab_size: int, hidden_size: int, block_size: int, rank: int = DEFAULT_MARKOV_RANK,
                 head: str = "markov"):
        super().__init__()
        if head not in SEQUENTIAL_HEADS:
            raise ValueError(f"unknown DSpark sequential head {head!r}; known: {', '.join(SEQUENTIAL_HEADS)}")
        check_positive_int("block_size", block_size)
        self.markov_head = SEQUENTIAL_HEADS[head](vocab_size, rank, hidden_size)
        self.confidence_head = ConfidenceHead(hidden_size, rank)
        # [K] per-position temperatures of the confidence logits (1 = uncalibrated); a buffer so
        # they travel in the checkpoint but the optimizer never touches them
        self.register_buffer("confidence_temperatures", torch.ones(block_size))

    @property
    def head_kind(self) -> str:
        return self.markov_head.kind

    def block(self, base_logits: torch.Tensor, hidden: torch.Tensor, previous_tokens: torch.Tensor,
              ids: torch.Tensor | None = None):
        """Teacher-forced: base_logits [N, K, V'] over token ids `ids` [V'] (None = every id), hidden
        [N, K, H], previous_tokens [N, K] (the anchor, then the labels of positions 0..K-2) -> (logits
        [N, K, V'], raw confidence logits [N, K])."""
        logits = base_logits + self.markov_head.block_bias(previous_tokens, hidden, ids).to(base_logits.dtype)
        confidence = self.confidence_head(hidden, self.markov_head.previous_embedding(previous_tokens))
        return logits, confidence

    def calibrated(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        """[..., K] raw confidence logits -> calibrated confidences sigmoid(z_k / T_k)."""
        k = confidence_logits.shape[-1]
        return torch.sigmoid(confidence_logits.float() / self.confidence_temperatures[:k].float())

    def draft(self, base_logits: torch.Tensor, hidden: torch.Tensor, anchor: int, choose, ids: torch.Tensor | None = None):
        """Left to right over one block: base_logits [K, V'] (over token ids `ids` [V'], None = every
        id), hidden [K, H]; `choose(logits [V']) -> (token id, q [V] or None)` picks each token from the
        exact logits it is given (argmax, or a sample whose q goes to verification) and that token
        conditions the next position. Returns (tokens [K], q rows [K, V] or None, confidences [K])."""
        previous = torch.tensor([anchor], device=hidden.device)
        state = self.markov_head.initial_state(1, hidden)
        bias_over_ids = self.markov_head.bias_over(ids)
        tokens, rows, confidence_logits = [], [], []
        for k in range(base_logits.shape[0]):
            state, bias = self.markov_head.step(state, previous, hidden[k : k + 1], bias=bias_over_ids)  # bias [1, V']
            confidence_logits.append(self.confidence_head(hidden[k : k + 1], self.markov_head.previous_embedding(previous)))
            token, q = choose(base_logits[k].float() + bias[0].float())
            tokens.append(token)
            rows.append(q)
            previous = torch.tensor([token], device=hidden.device)
        probs = None if rows[0] is None else torch.stack(rows)
        return tokens, probs, self.calibrated(torch.cat(confidence_logits))


# ----------------------------------------------------------------------------- loss
def position_weights(block_size: int, decay: float | None, device=None) -> torch.Tensor:
    """[K] exp(-k / decay) for positions k = 0..K-1 (None or <= 0: all ones)."""
    positions = torch.arange(block_size, device=device, dtype=torch.float32)
    if decay is None or decay <= 0:
        return torch.ones_like(positions)
    return torch.exp(-positions / decay)


def target_on_vocabulary(target_logits: torch.Tensor, ids: torch.Tensor | None,
                         log_normaliser: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution read on a draft vocabulary: (p over `ids` [..., V'], the target's mass
    outside them [...]); target_logits [..., V] over the whole vocabulary, ids [V'] (None = every id:
    mass outside 0). With `log_normaliser` [...] (the logsumexp of the target's logits over all V,
    computed once per position beforehand: `attach_target_log_normalisers`), target_logits are the logits
    at `ids` only [..., V'], so a training step needs V' rows of the target's LM head, not V.
    No gradient: both are constants of the draft's parameters."""
    with torch.no_grad():
        target_logits = target_logits.float()
        if log_normaliser is not None:
            probs = (target_logits - log_normaliser.float()[..., None]).exp()  # [..., V']
            return probs, (1 - probs.sum(-1)).clamp(min=0.0)
        log_normaliser = torch.logsumexp(target_logits, dim=-1, keepdim=True)  # [..., 1] over all V
        if ids is None:
            return (target_logits - log_normaliser).exp(), target_logits.new_zeros(target_logits.shape[:-1])
        probs = (target_logits[..., ids] - log_normaliser).exp()  # [..., V']
        return probs, (1 - probs.sum(-1)).clamp(min=0.0)


def analytic_acceptance(draft_probs: torch.Tensor, target_probs: torch.Tensor,
                        target_outside: torch.Tensor | float = 0.0) -> torch.Tensor:
    """E[accept] of a token sampled from q against p: 1 - 0.5 ||q - p||_1 = sum min(p, q); [..., V'] -> [...].

    q lives on the draft vocabulary (the V' ids the drafter can propose, q = 0 elsewhere), so the
    L1 distance is sum over V' |q - p| + the target's mass outside V' (`target_outside` [...])."""
    return (1 - total_variation(draft_probs, target_probs, target_outside)).clamp(0.0, 1.0)


def total_variation(draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    target_outside: torch.Tensor | float = 0.0) -> torch.Tensor:
    """0.5 ||q - p||_1 with q [..., V'] on the draft vocabulary, p [..., V'] the target's probabilities
    there and `target_outside` [...] its mass elsewhere (where q = 0: |0 - p| = p)."""
    return 0.5 * ((draft_probs - target_probs).abs().sum(-1) + target_outside)


@dataclass
class DSparkLoss:
    total: torch.Tensor  # scalar, what is backpropagated
    ce: torch.Tensor  # scalars (detached), each a position-weighted mean
    tv: torch.Tensor
    bce: torch.Tensor
    acceptance: torch.Tensor  # [N, K] detached analytic acceptance of each position


def dspark_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
                confidence_logits: torch.Tensor, valid: torch.Tensor, decay: float | None = 4.0,
                weights: dict[str, float] | None = None, ids: torch.Tensor | None = None,
                log_normaliser: torch.Tensor | None = None) -> DSparkLoss:
    """0.1 CE(label) + 0.9 ||q - p||_1 (= 1.8 TV(q, p)) + 1.0 BCE(c, 1 - TV), each a position-weighted mean
    over the valid rows.

    draft_logits [N, K, V'] over the draft vocabulary `ids` [V'] (None = every id, V' = V): q is
    their softmax and 0 outside; target_logits [N, K, V] over the whole vocabulary (the TV counts the
    target's mass outside V'); labels [N, K] as indices into V' (-100 = none, or not in V');
    confidence_logits [N, K]; valid [N, K] bool (a position counts only while every earlier one of
    its block does). With `log_normaliser` [N, K] target_logits are [N, K, V'], the target's at `ids`
    (`target_on_vocabulary`). The result equals the same loss over the whole vocabulary with the draft
    logits -inf outside V' (tests/test_dspark.py), at [N, K, V'] instead of [N, K, V] of draft work.
    """
    weights = {**LOSS_WEIGHTS, **(weights or {})}
    mask = valid.float() * position_weights(draft_logits.shape[1], decay, draft_logits.device)  # [N, K]
    denominator = mask.sum().clamp(min=1e-6)
    ce = F.cross_entropy(draft_logits.float().flatten(0, 1), labels.flatten().clamp(min=0), reduction="none")
    ce = ce.view_as(mask) * (labels >= 0)
    q = F.softmax(draft_logits.float(), dim=-1)  # [N, K, V']
    p, outside = target_on_vocabulary(target_logits, ids, log_normaliser)  # [N, K, V'], [N, K]
    tv = total_variation(q, p, outside)  # [N, K]
    acceptance = (1 - tv).detach().clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), acceptance, reduction="none")
    terms = {name: (value * mask).sum() / denominator for name, value in (("ce", ce), ("tv", tv), ("bce", bce))}
    total = sum(weights[name] * value for name, value in terms.items())
    return DSparkLoss(total, terms["ce"].detach(), terms["tv"].detach(), terms["bce"].detach(), acceptance)


# ----------------------------------------------------------------------------- calibration
def expected_calibration_error(predicted: torch.Tensor, outcome: torch.Tensor, bins: int = ECE_BINS) -> float:
    """sum_b (n_b / n) |mean predicted_b - mean outcome_b| over equal-width bins of `predicted` in [0, 1]
    (outcome may be soft: an expected acceptance)."""
    predicted, outcome = predicted.reshape(-1).double(), outcome.reshape(-1).double()
    if predicted.numel() == 0:
        return 0.0
    index = (predicted * bins).long().clamp(0, bins - 1)
    count = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, torch.ones_like(predicted))
    gap = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, predicted - outcome)
    return float(gap.abs().sum() / predicted.numel())


def survival_ece(confidence_logits: torch.Tensor, acceptance: torch.Tensor, temperatures: torch.Tensor,
                 valid: torch.Tensor | None = None) -> list[float]:
    """Per position k: ECE of the predicted survival prod_{i<=k} sigmoid(z_i / T_i) against the
    realised one prod_{i<=k} a_i. confidence_logits / acceptance / valid [N, K]; temperatures [K]."""
    survival = torch.sigmoid(confidence_logits.double() / temperatures.double()).cumprod(-1)
    truth = acceptance.double().cumprod(-1)
    valid = torch.ones_like(truth, dtype=torch.bool) if valid is None else valid
    return [expected_calibration_error(survival[valid[:, k], k], truth[valid[:, k], k]) for k in range(truth.shape[1])]


TEMPERATURE_GRID = torch.logspace(math.log10(0.05), math.log10(20.0), 241, dtype=torch.float64)


def fit_sequential_temperatures(confidence_logits: torch.Tensor, acceptance: torch.Tensor,
                                valid: torch.Tensor | None = None, grid: torch.Tensor = TEMPERATURE_GRID) -> torch.Tensor:
    """Sequential temperature scaling: left to right, T_k minimises the ECE of the survival at k,
    prod_{i<=k} sigmoid(z_i / T_i), with T_1..T_{k-1} already fixed (so each position corrects the
    error the earlier ones leave in the product, not its own marginal). A grid search: ECE is
    piecewise constant in T, so gradients would not help. Returns temperatures [K] (float32)."""
    logits, truth = confidence_logits.double(), acceptance.double().cumprod(-1)  # [N, K]
    valid = torch.ones_like(truth, dtype=torch.bool) if valid is None else valid
    prefix = torch.ones(logits.shape[0], dtype=torch.float64)  # [N] survival up to k - 1 (calibrated)
    temperatures = []
    for k in range(logits.shape[1]):
        rows = valid[:, k]
        if not bool(rows.any()):
            temperatures.append(1.0)
            continue
        errors = [expected_calibration_error(prefix[rows] * torch.sigmoid(logits[rows, k] / t), truth[rows, k])
                  for t in grid.tolist()]
        best = min(range(len(errors)), key=lambda i: (errors[i], abs(math.log(float(grid[i])))))  # ties: nearest 1
        temperatures.append(float(grid[best]))
        prefix = prefix * torch.sigmoid(logits[:, k] / temperatures[-1])
    return torch.tensor(temperatures, dtype=torch.float32)


# ----------------------------------------------------------------------------- the DSpark module
@register_head_type
class DSparkModule(DFlashModule):
    """The DFlash backbone with the anchor row as the first prediction position (K = block_size rows)
    plus `sequential` (SequentialParts). Block row k predicts token t + k + 1 (LABEL_CONVENTION)."""

    kind = "dspark"
    drafter = "dspark"
    prediction_offset = 0
    reads_target_distribution = True  # TV and the confidence target need the target's distribution
    reads_target_log_normaliser = True  # ... on V', normalised over all V

    def __init__(self, target_config, block_size: int = DEFAULT_BLOCK_SIZE, num_draft_layers: int = DEFAULT_DRAFT_LAYERS,
                 mask_token_id: int | None = None, intermediate_size: int | None = None,
                 input_layers: tuple[int, ...] | None = None, markov_rank: int = DEFAULT_MARKOV_RANK,
                 sequential_head: str = "markov", anchor_feature: bool = False, ce_weight: float = LOSS_WEIGHTS["ce"]):
        super().__init__(target_config, block_size, num_draft_layers, mask_token_id, intermediate_size, input_layers,
                         anchor_feature)
        if not (isinstance(ce_weight, (int, float)) and 0 < ce_weight <= 100):
            raise ValueError(f"ce_weight must be a number in (0, 100], got {ce_weight!r}")
        self.ce_weight = float(ce_weight)  # the loss's cross-entropy weight (DeepSpec's 0.1 by default)
        self.sequential = SequentialParts(target_config.vocab_size, target_config.hidden_size, self.block_size,
                                          markov_rank, sequential_head)
        # [V'] the token ids q lives on in training and held-out evaluation (fit_vocabulary; None =
        # every id). Not stored in the weights: the checkpoint's "draft_vocab" ranking is where
        # drafting reads its vocabulary from.
        self.register_buffer("draft_ids", None, persistent=False)
        self._draft_index = None  # [V] long: token id -> index into draft_ids (-100 outside)

    @classmethod
    def from_config(cls, config: dict, target_config) -> DSparkModule:
        config = {**config, "block_size": config.get("block_size", config["num_positions"] + cls.prediction_offset)}
        backbone = DFlashModule.from_config(config, target_config)  # resolves the backbone's options (and a stored config)
        if target_config is None:
            target_config = backbone.config.__class__.from_dict(config["draft_config"])
            target_config.num_hidden_layers = config["target_num_layers"]
        return cls(target_config, backbone.block_size, len(backbone.layers), backbone.mask_token_id,
                   backbone.config.intermediate_size, backbone.fused_layers,
                   config.get("markov_rank", DEFAULT_MARKOV_RANK), config.get("sequential_head", "markov"),
                   backbone.anchor_feature, config.get("ce_weight", LOSS_WEIGHTS["ce"]))

    def head_config(self) -> dict:
        # ce_weight only when not the default: checkpoints written before it existed still resume
        changed = {} if self.ce_weight == LOSS_WEIGHTS["ce"] else {"ce_weight": self.ce_weight}
        return {**super().head_config(), "markov_rank": self.sequential.markov_head.rank,
                "sequential_head": self.sequential.head_kind, **changed}

    # ---- the draft vocabulary (training and held-out evaluation)
    def fit_vocabulary(self, ranked_ids: list[int], target) -> None:
        """q lives on the TRAIN_DRAFT_VOCAB most frequent label tokens (drafting proposes from the same
        ranking), so the TV, the CE and the acceptance are those of the distribution that drafts."""
        vocab_size = self.sequential.markov_head.markov_w1.num_embeddings
        ids = ranked_ids[:TRAIN_DRAFT_VOCAB]
        self.draft_ids = None if not ids or len(ids) >= vocab_size else torch.tensor(ids, dtype=torch.long,
                                                                                      device=self.fc.weight.device)
        self._draft_index = None

    def draft_index(self) -> torch.Tensor:
        """[V] long: token id -> index into draft_ids, -100 where it has none."""
        if self._draft_index is None or self._draft_index.device != self.draft_ids.device:
            vocab_size = self.sequential.markov_head.markov_w1.num_embeddings
            index = torch.full((vocab_size,), -100, dtype=torch.long, device=self.draft_ids.device)
            self._draft_index = index.index_copy_(0, self.draft_ids, torch.arange(self.draft_ids.numel(), device=index.device))
        return self._draft_index

    def to_target_ids(self, indices: torch.Tensor) -> torch.Tensor:
        return indices if self.draft_ids is None else self.draft_ids[indices]

    def to_draft_indices(self, token_ids: torch.Tensor) -> torch.Tensor:
        return token_ids if self.draft_ids is None else self.draft_index()[token_ids]

    def in_vocabulary(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.to_draft_indices(token_ids) >= 0

    # ---- training and held-out evaluation on teacher-forced blocks
    def anchor_blocks(self, batch, features: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor) -> dict:
        """The blocks at anchors [N, 2] (b, t) of a batch: hidden [N, K, H] (features [K, B, T, H]),
        previous tokens [N, K] (the anchor t + 1, then the data's tokens t + 2 ..), labels [N, K] (the
        target's top-1 for t + k + 1), valid [N, K] (valid [K, B, T], cut to a prefix), the target's
        top-layer state that produced each label [N, K, H] (or None)."""
        b, t = anchors[:, 0], anchors[:, 1]
        k = torch.arange(1, self.num_positions + 1, device=t.device)
        index = (t[:, None] + k[None, :]).clamp(max=batch.tokens.shape[1] - 1)  # [N, K]: position t + k
        rows = b[:, None].expand_as(index)
        top = None if batch.top_hidden is None else batch.top_hidden[rows, index]
        normaliser = None if batch.target_log_normaliser is None else batch.target_log_normaliser[rows, index]
        return {"hidden": features[:, b, t].transpose(0, 1), "previous": batch.tokens[rows, index],
                "labels": batch.target_next[rows, index], "valid": valid[:, b, t].t().long().cumprod(-1).bool(), "top": top,
                "log_normaliser": normaliser}

    def block_logits(self, blocks: dict, parts) -> tuple[torch.Tensor, torch.Tensor]:
        """(exact draft logits [N, K, V'] over draft_ids with the sequential bias, confidence logits
        [N, K]) of teacher-forced blocks; `parts` has the target's whole LM head."""
        hidden = blocks["hidden"]  # [N, K, H]
        vocab_parts = parts if self.draft_ids is None else parts.with_lm_rows(self.draft_ids)
        # rows flattened to one contiguous [N * K, H]: an LM head over a strided 3-d view runs as a
        # batched matmul with the [V', H] weight expanded per block (5x slower on CPU, both ways)
        base = vocab_parts.lm_head(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:2], vocab_parts.lm_head_weight.shape[0])
        return self.sequential.block(base, hidden, blocks["previous"], self.draft_ids)

    def valid_blocks(self, batch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid [K, B, T] from label rows [N, 3], anchors [A, 2] (b, t): the positions whose first label is valid)."""
        valid = torch.zeros(self.num_positions, *batch.tokens.shape, dtype=torch.bool, device=rows.device)
        valid[rows[:, 0], rows[:, 1], rows[:, 2]] = True
        return valid, valid[0].nonzero()

    def label_logits(self, batch, features, rows, parts):
        """Each row's exact logits: its anchor's whole block is run through the sequential head
        (teacher-forced with the batch's tokens), then the row's position is read."""
        anchors, which = torch.unique(rows[:, 1:], dim=0, return_inverse=True)  # [A, 2] (b, t), [N]
        everything = torch.ones(self.num_positions, *batch.tokens.shape, dtype=torch.bool, device=rows.device)
        logits, _ = self.block_logits(self.anchor_blocks(batch, features, anchors, everything), parts)  # [A, K, V']
        return logits[which, rows[:, 0]]

    def training_loss(self, batch, features, rows, parts, settings, generator):
        """0.1 CE + 0.9 L1 (1.8 TV) + 1.0 BCE over whole blocks at this step's anchors (at most loss_rows / K of them),
        + feature_weight x the smooth L1 from each row's state to the target's top-layer state at its label."""
        valid, anchors = self.valid_blocks(batch, rows)
        limit = max(1, settings.loss_rows // self.num_positions)
        if anchors.shape[0] > limit:
            anchors = anchors[torch.randperm(anchors.shape[0], generator=generator)[:limit].to(anchors.device)]
        blocks = self.anchor_blocks(batch, features, anchors, valid)
        logits, confidence = self.block_logits(blocks, parts)
        decay = -1.0 / math.log(settings.head_decay) if 0 < settings.head_decay < 1 else None
        top, log_normaliser = blocks["top"], blocks["log_normaliser"]  # [N, K, H], [N, K]: the target's own state
        if log_normaliser is None:
            raise ValueError("dspark training needs the target's logsumexp per position (attach_target_log_normalisers)")
        # the target's logits on V' only where a position counts (the rest is masked out of every term): a
        # teacher-forced block leaves the greedy path after a few positions
        counted = blocks["valid"]  # [N, K]
        vocab_parts = parts if self.draft_ids is None else parts.with_lm_rows(self.draft_ids)
        target_logits = torch.zeros(*top.shape[:2], vocab_parts.lm_head_weight.shape[0], device=top.device)  # [N, K, V']
        target_logits[counted] = vocab_parts.lm_head(top[counted]).float()
        # NaN at positions no label reads (masked out of every term, but NaN * 0 is NaN)
        log_normaliser = torch.where(counted, log_normaliser, torch.zeros_like(log_normaliser))
        loss = dspark_loss(logits, target_logits, self.to_draft_indices(blocks["labels"]), confidence, blocks["valid"],
                           decay, weights={"ce": self.ce_weight}, ids=self.draft_ids, log_normaliser=log_normaliser)
        total = loss.total
        if settings.feature_weight > 0:  # EAGLE-1's regression: each row's state toward the target's own at its label
            mask = blocks["valid"].float() * position_weights(self.num_positions, decay, top.device)  # [N, K]
            regression = F.smooth_l1_loss(blocks["hidden"].float(), top.float(), reduction="none").mean(-1)  # [N, K]
            total = total + settings.feature_weight * (regression * mask).sum() / mask.sum().clamp(min=1e-6)
        hits = (self.to_target_ids(logits.argmax(-1)) == blocks["labels"]) & blocks["valid"]  # [N, K]
        return total, hits.sum(0).float().cpu(), blocks["valid"].sum(0).float().cpu()
