"""Standard analysis of speculative decoding (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", section 3).

Model: every drafted token is accepted independently with probability ``alpha`` (given that all
earlier ones were), the drafter costs ``c`` target-steps per drafted token, and one verify forward
over gamma + 1 tokens costs ``verify_ratio = T(gamma + 1) / T(1)`` target-steps (1 on the
memory-bound ideal, measured on CPU -- see specdec.cost).

  E[tau](alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha)     tokens per target forward
  speedup              = E[tau] / (gamma * c + verify_ratio)      vs. plain decoding

CLI: ``specdec theory --alpha 0.6,0.7,0.8 --gamma 1..8 --c 0.05 [--verify-cost 1.3 | table.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

VerifyCost = float | Callable[[int], float] | None


def _check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise ValueError(f"alpha (acceptance probability) must be in [0, 1], got {alpha}")
    return alpha


def _check_gamma(gamma: int) -> int:
    if int(gamma) != gamma or gamma < 0:
        raise ValueError(f"gamma (draft length) must be an integer >= 0, got {gamma}")
    return int(gamma)


def expected_tau(alpha: float, gamma: int) -> float:
    """Expected tokens per target forward (accepted drafts + bonus) for draft length gamma."""
    alpha = _check_alpha(alpha)
    gamma = _check_gamma(gamma)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def _verify_ratio(verify_cost: VerifyCost, num_tokens: int) -> float:
    """T(num_tokens) / T(1) from a constant, a callable k -> ratio, or None (= 1)."""
    if verify_cost is None:
        return 1.0
    ratio = float(verify_cost(num_tokens)) if callable(verify_cost) else float(verify_cost)
    if not ratio > 0:
        raise ValueError(f"verify cost ratio must be > 0, got {ratio} for k={num_tokens}")
    return ratio


def expected_speedup(
    alpha: float, gamma: int, cost_ratio_c: float, verify_cost_ratio: float | None = None
) -> float:
    """Walltime speedup over plain decoding: E[tau] / (gamma * c + T(gamma+1)/T(1)).

    ``verify_cost_ratio`` defaults to 1 (verifying gamma + 1 tokens costs one plain step).
    """
    if cost_ratio_c < 0:
        raise ValueError(f"draft cost ratio c must be >= 0, got {cost_ratio_c}")
    verify = _verify_ratio(verify_cost_ratio, _check_gamma(gamma) + 1)
    return expected_tau(alpha, gamma) / (gamma * cost_ratio_c + verify)


def optimal_gamma(
    alpha: float, c: float, max_gamma: int = 32, verify_cost: VerifyCost = None
) -> tuple[int, float]:
    """Exhaustive search of gamma in 0..max_gamma for the best expected speedup.

    ``verify_cost`` is None (ideal, 1), a constant ratio, or a callable k -> T(k)/T(1) (e.g.
    ``CostTable.ratio``) evaluated at k = gamma + 1. gamma = 0 is plain decoding (speedup
    1 / verify_cost(1)); it is returned when no draft length pays. Ties go to the shorter draft.
    """
    _check_gamma(max_gamma)
    if c < 0:
        raise ValueError(f"draft cost ratio c must be >= 0, got {c}")
    best_gamma, best_speedup = 0, -math.inf
    for gamma in range(max_gamma + 1):
        speedup = expected_tau(alpha, gamma) / (
            gamma * c + _verify_ratio(verify_cost, gamma + 1)
        )
        if speedup > best_speedup:
            best_gamma, best_speedup = gamma, speedup
    return best_gamma, best_speedup


def tree_expected_tau(parents: Sequence[int], node_accept_probs: Sequence[float]) -> float:
    """Expected tokens per forward for a draft tree: 1 + sum over nodes of P(path accepted).

    ``parents[i]`` is the parent node index (-1 = child of the last committed token);
    ``node_accept_probs[i]`` is P(node i accepted | its parent was reached). Siblings are
    tried in order and at most one is accepted, so their probabilities must sum to <= 1.
    The node order need not be topological.
    """
    parents = [int(p) for p in (parents.tolist() if hasattr(parents, "tolist") else parents)]
    probs = [
        float(p)
        for p in (node_accept_probs.tolist() if hasattr(node_accept_probs, "tolist")
                  else node_accept_probs)
    ]
    if len(parents) != len(probs):
        raise ValueError(
            f"parents ({len(parents)}) and node_accept_probs ({len(probs)}) differ in length"
        )
    num_nodes = len(parents)
    sibling_sum: dict[int, float] = {}
    for node, (parent, prob) in enumerate(zip(parents, probs)):
        if not -1 <= parent < num_nodes or parent == node:
            raise ValueError(
                f"node {node} has invalid parent {parent} (allowed: -1..{num_nodes - 1})"
            )
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"node {node} acceptance probability {prob} is not in [0, 1]")
        sibling_sum[parent] = sibling_sum.get(parent, 0.0) + prob
    for parent, total in sibling_sum.items():
        if total > 1.0 + 1e-9:
            raise ValueError(
                f"children of node {parent} have acceptance probabilities summing to {total} > 1 "
                "(siblings are mutually exclusive)"
            )
    path_prob: list[float | None] = [None] * num_nodes

    def resolve(node: int) -> float:
        # walk up to the first resolved ancestor, then fill the chain back down
        chain, current = [], node
        while current != -1 and path_prob[current] is None:
            if current in chain:
                raise ValueError(f"parents contain a cycle through node {current}")
            chain.append(current)
            current = parents[current]
        above = 1.0 if current == -1 else path_prob[current]
        for member in reversed(chain):
            above *= probs[member]
            path_prob[member] = above
        return path_prob[node]

    return 1.0 + sum(resolve(node) for node in range(num_nodes))


def theory_table(
    alphas: Sequence[float], gammas: Sequence[int], c: float, verify_cost: VerifyCost = None
) -> list[dict]:
    """One row per (alpha, gamma): {"alpha", "gamma", "tau", "verify_ratio", "speedup"}."""
    rows = []
    for alpha in alphas:
        for gamma in gammas:
            verify = _verify_ratio(verify_cost, _check_gamma(gamma) + 1)
            rows.append({
                "alpha": float(alpha),
                "gamma": int(gamma),
                "tau": expected_tau(alpha, gamma),
                "verify_ratio": verify,
                "speedup": expected_speedup(alpha, gamma, c, verify),
            })
    return rows


# ---------------------------------------------------------------------------- CLI


def parse_float_list(text: str) -> list[float]:
    """'0.6,0.7,0.8' -> [0.6, 0.7, 0.8]."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers like 0.6,0.7, got {text!r}") from None
    if not values:
        raise ValueError(f"expected at least one number, got {text!r}")
    return values


def parse_int_range(text: str) -> list[int]:
    """'1..8' -> [1..8] inclusive; '1,2,4' -> [1, 2, 4]; both may be mixed: '1..3,8'."""
    values: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            if ".." in part:
                low, high = (int(x) for x in part.split(".."))
                if high < low:
                    raise ValueError
                values.extend(range(low, high + 1))
            else:
                values.append(int(part))
        except ValueError:
            raise ValueError(
                f"expected integers or inclusive ranges like 1..8 or 1,2,4, got {text!r}"
            ) from None
    if not values:
        raise ValueError(f"expected at least one integer, got {text!r}")
    return values


def parse_verify_cost(text: str | None) -> VerifyCost:
    """None -> ideal (1); a number -> constant ratio; a path -> CostTable JSON (its ratio(k))."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    path = Path(text)
    if not path.is_file():
        raise ValueError(
            f"--verify-cost must be a number (T(gamma+1)/T(1)) or a cost-table JSON file "
            f"(specdec profile --json), got {text!r}"
        )
    from specdec.cost import CostTable  # local: cost.py pulls in torch

    return CostTable.load(path).ratio


def add_theory_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``specdec theory``."""
    parser.add_argument("--alpha", default="0.5,0.6,0.7,0.8,0.9",
                        help="acceptance probabilities, comma-separated")
    parser.add_argument("--gamma", default="1..8", help="draft lengths: 1..8 or 1,2,4")
    parser.add_argument("--c", type=float, default=0.05,
                        help="draft cost per token relative to one target step")
    parser.add_argument("--verify-cost", default=None,
                        help="T(gamma+1)/T(1): a constant, or a cost-table JSON from "
                             "`specdec profile --json`; default 1 (memory-bound ideal)")
    parser.add_argument("--max-gamma", type=int, default=32,
                        help="search limit for the optimal gamma")
    parser.add_argument("--json", action="store_true", help="print rows as JSON instead")
    return parser


def run_theory(args: argparse.Namespace, out=None) -> int:
    """Print E[tau], speedup and the optimal gamma per alpha; returns the exit code."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    out = out if out is not None else sys.stdout
    alphas = parse_float_list(args.alpha)
    gammas = parse_int_range(args.gamma)
    verify_cost = parse_verify_cost(args.verify_cost)
    rows = theory_table(alphas, gammas, args.c, verify_cost)
    optimum = {a: optimal_gamma(a, args.c, args.max_gamma, verify_cost) for a in alphas}
    if args.json:
        best = [{"alpha": a, "gamma": g, "speedup": s} for a, (g, s) in optimum.items()]
        print(json.dumps({"rows": rows, "optimal": best}), file=out)
        return 0
    console = Console(file=out, width=max(80, 14 + 9 * len(gammas) + 22))
    by_cell = {(row["alpha"], row["gamma"]): row for row in rows}
    for metric, title in (("tau", "E[tau] tokens per target forward"),
                          ("speedup", f"expected speedup (c={args.c})")):
        table = Table(title=escape(title))  # "[tau]" is not markup
        table.add_column("alpha", justify="right")
        for gamma in gammas:
            table.add_column(f"g={gamma}", justify="right")
        if metric == "speedup":
            table.add_column(f"best g<={args.max_gamma}", justify="right")
        for alpha in alphas:
            cells = [f"{by_cell[(alpha, g)][metric]:.2f}" for g in gammas]
            if metric == "speedup":
                best_gamma, best_speedup = optimum[alpha]
                cells.append(f"{best_gamma} ({best_speedup:.2f}x)")
            table.add_row(f"{alpha:.2f}", *cells)
        console.print(table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specdec.theory --alpha 0.8 --gamma 1..8``."""
    parser = add_theory_arguments(
        argparse.ArgumentParser(prog="specdec theory", description=__doc__.splitlines()[0])
    )
    args = parser.parse_args(argv)
    try:
        return run_theory(args)
    except ValueError as error:
        parser.error(str(error))
        return 2


if __name__ == "__main__":
    sys.exit(main())
