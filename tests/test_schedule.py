"""The confidence scheduler (specdec.schedule.admit, DSpark Algorithm 1): hand-computed cases,
the Appendix A counterexample through the real acceptance code, and the real loop on SmolLM2."""

import itertools
import math
import random
from collections import Counter

import pytest
import torch
from scipy.stats import binomtest, chisquare

from specdec.budget import AutoBudget
from specdec.cost import CostTable
from specdec.draft import Draft
from specdec.drafters import make_drafter
from specdec.loop import SpecBatch, run
from specdec.sampling import SamplingParams, warp_logits_to_probs
from specdec.schedule import admit, survivals
from specdec.verify import verify_chain


def table_rate(values: dict[int, float]):
    """steps_per_second from a table of B -> SPS(B) (a B outside it is a test error)."""
    return lambda tokens: values[tokens]


# ---------------------------------------------------------------------------- hand-computed cases


def test_one_request_admits_while_throughput_rises():
    # survivals 0.9, 0.72, 0.072; best starts at 1 x SPS(1) = 1
    # B=2: (1 + 0.9) x 0.9 = 1.71 > 1 keep; B=3: 2.62 x 0.85 = 2.227 > 1.71 keep;
    # B=4: 2.692 x 0.8 = 2.154 < 2.227 stop
    rate = table_rate({1: 1.0, 2: 0.9, 3: 0.85, 4: 0.8})
    assert admit([[0.9, 0.8, 0.1]], rate) == [2]
    assert survivals([0.9, 0.8, 0.1]) == pytest.approx([0.9, 0.72, 0.072], rel=1e-12)


def test_the_walk_stops_at_the_first_non_improvement_even_when_a_later_position_would_help():
    # survivals 0.5, 0.5, 0.5; B=2: 1.5 x 0.6 = 0.9 < 1 stop, although B=4 would give 2.5 x 0.6 = 1.5
    rate = table_rate({1: 1.0, 2: 0.6, 3: 0.6, 4: 0.6})
    assert admit([[0.5, 1.0, 1.0]], rate) == [0]
    assert (1 + 0.5 * 3) * rate(4) > 1 * rate(1)


def test_three_requests_by_decreasing_survival():
    # survivals r0: 0.9, 0.81; r1: 0.3; r2: 0.6, 0.3 -> visit (r0,0) (r0,1) (r2,0) (r1,0) (r2,1)
    # SPS(B) = 10 / (B + 7); start B=3, tau=3, best 3.0
    # B=4: 3.9 x 10/11 = 3.545 keep; B=5: 4.71 x 10/12 = 3.925 keep; B=6: 5.31 x 10/13 = 4.085 keep;
    # B=7: 5.61 x 10/14 = 4.007 stop
    assert admit([[0.9, 0.9], [0.3], [0.6, 0.5]], lambda tokens: 10.0 / (tokens + 7)) == [2, 0, 1]


def test_ties_go_to_the_earlier_request_then_the_earlier_position():
    # two identical requests, survivals 0.8, 0.4 each; SPS(2..6) = 1, 0.9, 0.8, 0.75, 0.65
    # B=3: 2.8 x 0.9 = 2.52 keep (r0); B=4: 3.6 x 0.8 = 2.88 keep (r1); B=5: 4.0 x 0.75 = 3.0 keep (r0 wins
    # the 0.4 tie); B=6: 4.4 x 0.65 = 2.86 stop
    rate = table_rate({2: 1.0, 3: 0.9, 4: 0.8, 5: 0.75, 6: 0.65})
    assert admit([[0.8, 0.5], [0.8, 0.5]], rate) == [2, 1]
    # a position whose confidence is 1 ties with its parent and comes right after it (its own
    # request first), so a request keeps a prefix; here r0's 2nd position beats r1's 1st
    rate = table_rate({2: 1.0, 3: 0.9, 4: 0.8, 5: 0.1})
    assert admit([[0.5, 1.0], [0.5]], rate) == [2, 0]


@pytest.mark.parametrize("seed", range(4))
def test_admitted_positions_are_the_best_prefixes_and_the_walk_stops_at_the_first_drop(seed):
    rng = random.Random(seed)
    for _ in range(50):
        confidences = [[rng.choice([1.0, rng.random()]) for _ in range(rng.randint(0, 6))] for _ in range(rng.randint(1, 5))]
        base, slope = rng.uniform(5, 20), rng.uniform(0.0, 3.0)
        rate = lambda tokens: 1000.0 / (base + slope * tokens)  # noqa: E731
        counts = admit(confidences, rate)
        assert all(0 <= count <= len(c) for count, c in zip(counts, confidences))
        scores = [survivals(c) for c in confidences]
        kept = [s[j] for s, count in zip(scores, counts) for j in range(count)]
        left = [s[j] for s, count in zip(scores, counts) for j in range(count, len(s))]
        assert not kept or not left or min(kept) >= max(left)
        # throughput along the walk rose at every admitted position and the next one would not raise it
        requests = len(confidences)
        tokens, expected = requests + len(kept), requests + sum(kept)
        walk = [(requests + sum(sorted(kept, reverse=True)[:n])) * rate(requests + n) for n in range(len(kept) + 1)]
        assert all(b > a for a, b in zip(walk, walk[1:]))
        if left:
            assert (expected + max(left)) * rate(tokens + 1) <= walk[-1]


def test_edge_cases_and_bad_input():
    assert admit([], lambda tokens: 1.0) == []
    assert admit([[], []], lambda tokens: 1.0) == [0, 0]
    assert admit([[1.0, 1.0]], lambda tokens: 1.0) == [2]  # free verify, certain acceptance: take all
    assert admit([[0.0, 1.0]], lambda tokens: 1.0) == [0]  # survival 0 never raises throughput
    for bad in ([[1.5]], [[-0.1]], [[float("nan")]], [["x"]], ["0.5"], [None]):
        with pytest.raises(ValueError, match="probabilit"):
            admit(bad, lambda tokens: 1.0)
    for rate in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"steps_per_second\(1\) must be a finite number > 0"):
            admit([[0.5]], lambda tokens, rate=rate: rate)


# ---------------------------------------------------------------------------- DSpark Appendix A


TOKEN_A, TOKEN_B = 0, 1
TARGET = torch.tensor([0.7, 0.3])  # the target's next-token distribution, at every position
PROPOSAL = torch.tensor([0.5, 0.5])  # the drafter's q
SAMPLES = 4000


def global_best_admit(confidences, steps_per_second):
    """The WRONG scheduler: the same walk, but keeps the best prefix over all positions instead of
    stopping at the first non-improvement, so earlier positions are decided by later confidences."""
    scores = [(a, r, j) for r, c in enumerate(confidences) for j, a in enumerate(survivals(c))]
    scores.sort(key=lambda item: (-item[0], item[1], item[2]))
    requests = len(confidences)
    walk = [(requests + sum(a for a, _, _ in scores[:n])) * steps_per_second(requests + n) for n in range(len(scores) + 1)]
    best = max(range(len(walk)), key=lambda n: (walk[n], -n))
    counts = [0] * requests
    for _, request, _ in scores[:best]:
        counts[request] += 1
    return counts


def generate_two_tokens(scheduler, rate, generator) -> tuple[list[int], list[int]]:
    """Steps of draft (x1, x2 ~ q; c1 = 0.5, c2 = 1 if x1 is A else 0) -> schedule -> verify
    (specdec.verify) until two tokens are emitted; returns them and each step's verified length."""
    emitted, verified = [], []
    while len(emitted) < 2:
        drafted = torch.multinomial(PROPOSAL, 2, replacement=True, generator=generator)
        confidences = [0.5, 1.0 if int(drafted[0]) == TOKEN_A else 0.0]
        draft = Draft.chain(drafted, PROPOSAL.repeat(2, 1), confidences)
        draft = draft.prefix(scheduler([confidences], rate)[0])
        result = verify_chain(draft.tokens, draft.draft_probs, TARGET.repeat(len(draft) + 1, 1), generator)
        emitted += result.tokens
        verified.append(len(draft))
    return emitted[:2], verified


APPENDIX_A_RATE = table_rate({1: 1.0, 2: 0.6, 3: 0.55})


def first_token_counts(scheduler) -> int:
    generator = torch.Generator().manual_seed(1234)
    return sum(generate_two_tokens(scheduler, APPENDIX_A_RATE, generator)[0][0] == TOKEN_A for _ in range(SAMPLES))


def test_appendix_a_global_best_turns_0_7_into_0_85_and_the_test_catches_it():
    # x1 = A (prob 0.5): B=3 gives (1 + 0.5 + 0.5) x 0.55 = 1.1 > 1, so the global best verifies
    # both and A is always accepted (p/q = 1.4); x1 = B: nothing pays, plain sampling gives A with 0.7.
    # P(A) = 0.5 + 0.5 x 0.7 = 0.85 instead of 0.7.
    wrong = first_token_counts(global_best_admit)
    assert binomtest(wrong, SAMPLES, 0.7).pvalue < 1e-12
    assert wrong / SAMPLES == pytest.approx(0.85, abs=4 * math.sqrt(0.85 * 0.15 / SAMPLES))


def test_appendix_a_admit_keeps_the_target_distribution():
    # B=2 gives 1.5 x 0.6 = 0.9 < 1: admit stops before looking at position 2 whatever x1 is
    right = first_token_counts(admit)
    assert binomtest(right, SAMPLES, 0.7).pvalue > 1e-3


def test_token_dependent_admission_keeps_the_joint_of_two_tokens():
    """SPS(2) = 0.8, SPS(3) = 0.75: admit verifies x1 always and x2 only when x1 is A (2 x 0.75 =
    1.5 > 1.5 x 0.8 = 1.2), so the verified length depends on the drafted tokens, and the first
    two emitted tokens must still be i.i.d. from the target."""
    rate = table_rate({1: 1.0, 2: 0.8, 3: 0.75})
    generator = torch.Generator().manual_seed(99)
    pairs, lengths = Counter(), Counter()
    for _ in range(SAMPLES):
        tokens, verified = generate_two_tokens(admit, rate, generator)
        pairs[tuple(tokens)] += 1
        lengths.update(verified)
    assert lengths[1] > SAMPLES / 4 and lengths[2] > SAMPLES / 4 and set(lengths) == {1, 2}
    cells = list(itertools.product((TOKEN_A, TOKEN_B), repeat=2))
    expected = [SAMPLES * float(TARGET[a] * TARGET[b]) for a, b in cells]
    assert chisquare([pairs[cell] for cell in cells], expected).pvalue > 1e-3


# ---------------------------------------------------------------------------- the real loop


# a CPU-like verify cost: each token in the forward adds 1 ms to 10 ms, so a position is admitted
# only while its survival is worth its share (3 requests: above ~0.2; 16 requests: above ~0.6)
LOOP_TABLE = CostTable({}, [1, 2, 4, 8, 16, 64], [11.0, 12.0, 14.0, 18.0, 26.0, 74.0])
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


def scheduled_policy(table=LOOP_TABLE):
    # the tempered test drafter runs the target itself: its draft time says nothing about a real
    # drafter's, so it is priced at zero to keep the steps drafting (what these tests exercise)
    return AutoBudget(table, max_budget=6, draft_ms_per_token=0.0)


@pytest.mark.slow
def test_greedy_batch_with_scheduling_equals_plain(smollm2):
    prompts = [smollm2.encode_prompt(p) for p in PROMPTS]
    drafter = make_drafter("tempered", smollm2, gamma=4, draft_temperature=0.7)
    spec = run(smollm2, prompts, drafter, 16, budget_policy=scheduled_policy()).finish()
    plain = run(smollm2, prompts, None, 16).finish()
    for got, want in zip(spec, plain):
        assert got.tokens == want.tokens and got.text == want.text
    verified = sum(g.stats.drafted_tokens for g in spec)
    blocks = sum(g.stats.steps for g in spec) * 4
    assert 0 < verified < blocks  # the scheduler cut some blocks and verified some positions
    assert sum(g.stats.accepted_tokens for g in spec) > 0


@pytest.mark.slow
def test_sampled_tokens_through_the_scheduled_loop_follow_the_target(smollm2):
    """temperature 0.8, top_k 3: the first two tokens of 192 seeded sequences (the prefill's and
    the first scheduled step's; batches of 16, one scheduler call per step across the batch)
    against their exact joint from the target. Position 1's confidence depends on the first
    token, position 2's on the drafted token, so the verified length depends on the tokens."""
    params = dict(temperature=0.8, top_k=3)
    prompt = smollm2.tokenizer.encode("My favourite colour is", add_special_tokens=False)  # short: prefill is most of the cost
    joint = exact_joint(smollm2, prompt, SamplingParams(**params), length=2)
    drafter = make_drafter("tempered", smollm2, gamma=2, draft_temperature=1.0)
    # 16 rows share each step: a verified position costs 0.65 ms of a 26 ms step that commits 16 tokens,
    # so it pays above survival 16 * 0.65 / 26 = 0.4 (admit's cut, and whether to draft at all: the
    # prior 0.6 drafts), between the drafter's low (0.2) and high (0.9) confidences
    policy = scheduled_policy(CostTable({}, [1, 2, 4, 8, 16, 64], [11.0, 12.0, 14.0, 18.0, 26.0, 57.2]))
    counts, verified = Counter(), Counter()
    for first_seed in range(0, 192, 16):
        batch = SpecBatch(smollm2, drafter, policy, max_batch=16, max_len=len(prompt) + 8)
        seqs = batch.add([prompt] * 16, [SamplingParams(**params, seed=seed) for seed in range(first_seed, first_seed + 16)],
                         [4] * 16, [()] * 16)
        batch.step()
        for seq in seqs:
            counts[tuple(seq.ctx.output_tokens[:2])] += 1
            verified[seq.stats.drafted_tokens] += 1
    assert len(verified) >= 2 and verified[2] < sum(verified.values())  # the scheduler cut blocks, by the tokens
    assert set(counts) <= set(joint)
    total = sum(counts.values())
    common = [cell for cell in joint if joint[cell] * total >= 5]  # chi-square cells need >= 5 expected
    observed = [counts[cell] for cell in common] + [total - sum(counts[cell] for cell in common)]
    expected = [joint[cell] * total for cell in common]
    expected.append(total - sum(expected))
    assert chisquare(observed, expected).pvalue > 1e-3


def exact_joint(target, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """P(first `length` tokens) under plain sampling: warped target rows, one forward per prefix."""
    joint = {(): 1.0}
    for _ in range(length):
        extended = {}
        for prefix, prob in joint.items():
            tokens = prompt + list(prefix)
            cache = target.new_cache(1, len(tokens) + 1)
            logits, _ = target.forward(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)
            row = warp_logits_to_probs(logits[0, -1], params)  # [V]
            for token in row.nonzero().squeeze(1).tolist():
                extended[prefix + (token,)] = prob * float(row[token])
        joint = extended
    return joint
