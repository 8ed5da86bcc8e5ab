"""DSpark's loss and calibration as functions: the loss terms against hand-computed values, the draft
vocabulary's loss against the whole vocabulary's, the target's mass outside it, and sequential
temperature scaling lowering the ECE of the survival."""

import math

import pytest
import torch
from conftest import assert_close_to_scale

from specdec.heads.dspark_module import (
    analytic_acceptance, dspark_loss, expected_calibration_error, fit_sequential_temperatures, position_weights,
    survival_ece, target_on_vocabulary,
)

V = 11


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
    assert loss.total.item() == pytest.approx(0.1 * mean(ce) + 0.9 * 2 * mean(tv) + 1.0 * mean(bce), rel=1e-5)
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
    zeroed = target.clone()  # the trainer computes the target's logits at valid positions only (zeros elsewhere)
    zeroed[~valid] = 0.0
    assert dspark_loss(logits, zeroed, labels, confidence, valid).total.item() == pytest.approx(base.total.item(), rel=1e-6)
    assert position_weights(3, 4.0).tolist() == pytest.approx([1.0, math.exp(-0.25), math.exp(-0.5)])


def test_draft_vocabulary_loss_equals_the_full_vocabulary_loss_and_its_gradients():
    """Training's loss over the draft vocabulary V' (q = 0 outside it, the target's mass there a
    constant) equals the full-vocabulary loss with the draft logits -inf outside V', value and
    gradients (of the draft logits over V' and of the confidence logits)."""
    torch.manual_seed(3)
    n, k = 3, 4
    ids = torch.tensor([9, 0, 4, 7, 2, 5])  # V' = 6 of V = 11, in ranking order (not sorted)
    target_logits = 2 * torch.randn(n, k, V)
    labels = ids[torch.randint(0, ids.numel(), (n, k))]  # token ids inside V'
    labels[0, 1] = -100
    valid = torch.ones(n, k, dtype=torch.bool)
    valid[2, 2:] = False
    losses, grads = [], []
    for restricted in (True, False):
        draft = (2 * torch.randn(n, k, ids.numel(), generator=torch.Generator().manual_seed(1))).requires_grad_()
        confidence = torch.randn(n, k, generator=torch.Generator().manual_seed(2)).requires_grad_()
        if restricted:
            index = torch.full((V,), -100).index_copy_(0, ids, torch.arange(ids.numel()))
            loss = dspark_loss(draft, target_logits, torch.where(labels >= 0, index[labels.clamp(min=0)], labels),
                               confidence, valid, ids=ids)
        else:  # the full-vocabulary loss: q = softmax over every id with -inf outside V'
            full = torch.full((n, k, V), -math.inf).index_copy(-1, ids, draft)
            loss = dspark_loss(full, target_logits, labels, confidence, valid)
        loss.total.backward()
        losses.append(loss)
        grads.append((draft.grad, confidence.grad))
    cheap, reference = losses
    for name in ("total", "ce", "tv", "bce", "acceptance"):
        assert_close_to_scale(getattr(cheap, name).detach(), getattr(reference, name).detach(), rel=1e-5, what=name)
    assert_close_to_scale(grads[0][0], grads[1][0], rel=1e-5, what="d loss / d draft logits")
    assert_close_to_scale(grads[0][1], grads[1][1], rel=1e-5, what="d loss / d confidence logits")
    assert float(grads[0][0].abs().max()) > 0 and float(cheap.tv) > 0.1  # a case with something to compare


def test_total_variation_counts_the_target_mass_outside_the_draft_vocabulary():
    # q = (0.5, 0.5) on ids {0, 1}; p = (0.25, 0.25, 0.3, 0.2): TV = 0.5 (0.25 + 0.25 + 0.3 + 0.2) = 0.5,
    # acceptance sum min(p, q) = 0.5. Dropping the mass outside would give TV 0.25.
    ids = torch.tensor([0, 1])
    p_full = torch.tensor([0.25, 0.25, 0.3, 0.2])
    target_logits = p_full.log()[None, None]  # [1, 1, 4]
    p, outside = target_on_vocabulary(target_logits, ids)
    torch.testing.assert_close(p[0, 0], p_full[:2])
    assert float(outside) == pytest.approx(0.5, rel=1e-6)
    draft_logits = torch.zeros(1, 1, 2)  # q = (0.5, 0.5)
    loss = dspark_loss(draft_logits, target_logits, torch.tensor([[0]]), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool),
                       ids=ids)
    assert loss.tv.item() == pytest.approx(0.5, rel=1e-6)
    assert loss.acceptance.item() == pytest.approx(0.5, rel=1e-6)
    q_full = torch.tensor([0.5, 0.5, 0.0, 0.0])
    assert analytic_acceptance(torch.tensor([0.5, 0.5]), p[0, 0], outside[0, 0]).item() == pytest.approx(
        torch.minimum(q_full, p_full).sum().item(), rel=1e-6)


def test_loss_from_the_draft_vocabulary_logits_and_a_precomputed_normaliser_equals_the_full_one():
    """Training reads the target's logits at the draft vocabulary's ids only, with its logsumexp over
    every id computed once per position beforehand: the same loss as from the whole vocabulary's
    logits, and a wrong normaliser (the logsumexp over V' alone, dropping the mass outside) differs."""
    torch.manual_seed(4)
    n, k = 3, 4
    ids = torch.tensor([9, 0, 4, 7, 2, 5])
    target_logits = 2 * torch.randn(n, k, V)
    draft = 2 * torch.randn(n, k, ids.numel())
    labels, confidence = torch.randint(0, ids.numel(), (n, k)), torch.randn(n, k)
    valid = torch.ones(n, k, dtype=torch.bool)
    full = dspark_loss(draft, target_logits, labels, confidence, valid, ids=ids)
    cheap = dspark_loss(draft, target_logits[..., ids], labels, confidence, valid, ids=ids,
                        log_normaliser=torch.logsumexp(target_logits, dim=-1))
    for name in ("total", "ce", "tv", "bce", "acceptance"):
        assert_close_to_scale(getattr(cheap, name), getattr(full, name), rel=1e-5, what=name)
    wrong = dspark_loss(draft, target_logits[..., ids], labels, confidence, valid, ids=ids,
                        log_normaliser=torch.logsumexp(target_logits[..., ids], dim=-1))
    assert abs(float(wrong.tv) - float(full.tv)) > 0.01


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


# ----------------------------------------------------------------------------- on a DFlash backbone
