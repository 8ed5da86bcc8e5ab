"""Speculative decoding theory: closed forms vs exact sums / simulation / exhaustive search."""

import itertools
import json
import random

import pytest

from specdec.cost import CostTable
from specdec.theory import (
    expected_speedup,
    expected_tau,
    main,
    optimal_gamma,
    parse_int_range,
    theory_table,
    tree_expected_tau,
)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.85, 0.99, 1.0])
@pytest.mark.parametrize("gamma", [0, 1, 4, 9])
def test_expected_tau_equals_exact_sum_over_accepted_lengths(alpha, gamma):
    # P(exactly k accepted) = alpha^k (1 - alpha) for k < gamma, alpha^gamma for k = gamma;
    # tokens per forward = k + 1 (the bonus / correction token)
    distribution = [alpha**k * (1 - alpha) for k in range(gamma)] + [alpha**gamma]
    exact = sum((k + 1) * prob for k, prob in enumerate(distribution))
    assert expected_tau(alpha, gamma) == pytest.approx(exact)


def test_expected_tau_matches_simulation():
    rng = random.Random(0)
    alpha, gamma, trials = 0.7, 5, 40000
    total = 0
    for _ in range(trials):
        accepted = 0
        while accepted < gamma and rng.random() < alpha:
            accepted += 1
        total += accepted + 1
    assert total / trials == pytest.approx(expected_tau(alpha, gamma), rel=0.02)


def test_expected_speedup_matches_leviathan_closed_form():
    for alpha, gamma, c in [(0.8, 4, 0.05), (0.6, 2, 0.2), (0.9, 7, 0.0)]:
        closed = (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))
        assert expected_speedup(alpha, gamma, c) == pytest.approx(closed)
    # a verify forward costing 2 plain steps halves the speedup when drafting is free
    assert expected_speedup(0.8, 4, 0.0, 2.0) == pytest.approx(expected_tau(0.8, 4) / 2)


def _brute_force_best(alpha, c, max_gamma, verify):
    speedups = [
        expected_tau(alpha, g) / (g * c + verify(g + 1)) for g in range(max_gamma + 1)
    ]
    best = max(speedups)
    return speedups.index(best), best


@pytest.mark.parametrize("seed", range(5))
def test_optimal_gamma_equals_exhaustive_search(seed):
    rng = random.Random(seed)
    # a measured-looking verify cost: ratio grows with k
    ks = [1, 2, 4, 8, 16]
    ms = [10.0]
    for _ in ks[1:]:
        ms.append(ms[-1] + rng.uniform(0.5, 8.0))
    table = CostTable(k=ks, ms=ms)
    for _ in range(10):
        alpha, c = rng.uniform(0.2, 0.99), rng.uniform(0.0, 0.3)
        gamma, speedup = optimal_gamma(alpha, c, max_gamma=20, verify_cost=table.ratio)
        expected_gamma, expected_speedup_value = _brute_force_best(alpha, c, 20, table.ratio)
        assert gamma == expected_gamma
        assert speedup == pytest.approx(expected_speedup_value)


def test_optimal_gamma_known_cases():
    # expensive drafter + poor acceptance: drafting never pays
    assert optimal_gamma(0.3, 1.0) == (0, 1.0)
    # free drafter + perfect acceptance: draft as long as allowed
    assert optimal_gamma(1.0, 0.0, max_gamma=12) == (12, 13.0)
    # higher acceptance never wants a shorter draft (same c)
    gammas = [optimal_gamma(a, 0.05)[0] for a in (0.5, 0.6, 0.7, 0.8, 0.9)]
    assert gammas == sorted(gammas) and gammas[0] < gammas[-1]
    # constant verify ratio 2 for any forward
    gamma, speedup = optimal_gamma(0.8, 0.05, verify_cost=2.0)
    assert speedup == pytest.approx(max(expected_tau(0.8, g) / (g * 0.05 + 2) for g in range(33)))


def test_tree_expected_tau_hand_computed():
    #        root
    #       /    \
    #     A .6   B .3
    #    /   \
    #  C .5  D .2
    #   |
    #  E .9
    parents = [-1, -1, 0, 0, 2]
    probs = [0.6, 0.3, 0.5, 0.2, 0.9]
    # 1 + P(A) + P(B) + P(A)P(C) + P(A)P(D) + P(A)P(C)P(E)
    hand = 1 + 0.6 + 0.3 + 0.3 + 0.12 + 0.27
    assert tree_expected_tau(parents, probs) == pytest.approx(hand)
    # the same tree in any node order gives the same value
    for order in itertools.permutations(range(5)):
        position = {old: new for new, old in enumerate(order)}
        new_parents = [-1 if parents[old] == -1 else position[parents[old]] for old in order]
        new_probs = [probs[old] for old in order]
        assert tree_expected_tau(new_parents, new_probs) == pytest.approx(hand)


def test_tree_expected_tau_matches_simulated_tree_walk():
    parents = [-1, -1, 0, 0, 2, 1]
    probs = [0.5, 0.4, 0.3, 0.6, 0.8, 0.7]
    children = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    rng = random.Random(1)
    trials, total = 40000, 0
    for _ in range(trials):
        node, tokens = -1, 1
        while children.get(node):
            # siblings are disjoint: pick which one (if any) is accepted
            draw, cumulative, chosen = rng.random(), 0.0, None
            for child in children[node]:
                cumulative += probs[child]
                if draw < cumulative:
                    chosen = child
                    break
            if chosen is None:
                break
            node, tokens = chosen, tokens + 1
        total += tokens
    assert total / trials == pytest.approx(tree_expected_tau(parents, probs), rel=0.02)


def test_chain_tree_equals_expected_tau():
    for alpha, gamma in [(0.7, 5), (0.95, 3), (0.0, 2)]:
        parents = [-1] + list(range(gamma - 1))
        assert tree_expected_tau(parents, [alpha] * gamma) == pytest.approx(
            expected_tau(alpha, gamma)
        )
    assert tree_expected_tau([], []) == 1.0


@pytest.mark.parametrize(
    "parents, probs",
    [
        ([-1, 2, 1], [0.5, 0.5, 0.5]),  # cycle 1 <-> 2
        ([-1, -1], [0.7, 0.5]),  # siblings sum to 1.2
        ([-1, 5], [0.5, 0.5]),  # parent out of range
        ([-1], [1.5]),  # not a probability
        ([-1, 0], [0.5]),  # length mismatch
    ],
)
def test_tree_expected_tau_rejects_bad_trees(parents, probs):
    with pytest.raises(ValueError):
        tree_expected_tau(parents, probs)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="alpha"):
        expected_tau(1.2, 3)
    with pytest.raises(ValueError, match="gamma"):
        expected_tau(0.5, -1)
    with pytest.raises(ValueError, match="c"):
        optimal_gamma(0.5, -0.1)
    with pytest.raises(ValueError):
        parse_int_range("8..1")


def test_theory_table_rows():
    rows = theory_table([0.6, 0.8], [1, 2, 3], 0.1)
    assert len(rows) == 6
    row = next(r for r in rows if r["alpha"] == 0.8 and r["gamma"] == 3)
    assert row["tau"] == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert row["speedup"] == pytest.approx(row["tau"] / 1.3)


def test_cli_prints_tables_and_optimum(capsys):
    assert main(["--alpha", "0.6,0.8", "--gamma", "1..4", "--c", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "E[tau]" in out and "speedup" in out
    best_gamma, best_speedup = optimal_gamma(0.8, 0.05)
    assert f"{best_gamma} ({best_speedup:.2f}x)" in out


def test_cli_json_with_measured_verify_cost(tmp_path, capsys):
    table_path = tmp_path / "t.json"
    table_path.write_text(json.dumps({"k": [1, 2, 4, 8], "ms": [10, 20, 24, 30]}))
    assert main(["--alpha", "0.7", "--gamma", "1,3", "--c", "0", "--verify-cost",
                 str(table_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    row = next(r for r in data["rows"] if r["gamma"] == 3)
    assert row["verify_ratio"] == pytest.approx(2.4)  # T(4)/T(1)
    assert row["speedup"] == pytest.approx(expected_tau(0.7, 3) / 2.4)
    with pytest.raises(SystemExit):
        main(["--verify-cost", str(tmp_path / "missing.json")])
