"""SpecStats arithmetic: tau counts the bonus token, histogram, per-position acceptance, merge."""

import json
import random

import pytest

from specdec.stats import SpecStats


def test_tau_counts_bonus_and_excludes_prefill():
    stats = SpecStats()
    stats.record_prefill(tokens_emitted=1)
    stats.record_step(drafted=4, accepted=2)  # 2 accepted + correction = 3 tokens
    stats.record_step(drafted=4, accepted=4)  # all accepted + bonus = 5 tokens
    stats.record_step(drafted=0, accepted=0)  # plain decoding step = 1 token
    assert stats.steps == 3
    assert stats.target_forwards == 4
    assert stats.generated_tokens == 1 + 3 + 5 + 1
    assert stats.tau == pytest.approx(9 / 3)
    assert stats.acceptance_rate == pytest.approx(6 / 8)
    assert stats.tau_histogram == {3: 1, 5: 1, 1: 1}


def test_plain_decoding_has_tau_one_and_truncated_steps_count_emitted_tokens():
    plain = SpecStats()
    for _ in range(5):
        plain.record_step(drafted=0, accepted=0)
    assert plain.tau == 1.0
    assert plain.acceptance_rate == 0.0
    cut = SpecStats()
    cut.record_step(drafted=5, accepted=5, tokens_emitted=2)  # max_new_tokens reached
    assert cut.tau == 2.0
    assert cut.accepted_tokens == 5
    assert cut.tau_histogram == {2: 1}


def test_per_position_acceptance_hand_example():
    stats = SpecStats()
    stats.record_step(drafted=3, accepted=1)
    stats.record_step(drafted=2, accepted=2)
    stats.record_step(drafted=4, accepted=0)
    assert stats.proposed_at_depth == [3, 3, 2, 1]
    assert stats.accepted_at_depth == [2, 1, 0, 0]
    assert stats.acceptance_per_position == pytest.approx([2 / 3, 1 / 3, 0.0, 0.0])
    # depth 2 was reached (depth 1 accepted) in steps 1 and 2 only; depth 3 never reached
    assert stats.reached_at_depth == [3, 2, 0, 0]
    conditional = stats.conditional_acceptance_per_position
    assert conditional[:2] == pytest.approx([2 / 3, 1 / 2])
    assert conditional[2:] == [None, None]


def test_per_position_acceptance_matches_direct_count_on_random_steps():
    rng = random.Random(7)
    steps = []
    for _ in range(300):
        drafted = rng.randint(0, 6)
        steps.append((drafted, rng.randint(0, drafted)))
    stats = SpecStats()
    for drafted, accepted in steps:
        stats.record_step(drafted=drafted, accepted=accepted)
    for depth in range(1, 7):
        with_depth = [(g, k) for g, k in steps if g >= depth]
        expected = sum(k >= depth for _, k in with_depth) / len(with_depth)
        assert stats.acceptance_per_position[depth - 1] == pytest.approx(expected)
        reached = [(g, k) for g, k in with_depth if k >= depth - 1]
        if reached:
            expected_conditional = sum(k >= depth for _, k in reached) / len(reached)
            assert stats.conditional_acceptance_per_position[depth - 1] == pytest.approx(
                expected_conditional
            )
    assert stats.tau == pytest.approx(sum(k + 1 for _, k in steps) / len(steps))


def test_tree_step_uses_depth_not_node_count():
    stats = SpecStats()
    stats.record_step(drafted=10, accepted=2, max_depth=3)  # 10 nodes, 3 levels
    assert stats.drafted_tokens == 10
    assert stats.proposed_at_depth == [1, 1, 1]
    assert stats.acceptance_per_position == [1.0, 1.0, 0.0]
    assert stats.acceptance_rate == pytest.approx(0.2)


def test_merge_and_combine_equal_recording_everything_in_one_object():
    rng = random.Random(3)
    everything = SpecStats()
    parts = []
    for _ in range(4):
        part = SpecStats()
        part.record_prefill()
        everything.record_prefill()
        for _ in range(rng.randint(1, 20)):
            drafted = rng.randint(0, 5)
            accepted = rng.randint(0, drafted)
            part.record_step(drafted=drafted, accepted=accepted)
            everything.record_step(drafted=drafted, accepted=accepted)
        part.time_draft_s, part.time_verify_s = 0.5, 0.25
        parts.append(part)
    before = [p.to_dict() for p in parts]
    combined = SpecStats.combine(parts)
    assert [p.to_dict() for p in parts] == before  # combine does not modify its inputs
    assert combined.sequences == 4
    for name in ("target_forwards", "drafted_tokens", "accepted_tokens", "generated_tokens",
                 "steps", "tau_histogram", "proposed_at_depth", "reached_at_depth",
                 "accepted_at_depth"):
        assert getattr(combined, name) == getattr(everything, name), name
    assert combined.tau == pytest.approx(everything.tau)
    assert combined.time_draft_s == pytest.approx(2.0)
    merged = SpecStats.combine(parts[:2])
    assert merged.merge(parts[2]) is merged
    assert merged.steps == sum(p.steps for p in parts[:3])
    with pytest.raises(ValueError):
        merged.merge({"steps": 1})


def test_timer_accumulates_with_given_clock_and_tokens_per_second():
    now = [0.0]
    stats = SpecStats()
    with stats.timer("total", clock=lambda: now[0]):
        with stats.timer("draft", clock=lambda: now[0]):
            now[0] += 0.25
        with stats.timer("verify", clock=lambda: now[0]):
            now[0] += 0.5
        now[0] += 0.25
    stats.record_step(drafted=3, accepted=3)
    assert stats.time_draft_s == pytest.approx(0.25)
    assert stats.time_verify_s == pytest.approx(0.5)
    assert stats.time_total_s == pytest.approx(1.0)
    assert stats.tokens_per_second == pytest.approx(4 / 1.0)
    assert SpecStats().tokens_per_second is None
    with pytest.raises(ValueError, match="unknown timer"):
        with stats.timer("drafting"):
            pass


def test_to_dict_is_json_and_roundtrips():
    stats = SpecStats()
    stats.record_prefill()
    stats.record_step(drafted=3, accepted=1)
    stats.record_step(drafted=3, accepted=3, tokens_emitted=2)
    stats.time_total_s = 2.0
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["tau"] == pytest.approx(2.0)
    assert data["tokens_per_second"] == pytest.approx(5 / 2.0)
    again = SpecStats.from_dict(data)
    assert again.to_dict() == stats.to_dict()


def test_summary_table_mentions_key_numbers():
    stats = SpecStats()
    stats.record_step(drafted=4, accepted=3)
    text = stats.summary_table()
    assert "tau" in text and "4.000" in text
    assert "0.750" in text  # acceptance rate


@pytest.mark.parametrize(
    "kwargs",
    [
        {"drafted": 2, "accepted": 3},
        {"drafted": -1, "accepted": 0},
        {"drafted": 3, "accepted": 1, "tokens_emitted": 3},
        {"drafted": 3, "accepted": 2, "max_depth": 1},
    ],
)
def test_record_step_rejects_inconsistent_counts(kwargs):
    with pytest.raises(ValueError):
        SpecStats().record_step(**kwargs)
