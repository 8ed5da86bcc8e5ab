"""DSpark: the sequential head conditions on the previous token, the loss terms against hand-computed
values, sequential temperature scaling lowers the ECE of the survival, and (with a DFlash backbone)
the drafter is lossless greedy and distributed like the target when sampling."""

import math

import pytest
import torch

from specdec.heads.dspark import (
    SequentialParts, analytic_acceptance, dspark_loss, expected_calibration_error, fit_sequential_temperatures,
    position_weights, survival_ece,
)

V, H, K = 11, 8, 4


@pytest.mark.parametrize("head", ["markov", "rnn"])
@torch.no_grad()
def test_sequential_bias_depends_on_the_previous_token(head):
    torch.manual_seed(0)
    parts = SequentialParts(V, H, K, rank=3, head=head)
    torch.nn.init.normal_(parts.markov_head.markov_w2.weight)  # zero-initialised: give it a bias to show
    hidden = torch.randn(1, H)
    state = parts.markov_head.initial_state(1, hidden)
    _, bias_a = parts.markov_head.step(state, torch.tensor([2]), hidden)
    _, bias_b = parts.markov_head.step(state, torch.tensor([5]), hidden)
    _, bias_a_again = parts.markov_head.step(state, torch.tensor([2]), hidden)
    assert float((bias_a - bias_b).abs().max()) > 0.1 * float(bias_a.abs().max())
    torch.testing.assert_close(bias_a, bias_a_again)
    if head == "markov":  # exactly the rank-r bigram: W2 W1[x]
        w1, w2 = parts.markov_head.markov_w1.weight, parts.markov_head.markov_w2.weight
        torch.testing.assert_close(bias_a[0], w2 @ w1[2])


def test_rnn_state_carries_tokens_before_the_previous_one():
    torch.manual_seed(0)
    parts = SequentialParts(V, H, K, rank=3, head="rnn")
    torch.nn.init.normal_(parts.markov_head.markov_w2.weight)
    hidden = torch.randn(2, 3, H).expand(2, 3, H).clone()
    hidden[1] = hidden[0]
    previous = torch.tensor([[1, 4, 7], [2, 4, 7]])  # same x_{k-1} at positions 1 and 2, different x_0
    bias = parts.markov_head.block_bias(previous, hidden)  # [2, 3, V]
    assert float((bias[0, 2] - bias[1, 2]).abs().max()) > 1e-4  # the RNN remembers x_0
    markov = SequentialParts(V, H, K, rank=3, head="markov")
    torch.nn.init.normal_(markov.markov_head.markov_w2.weight)
    bigram = markov.markov_head.block_bias(previous, hidden)
    torch.testing.assert_close(bigram[0, 2], bigram[1, 2])  # the Markov head does not


def test_block_bias_equals_step_by_step():
    torch.manual_seed(1)
    for head in ("markov", "rnn"):
        parts = SequentialParts(V, H, K, rank=3, head=head)
        torch.nn.init.normal_(parts.markov_head.markov_w2.weight)
        hidden, previous = torch.randn(2, K, H), torch.randint(0, V, (2, K))
        block = parts.markov_head.block_bias(previous, hidden)
        state = parts.markov_head.initial_state(2, hidden)
        for k in range(K):
            state, bias = parts.markov_head.step(state, previous[:, k], hidden[:, k])
            torch.testing.assert_close(bias, block[:, k])


def test_loss_terms_match_hand_computed_values():
    # one block of two positions over 3 tokens; crafted distributions with known CE / TV / BCE
    q0, p0 = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.25, 0.5])
    q1, p1 = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.6, 0.3, 0.1])
    draft_logits = torch.stack([q0.log(), q1.log()])[None]  # [1, 2, 3]
    target_logits = torch.stack([p0.log(), p1.log()])[None]
    labels = torch.tensor([[2, 1]])
    confidence_logits = torch.tensor([[0.0, math.log(3.0)]])  # c = 0.5 and 0.75
    loss = dspark_loss(draft_logits, target_logits, labels, confidence_logits, torch.ones(1, 2, dtype=torch.bool), decay=2.0)
    w = torch.tensor([1.0, math.exp(-0.5)])
    ce = torch.tensor([-math.log(0.25), -math.log(0.3)])
    tv = torch.tensor([0.25, 0.0])  # 0.5 * (0.25 + 0 + 0.25)
    acceptance = 1 - tv
    c = torch.tensor([0.5, 0.75])
    bce = -(acceptance * c.log() + (1 - acceptance) * (1 - c).log())
    mean = lambda x: float((w * x).sum() / w.sum())  # noqa: E731
    assert loss.ce.item() == pytest.approx(mean(ce), rel=1e-5)
    assert loss.tv.item() == pytest.approx(mean(tv), rel=1e-5)
    assert loss.bce.item() == pytest.approx(mean(bce), rel=1e-5)
    assert loss.total.item() == pytest.approx(0.1 * mean(ce) + 0.9 * mean(tv) + 1.0 * mean(bce), rel=1e-5)
    torch.testing.assert_close(loss.acceptance, acceptance[None])
    torch.testing.assert_close(analytic_acceptance(q0, p0), torch.minimum(q0, p0).sum())


def test_loss_ignores_invalid_positions():
    torch.manual_seed(0)
    logits, target = torch.randn(2, 3, V), torch.randn(2, 3, V)
    labels, confidence = torch.randint(0, V, (2, 3)), torch.randn(2, 3)
    valid = torch.tensor([[True, True, False], [True, False, False]])
    base = dspark_loss(logits, target, labels, confidence, valid)
    garbage = logits.clone()
    garbage[0, 2], garbage[1, 1:] = 50 * torch.randn(V), 50 * torch.randn(2, V)
    assert dspark_loss(garbage, target, labels, confidence, valid).total.item() == pytest.approx(base.total.item(), rel=1e-6)
    assert position_weights(3, 4.0).tolist() == pytest.approx([1.0, math.exp(-0.25), math.exp(-0.5)])


def test_ece_of_known_bins():
    predicted = torch.tensor([0.05, 0.05, 0.95, 0.95])
    assert expected_calibration_error(predicted, torch.tensor([0.0, 0.0, 1.0, 1.0])) == pytest.approx(0.05)
    assert expected_calibration_error(predicted, torch.tensor([1.0, 1.0, 0.0, 0.0])) == pytest.approx(0.95)


def test_sequential_temperature_scaling_lowers_the_ece_of_a_miscalibrated_head():
    # true per-position acceptances a_k; the head is overconfident (logits 3x too large) at
    # position 0 and underconfident (logits / 2) at position 1, so calibration needs T = (3, 0.5)
    generator = torch.Generator().manual_seed(0)
    n = 4000
    true_logits = torch.randn(n, 3, generator=generator) * 1.2 + 1.0  # [n, K]
    acceptance = torch.bernoulli(torch.sigmoid(true_logits), generator=generator)  # realised outcomes
    head_logits = true_logits * torch.tensor([3.0, 0.5, 1.0])
    valid = torch.ones(n, 3, dtype=torch.bool)
    before = survival_ece(head_logits, acceptance, torch.ones(3), valid)
    temperatures = fit_sequential_temperatures(head_logits, acceptance, valid)
    after = survival_ece(head_logits, acceptance, temperatures, valid)
    assert temperatures[0].item() == pytest.approx(3.0, rel=0.25)
    assert temperatures[1].item() == pytest.approx(0.5, rel=0.3)
    for k in range(2):
        assert after[k] < 0.5 * before[k], (before, after)
    assert max(after) < 0.03, after
