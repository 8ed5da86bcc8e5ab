"""How many draft positions each request verifies this step (DSpark's Algorithm 1).

A drafter that scores its own positions (`Draft.confidences`: c[r][j] = P(position j accepted |
position j - 1 accepted)) drafts a whole block; `admit` then picks, across every request that
shares the verify forward, the prefix of each block worth verifying on this hardware:

    survival a[r][j] = c[r][0] * ... * c[r][j]       (expected tokens position j adds)
    start: B = R tokens (each request's root), tau = R, best = R * SPS(R)
    visit positions by decreasing survival, ties by (request, position):
        B += 1, tau += a;  keep while tau * SPS(B) beats the best so far, else STOP.

Why the stop, and not "the best B over all": confidences are computed from the drafted tokens
(c[r][j] depends on the tokens before j), so a rule that looks at later positions before
deciding on earlier ones makes "is x_1 verified?" depend on x_1 itself, and rejection sampling
then no longer returns the target's distribution (DSpark, Appendix A: a (0.7, 0.3) target
comes out as (0.85, 0.15); tests/test_schedule.py reproduces it). Walking in survival order and
stopping at the first non-improvement decides position j only from positions visited before it
(its own ancestors and other requests, never its descendants), which is non-anticipating.
The same rule therefore also needs c[r][j] to be known before x_j is drawn (a function of the
tokens before j, never of x_j itself).

Survivals from pre-draft estimates (specdec.acceptance's AcceptanceTracker) use the same walk
through `admit_survivals`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def survivals(confidences: Sequence[float]) -> list[float]:
    """Per-position conditional acceptance c_j -> survival a_j = prod_{i<=j} c_i."""
    result, running = [], 1.0
    for value in confidences:
        running *= value
        result.append(running)
    return result


def admit(confidences: Sequence[Sequence[float]], steps_per_second: Callable[[int], float]) -> list[int]:
    """Draft positions each request verifies (a prefix of its block; 0 = only its root token).

    confidences[r][j]: request r's P(position j accepted | position j - 1 accepted), in [0, 1].
    steps_per_second(B): verify forwards per second for B tokens in total (all requests'
    roots and admitted positions), > 0.
    """
    checked = [check_probabilities(f"confidences[{request}]", values) for request, values in enumerate(confidences)]
    return admit_survivals([survivals(values) for values in checked], steps_per_second)


def admit_survivals(per_request_survivals: Sequence[Sequence[float]], steps_per_second: Callable[[int], float]) -> list[int]:
    """`admit` for callers that already hold survivals (each request's list non-increasing)."""
    num_requests = len(per_request_survivals)
    if num_requests == 0:
        return []
    candidates = []  # (survival, request, position)
    for request, values in enumerate(per_request_survivals):
        values = check_probabilities(f"survivals[{request}]", values)
        for position, value in enumerate(values):
            if position and value > values[position - 1]:
                raise ValueError(
                    f"survivals[{request}] must not increase along the block (a position survives only if its "
                    f"parent does); position {position} ({value}) > position {position - 1} ({values[position - 1]})"
                )
            candidates.append((value, request, position))
    # best first; within a request the earlier position wins ties, so admitted positions stay prefixes
    candidates.sort(key=lambda item: (-item[0], item[1], item[2]))
    tokens, expected = num_requests, float(num_requests)
    best = expected * _rate(steps_per_second, tokens)
    admitted = [0] * num_requests
    for value, request, _ in candidates:
        throughput = (expected + value) * _rate(steps_per_second, tokens + 1)
        if not throughput > best:
            break  # the first non-improvement ends the walk (never look further: non-anticipation)
        tokens, expected, best = tokens + 1, expected + value, throughput
        admitted[request] += 1
    return admitted


def _rate(steps_per_second: Callable[[int], float], tokens: int) -> float:
    rate = float(steps_per_second(tokens))
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"steps_per_second({tokens}) must be a finite number > 0, got {rate}")
    return rate


def check_probabilities(name: str, values: Sequence[float]) -> list[float]:
    """Floats in [0, 1] (NaN, other numbers and non-numbers are a clear ValueError)."""
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of probabilities, got {values!r}") from None
    for index, value in enumerate(values):
        if not 0.0 <= value <= 1.0:  # also rejects NaN
            raise ValueError(f"{name}[{index}] = {value} is not a probability in [0, 1]")
    return values
