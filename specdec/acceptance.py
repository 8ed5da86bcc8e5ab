"""Running estimates of how often a drafter's proposals are accepted, per depth.

`AcceptanceTracker` keeps a_d = P(depth d accepted | depth d reached) from earlier verify steps;
`chain_path_scores` turns such conditional rates into path survivals P(depths 1..d all accepted),
the scores the budget policy (specdec.budget) and the hybrid drafter's ranking read. Pre-draft
information only: a tracker learns from steps already verified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .schedule import check_probabilities, survivals


def chain_path_scores(accept_probs_by_depth: Sequence[float]) -> list[float]:
    """Per-depth conditional acceptance a_d -> P(depths 1..d all accepted) = prod_{j<=d} a_j."""
    return survivals(check_probabilities("accept_probs_by_depth", accept_probs_by_depth))


@dataclass
class AcceptanceTracker:
    """Running per-depth acceptance estimates a_d = P(depth d accepted | depth d reached).

    Each depth keeps exponentially decayed counts (``decay`` per observation) shrunk toward
    ``prior`` with ``prior_weight`` pseudo-observations, so early estimates are sane and old
    behaviour fades. Depths never observed report the prior.
    """

    prior: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.95
    accepted_weight: list[float] = field(default_factory=list)  # decayed accepts per depth
    reached_weight: list[float] = field(default_factory=list)  # decayed reaches per depth

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {self.prior}")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    def update(self, drafted_depths: int, accepted: int) -> None:
        """One verify step: depths 1..drafted_depths were drafted, the first ``accepted`` kept."""
        if drafted_depths < 0 or not 0 <= accepted <= drafted_depths:
            raise ValueError(
                f"need 0 <= accepted <= drafted_depths, got accepted={accepted}, "
                f"drafted_depths={drafted_depths}"
            )
        self.update_expected([1.0] * accepted + [0.0] * (accepted < drafted_depths))

    def update_expected(self, path_survivals: Sequence[float]) -> None:
        """One step's outcome as probabilities: path_survivals[d - 1] = P(depths 1..d all accepted),
        non-increasing. Depth d counts as reached with its parent's survival (1 for depth 1) and as
        accepted with its own; depths whose parent cannot survive keep their estimates. `update` is
        the 0 / 1 case; a drafter's calibrated confidences give the expected outcome of positions
        that were drafted but not verified."""
        parent = 1.0
        for index, survival in enumerate(check_probabilities("path_survivals", path_survivals)):
            if parent <= 0.0:
                break
            if survival > parent:
                raise ValueError(f"path_survivals must not increase: depth {index + 1} ({survival}) > its parent ({parent})")
            if index == len(self.reached_weight):
                self.reached_weight.append(0.0)
                self.accepted_weight.append(0.0)
            self.reached_weight[index] = self.decay * self.reached_weight[index] + parent
            self.accepted_weight[index] = self.decay * self.accepted_weight[index] + survival
            parent = survival

    def forget(self) -> None:
        """A step without an observation: the counts decay as an observation's step would, so an
        estimate that shut its drafter out drifts back toward the prior and the drafter is tried again."""
        self.reached_weight = [self.decay * weight for weight in self.reached_weight]
        self.accepted_weight = [self.decay * weight for weight in self.accepted_weight]

    def probs(self, max_depth: int) -> list[float]:
        """Estimated a_1..a_max_depth."""
        if max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {max_depth}")
        estimates = []
        for index in range(max_depth):
            accepted = self.accepted_weight[index] if index < len(self.accepted_weight) else 0.0
            reached = self.reached_weight[index] if index < len(self.reached_weight) else 0.0
            estimates.append(
                (self.prior * self.prior_weight + accepted) / (self.prior_weight + reached)
            )
        return estimates

    def path_scores(self, max_depth: int) -> list[float]:
        """P(depths 1..d all accepted) for d = 1..max_depth (input to allocate_batch_budget)."""
        return chain_path_scores(self.probs(max_depth))
