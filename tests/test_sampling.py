"""Tests for specdec.sampling: SamplingParams validation, logit warping, seeded sampling."""

import math

import pytest
import torch
from scipy.stats import chisquare

from specdec.sampling import SamplingParams, make_generator, sample_from_probs, sample_token, warp_logits_to_probs


# ------------------------------------------------------------------ SamplingParams
def test_defaults_are_greedy():
    params = SamplingParams()
    assert params.greedy and params.top_k == 0 and params.top_p == 1.0 and params.seed is None
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=100.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature="1.0"), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(seed="7"), "seed"),
    ],
)
def test_invalid_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_boundary_params_are_valid():
    SamplingParams(temperature=100.0, top_k=1, top_p=1.0, seed=0)
    SamplingParams(temperature=1e-3, top_p=1e-6)


# ------------------------------------------------------------------ warping
def test_greedy_is_one_hot_argmax_with_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 2.0, 5.0]])
    probs = warp_logits_to_probs(logits, SamplingParams())
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_scales_logits():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for temperature in (0.5, 1.0, 2.0):
        probs = warp_logits_to_probs(logits, SamplingParams(temperature=temperature))
        torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))
    hot = warp_logits_to_probs(logits, SamplingParams(temperature=5.0))
    cold = warp_logits_to_probs(logits, SamplingParams(temperature=0.2))
    assert cold[0] > hot[0] and cold[3] < hot[3]  # lower temperature = sharper


def test_tiny_temperature_does_not_overflow():
    probs = warp_logits_to_probs(torch.tensor([30.0, 29.0, -5.0]), SamplingParams(temperature=1e-4))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0]))


def test_top_k_keeps_k_largest_and_ties_at_the_kth():
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0, 0.0])
    probs = warp_logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.zeros(5)
    expected[[1, 3]] = torch.softmax(torch.tensor([4.0, 3.0]), dim=-1)
    torch.testing.assert_close(probs, expected)
    tied = warp_logits_to_probs(torch.tensor([3.0, 2.0, 2.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))
    assert (tied > 0).tolist() == [True, True, True, False]
    # top_k >= V and top_k = 0 are no-ops
    for top_k in (0, 5, 50):
        torch.testing.assert_close(warp_logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=top_k)), torch.softmax(logits, -1))


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.75, [0.625, 0.375, 0.0, 0.0]),  # 0.5 + 0.3 >= 0.75: two tokens
        (0.5, [1.0, 0.0, 0.0, 0.0]),  # the top token alone already reaches 0.5
        (0.51, [0.625, 0.375, 0.0, 0.0]),
        (0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (1e-6, [1.0, 0.0, 0.0, 0.0]),  # the top token is always kept
        (1.0, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_top_p_keeps_smallest_nucleus(top_p, expected):
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    permutation = torch.tensor([2, 0, 3, 1])  # order of the vocabulary must not matter
    probs = warp_logits_to_probs(base[permutation].log(), SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor(expected)[permutation], atol=1e-6, rtol=0)


def test_top_k_is_applied_before_top_p():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    probs = warp_logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    # after top-k the top token holds 4/7 >= 0.5, so the nucleus is that token alone
    # (top-p first would have kept two tokens)
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def _reference_warp(row: list[float], params: SamplingParams) -> list[float]:
    """Straightforward per-row implementation in Python floats."""
    scaled = [value / params.temperature for value in row]
    if 0 < params.top_k < len(row):
        kth = sorted(scaled, reverse=True)[params.top_k - 1]
        scaled = [value if value >= kth else -math.inf for value in scaled]
    top = max(scaled)
    weights = [math.exp(value - top) for value in scaled]
    probs = [weight / sum(weights) for weight in weights]
    order = sorted(range(len(row)), key=lambda index: (-probs[index], index))
    kept, mass = set(), 0.0
    for index in order:
        if mass >= params.top_p and kept:
            break
        kept.add(index)
        mass += probs[index]
    total = sum(probs[index] for index in kept)
    return [probs[index] / total if index in kept else 0.0 for index in range(len(row))]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9, top_k=6, top_p=0.7)],
)
def test_warp_matches_reference_on_any_leading_shape(params):
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)) * 2
    probs = warp_logits_to_probs(logits, params)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    expected = torch.tensor([_reference_warp(row, params) for row in logits.reshape(-1, 11).double().tolist()])
    torch.testing.assert_close(probs.reshape(-1, 11), expected.float(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ sampling
def test_make_generator():
    assert make_generator(None) is None
    first, second = make_generator(11), make_generator(11)
    assert torch.equal(torch.rand(5, generator=first), torch.rand(5, generator=second))
    with pytest.raises(ValueError, match="seed"):
        make_generator(1.5)


def test_one_hot_rows_use_no_randomness():
    probs = torch.zeros(3, 4, 6)
    probs[..., 2] = 1.0
    probs[1, 2] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 3.0])  # unnormalised single entry
    generator = make_generator(0)
    state = generator.get_state()
    tokens = sample_from_probs(probs, generator)
    assert tokens.shape == (3, 4) and tokens.dtype == torch.long
    expected = torch.full((3, 4), 2)
    expected[1, 2] = 5
    assert torch.equal(tokens, expected)
    assert sample_token(probs[1, 2], generator) == 5
    assert torch.equal(generator.get_state(), state)


def test_sampling_frequencies_match_probabilities():
    probs = torch.tensor([0.1, 0.0, 0.45, 0.05, 0.0, 0.4])
    counts = torch.bincount(sample_from_probs(probs.expand(60_000, 6), make_generator(3)), minlength=6)
    assert counts[1] == 0 and counts[4] == 0  # zero-probability tokens are never drawn
    support = probs > 0
    assert chisquare(counts[support].numpy(), (probs[support] * 60_000).numpy()).pvalue > 1e-3
    # the single-row path (used by verify) has the same distribution
    generator = make_generator(4)
    single = torch.bincount(torch.tensor([sample_token(probs * 7.0, generator) for _ in range(6_000)]), minlength=6)
    assert single[1] == 0 and single[4] == 0
    assert chisquare(single[support].numpy(), (probs[support] * 6_000).numpy()).pvalue > 1e-3


def test_sampling_is_reproducible_per_seed():
    probs = torch.softmax(torch.randn(50, 9, generator=torch.Generator().manual_seed(1)), -1)
    first = sample_from_probs(probs, make_generator(8))
    assert torch.equal(sample_from_probs(probs, make_generator(8)), first)
    assert not torch.equal(sample_from_probs(probs, make_generator(9)), first)
    row_tokens = [sample_token(probs[0], make_generator(seed)) for seed in range(40)]
    assert row_tokens == [int(sample_from_probs(probs[0], make_generator(seed))) for seed in range(40)]
    assert len(set(row_tokens)) > 1
