"""Per-sequence speculative-decoding statistics (SpecStats).

The generation loop calls, once per draft -> verify step::

    stats.record_step(drafted=num_draft_nodes, accepted=k, tokens_emitted=m)

and, if its prefill forward emits the first token, ``stats.record_prefill(tokens_emitted=1)``.
Timing is accumulated with ``with stats.timer("draft"): ...`` (also "verify", "other", "total").

Definitions (Spec-Bench):
  * ``tau`` = mean tokens emitted per verify step = accepted draft tokens + the one bonus /
    correction token, averaged over steps. The prefill forward is not a verify step and is
    excluded, so plain decoding has tau == 1 exactly.
  * ``acceptance_rate`` = accepted / drafted over all steps (for trees, drafted counts every node,
    so this is "accepted per node verified", lower than for a chain of the same depth).
  * ``acceptance_per_position[d-1]`` = among steps that drafted something at depth d, the fraction
    whose accepted path reached depth d (unconditional on earlier depths).
  * ``conditional_acceptance_per_position[d-1]`` = among steps that drafted depth d AND accepted
    depths 1..d-1, the fraction that accepted depth d (the per-depth alpha of the theory).
  * ``drafted_by_source`` / ``accepted_by_source``: draft nodes sent to verification / accepted,
    per source, for drafts whose nodes name their source (Draft.sources: the `hybrid` drafter).

SpecStats objects merge (``a.merge(b)`` in place, ``SpecStats.combine([...])`` fresh), so a server
can aggregate per-request stats into totals.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# timer name -> attribute it accumulates into (a table, not an if/elif chain)
_TIMER_FIELDS = {
    "draft": "time_draft_s",
    "verify": "time_verify_s",
    "other": "time_other_s",
    "total": "time_total_s",
}


def _add_padded(into: list[int], other: list[int]) -> None:
    """Element-wise ``into += other``, growing ``into`` with zeros as needed."""
    if len(other) > len(into):
        into.extend([0] * (len(other) - len(into)))
    for index, value in enumerate(other):
        into[index] += value


def _ratios(numerators: list[int], denominators: list[int]) -> list[float | None]:
    """numerator / denominator per depth, None where nothing was observed."""
    return [num / den if den else None for num, den in zip(numerators, denominators)]


@dataclass
class SpecStats:
    """Counters and timers for one generated sequence (or a merged set of sequences).

    Per-depth lists are indexed by depth - 1 (index 0 = the first drafted position).
    """

    target_forwards: int = 0  # every target forward: prefill + verify steps
    drafted_tokens: int = 0  # draft nodes sent to verification (tree: all nodes)
    accepted_tokens: int = 0  # draft tokens accepted (excludes the bonus/correction token)
    generated_tokens: int = 0  # tokens appended to the output (prefill token included)
    steps: int = 0  # verify steps (target forwards after the prefill)
    step_tokens: int = 0  # tokens emitted by verify steps (numerator of tau)
    sequences: int = 1  # how many sequences were merged into this object
    tau_histogram: dict[int, int] = field(default_factory=dict)  # tokens per step -> count
    proposed_at_depth: list[int] = field(default_factory=list)  # steps that drafted depth d
    reached_at_depth: list[int] = field(default_factory=list)  # ... and accepted depths < d
    accepted_at_depth: list[int] = field(default_factory=list)  # steps that accepted depth d
    drafted_by_source: dict[str, int] = field(default_factory=dict)  # source name -> nodes verified
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # source name -> nodes accepted
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_other_s: float = 0.0
    time_total_s: float = 0.0

    # ------------------------------------------------------------------ recording
    def record_prefill(self, tokens_emitted: int = 1) -> None:
        """Count the prefill forward and the token(s) it produced (not a verify step)."""
        if tokens_emitted < 0:
            raise ValueError(f"tokens_emitted must be >= 0, got {tokens_emitted}")
        self.target_forwards += 1
        self.generated_tokens += tokens_emitted

    def record_step(
        self,
        drafted: int,
        accepted: int,
        tokens_emitted: int | None = None,
        max_depth: int | None = None,
    ) -> None:
        """Record one draft -> verify step.

        Args:
            drafted: draft nodes verified this step (0 = a plain decoding step).
            accepted: draft tokens accepted (the length of the accepted path).
            tokens_emitted: tokens appended to the output this step; defaults to accepted + 1
                (accepted + bonus/correction). Smaller when EOS / max_new_tokens cut it.
            max_depth: deepest drafted position; defaults to ``drafted`` (a chain). For a tree
                pass its depth so per-position acceptance is per depth, not per node.
        """
        if max_depth is None:
            max_depth = drafted
        if tokens_emitted is None:
            tokens_emitted = accepted + 1
        if drafted < 0 or accepted < 0 or tokens_emitted < 0:
            raise ValueError(
                f"drafted, accepted, tokens_emitted must be >= 0, got {drafted}, {accepted}, "
                f"{tokens_emitted}"
            )
        if not 0 <= max_depth <= drafted:
            raise ValueError(f"max_depth must be in [0, drafted={drafted}], got {max_depth}")
        if accepted > max_depth:
            raise ValueError(f"accepted={accepted} exceeds the drafted depth {max_depth}")
        if tokens_emitted > accepted + 1:
            raise ValueError(
                f"tokens_emitted={tokens_emitted} exceeds accepted + 1 = {accepted + 1}"
            )
        self.target_forwards += 1
        self.steps += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.generated_tokens += tokens_emitted
        self.step_tokens += tokens_emitted
        self.tau_histogram[tokens_emitted] = self.tau_histogram.get(tokens_emitted, 0) + 1
        # depth d (1-based) is proposed when d <= max_depth, reached when also accepted >= d-1
        # (all three lists are padded to max_depth so they stay the same length)
        reached = min(max_depth, accepted + 1)
        _add_padded(self.proposed_at_depth, [1] * max_depth)
        _add_padded(self.reached_at_depth, [1] * reached + [0] * (max_depth - reached))
        _add_padded(self.accepted_at_depth, [1] * accepted + [0] * (max_depth - accepted))

    def record_sources(self, sources: tuple[str, ...], accepted_path: list[int]) -> None:
        """Count one step's draft nodes per source (`sources[i]` proposed node i) and the accepted
        path's nodes (node indices) per source."""
        for name in sources:
            self.drafted_by_source[name] = self.drafted_by_source.get(name, 0) + 1
        for node in accepted_path:
            self.accepted_by_source[sources[node]] = self.accepted_by_source.get(sources[node], 0) + 1

    @contextmanager
    def timer(self, name: str, clock=time.perf_counter) -> Iterator[None]:
        """``with stats.timer("draft"):`` adds the elapsed seconds to ``time_draft_s``."""
        if name not in _TIMER_FIELDS:
            raise ValueError(f"unknown timer {name!r}; allowed: {sorted(_TIMER_FIELDS)}")
        attribute = _TIMER_FIELDS[name]
        start = clock()
        try:
            yield
        finally:
            setattr(self, attribute, getattr(self, attribute) + (clock() - start))

    # ------------------------------------------------------------------ merging
    def merge(self, other: SpecStats) -> SpecStats:
        """Add ``other`` into ``self`` (in place) and return ``self``."""
        if not isinstance(other, SpecStats):
            raise ValueError(f"can only merge SpecStats, got {type(other).__name__}")
        for name in (
            "target_forwards", "drafted_tokens", "accepted_tokens", "generated_tokens", "steps",
            "step_tokens", "sequences", "time_draft_s", "time_verify_s", "time_other_s",
            "time_total_s",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.tau_histogram, other.tau_histogram), (self.drafted_by_source, other.drafted_by_source),
                             (self.accepted_by_source, other.accepted_by_source)):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count
        _add_padded(self.proposed_at_depth, other.proposed_at_depth)
        _add_padded(self.reached_at_depth, other.reached_at_depth)
        _add_padded(self.accepted_at_depth, other.accepted_at_depth)
        return self

    @classmethod
    def combine(cls, stats_list: Iterable[SpecStats]) -> SpecStats:
        """A fresh SpecStats holding the sum of all ``stats_list`` (inputs are not modified)."""
        total = cls(sequences=0)
        for stats in stats_list:
            total.merge(stats)
        return total

    # ------------------------------------------------------------------ derived values
    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify step (accepted + bonus); 0.0 before any step."""
        return self.step_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens; 0.0 when nothing was drafted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float | None]:
        """Per depth d: P(depth d accepted | depth d drafted)."""
        return _ratios(self.accepted_at_depth, self.proposed_at_depth)

    @property
    def conditional_acceptance_per_position(self) -> list[float | None]:
        """Per depth d: P(depth d accepted | depth d drafted and depths < d accepted)."""
        return _ratios(self.accepted_at_depth, self.reached_at_depth)

    @property
    def wall_time_s(self) -> float:
        """time_total_s when the loop timed the whole call, else the sum of the parts."""
        if self.time_total_s > 0:
            return self.time_total_s
        return self.time_draft_s + self.time_verify_s + self.time_other_s

    @property
    def tokens_per_second(self) -> float | None:
        """generated_tokens / wall time; None when no time was recorded."""
        wall = self.wall_time_s
        return self.generated_tokens / wall if wall > 0 else None

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict:
        """JSON-ready dict of counters, timers and derived values (histogram keys are strings)."""
        return {
            "target_forwards": self.target_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "step_tokens": self.step_tokens,
            "sequences": self.sequences,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "tau_histogram": {str(k): v for k, v in sorted(self.tau_histogram.items())},
            "proposed_at_depth": list(self.proposed_at_depth),
            "reached_at_depth": list(self.reached_at_depth),
            "accepted_at_depth": list(self.accepted_at_depth),
            "acceptance_per_position": self.acceptance_per_position,
            "conditional_acceptance_per_position": self.conditional_acceptance_per_position,
            "drafted_by_source": dict(sorted(self.drafted_by_source.items())),
            "accepted_by_source": dict(sorted(self.accepted_by_source.items())),
            "time_draft_s": self.time_draft_s,
            "time_verify_s": self.time_verify_s,
            "time_other_s": self.time_other_s,
            "time_total_s": self.time_total_s,
            "tokens_per_second": self.tokens_per_second,
        }

    @classmethod
    def from_dict(cls, data: dict) -> SpecStats:
        """Inverse of ``to_dict`` (derived values are recomputed, not read)."""
        return cls(
            target_forwards=int(data["target_forwards"]),
            drafted_tokens=int(data["drafted_tokens"]),
            accepted_tokens=int(data["accepted_tokens"]),
            generated_tokens=int(data["generated_tokens"]),
            steps=int(data["steps"]),
            step_tokens=int(data["step_tokens"]),
            sequences=int(data.get("sequences", 1)),
            tau_histogram={int(k): int(v) for k, v in data.get("tau_histogram", {}).items()},
            proposed_at_depth=[int(v) for v in data.get("proposed_at_depth", [])],
            reached_at_depth=[int(v) for v in data.get("reached_at_depth", [])],
            accepted_at_depth=[int(v) for v in data.get("accepted_at_depth", [])],
            drafted_by_source={str(k): int(v) for k, v in data.get("drafted_by_source", {}).items()},
            accepted_by_source={str(k): int(v) for k, v in data.get("accepted_by_source", {}).items()},
            time_draft_s=float(data.get("time_draft_s", 0.0)),
            time_verify_s=float(data.get("time_verify_s", 0.0)),
            time_other_s=float(data.get("time_other_s", 0.0)),
            time_total_s=float(data.get("time_total_s", 0.0)),
        )

    def summary_table(self, max_depths: int = 8) -> str:
        """Plain-text summary for ``--stats`` (fixed-width, no terminal codes)."""
        speed = self.tokens_per_second
        rows = [
            ("sequences", f"{self.sequences}"),
            ("generated tokens", f"{self.generated_tokens}"),
            ("target forwards", f"{self.target_forwards} ({self.steps} verify steps)"),
            ("tau (tokens/step)", f"{self.tau:.3f}"),
            ("drafted / accepted", f"{self.drafted_tokens} / {self.accepted_tokens}"),
            ("acceptance rate", f"{self.acceptance_rate:.3f}"),
            ("tokens/s", "n/a" if speed is None else f"{speed:.2f}"),
            (
                "time draft/verify/other/total s",
                f"{self.time_draft_s:.3f} / {self.time_verify_s:.3f} / "
                f"{self.time_other_s:.3f} / {self.time_total_s:.3f}",
            ),
        ]
        if self.tau_histogram:
            histogram = ", ".join(f"{k}:{v}" for k, v in sorted(self.tau_histogram.items()))
            rows.append(("tokens/step histogram", histogram))
        per_position = self.acceptance_per_position[:max_depths]
        if per_position:
            rows.append((
                "accept by position 1..",
                " ".join("-" if r is None else f"{r:.2f}" for r in per_position),
            ))
        if self.drafted_by_source:
            by_source = sorted(self.drafted_by_source.items())
            rows.append(("accepted / drafted by source",
                         ", ".join(f"{name} {self.accepted_by_source.get(name, 0)}/{count}" for name, count in by_source)))
        width = max(len(name) for name, _ in rows)
        lines = ["speculative decoding stats"]
        lines += [f"  {name.ljust(width)}  {value}" for name, value in rows]
        return "\n".join(lines)
