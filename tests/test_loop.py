"""The speculative loop with the test drafters: exactness, stopping rules, batches, seeds."""

import pytest
import torch

from specdec import SamplingParams, generate, generate_batch, make_drafter, stream
from specdec.budget import AutoBudget
from specdec.cost import CostTable
from specdec.loop import run

from conftest import assert_close_to_scale, kernel_is_on

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
DRAFTER_SETUPS = [
    ("oracle", {"gamma": 4}),
    ("random", {"gamma": 3}),
    ("random", {"gamma": 6, "tree": True, "branching": 2}),
]


@pytest.mark.parametrize("name,options", DRAFTER_SETUPS, ids=["oracle", "random-chain", "random-tree"])
def test_greedy_output_identical_to_plain_on_tiny_model(tiny_target, name, options):
    for prompt in ([5, 6, 7, 8], [20, 21], list(range(30, 45))):
        plain = generate(tiny_target, prompt, max_new_tokens=25)
        spec = generate(tiny_target, prompt, make_drafter(name, tiny_target, **options), max_new_tokens=25)
        assert spec.tokens == plain.tokens
        assert len(spec.tokens) == 25 and spec.finish_reason == "length"


def test_oracle_accepts_everything(tiny_target):
    spec = generate(tiny_target, [5, 6, 7, 8], make_drafter("oracle", tiny_target, gamma=4), max_new_tokens=41)
    # 1 token from the prefill, then 8 steps of 4 accepted + 1 bonus = 41
    assert spec.stats.steps == 8 and spec.stats.tau == 5.0
    assert spec.stats.acceptance_rate == 1.0
    assert spec.stats.target_forwards == 9


def test_prefill_runs_the_lm_head_on_each_prompts_last_row_only(smollm2):
    """`logits_at` gives exactly the rows a full forward gives (bitwise with the kernel: rows are
    batch invariant), as [B, 1, V]; a ragged batch's first tokens are unchanged."""
    prompts = [smollm2.encode_prompt(p) for p in PROMPTS]
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    tokens = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts])  # [3, T]
    positions = torch.arange(width).expand(len(prompts), -1)
    valid = torch.arange(width)[None] < lengths[:, None]
    full, _ = smollm2.forward(tokens, positions, smollm2.new_cache(3, width), token_valid=valid)
    last, _ = smollm2.forward(tokens, positions, smollm2.new_cache(3, width), token_valid=valid, logits_at=lengths - 1)
    assert last.shape == (3, 1, smollm2.vocab_size)
    expected = full[torch.arange(3), lengths - 1][:, None]  # [3, 1, V]
    if kernel_is_on():
        assert torch.equal(last, expected)
    else:
        assert_close_to_scale(last, expected)
    assert [r.tokens[0] for r in generate_batch(smollm2, PROMPTS, None, max_new_tokens=1)] == expected[:, 0].argmax(-1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name,options", DRAFTER_SETUPS, ids=["oracle", "random-chain", "random-tree"])
def test_greedy_identical_on_smollm2(smollm2, name, options):
    for prompt in PROMPTS:
        plain = generate(smollm2, prompt, max_new_tokens=24)
        spec = generate(smollm2, prompt, make_drafter(name, smollm2, **options), max_new_tokens=24)
        assert spec.tokens == plain.tokens, prompt
        assert spec.text == plain.text


@pytest.mark.slow
def test_eos_inside_an_accepted_block_stops_exactly(smollm2):
    prompt = "What is the capital of France? Answer in one short sentence."
    plain = generate(smollm2, prompt, max_new_tokens=60)
    assert plain.finish_reason == "stop" and plain.tokens[-1] in smollm2.eos_token_ids
    spec = generate(smollm2, prompt, make_drafter("oracle", smollm2, gamma=6), max_new_tokens=60)
    assert spec.tokens == plain.tokens and spec.finish_reason == "stop"
    # max_new_tokens that cuts inside an accepted block: never exceeded
    for limit in (1, 2, 5, 7):
        cut = generate(smollm2, prompt, make_drafter("oracle", smollm2, gamma=6), max_new_tokens=limit)
        assert cut.tokens == plain.tokens[:limit] and cut.finish_reason == "length"


@pytest.mark.slow
def test_stop_string_stops_where_plain_decoding_does(smollm2):
    prompt = "Count from 1 to 20, separated by commas."
    plain = generate(smollm2, prompt, max_new_tokens=40, stop=["7"])
    spec = generate(smollm2, prompt, make_drafter("oracle", smollm2, gamma=5), max_new_tokens=40, stop=["7"])
    assert "7" not in plain.text and plain.finish_reason == "stop"
    assert spec.tokens == plain.tokens and spec.text == plain.text


@pytest.mark.slow
def test_batch_of_three_equals_each_alone(smollm2):
    drafter = make_drafter("random", smollm2, gamma=4, tree=True)
    batch = generate_batch(smollm2, PROMPTS, drafter, max_new_tokens=20)
    for prompt, result in zip(PROMPTS, batch):
        assert result.tokens == generate(smollm2, prompt, max_new_tokens=20).tokens
    oracle_batch = generate_batch(smollm2, PROMPTS, make_drafter("oracle", smollm2), max_new_tokens=20)
    assert [r.tokens for r in oracle_batch] == [r.tokens for r in batch]


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(smollm2):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    drafter = make_drafter("random", smollm2, gamma=3)
    first = generate(smollm2, PROMPTS[1], drafter, max_new_tokens=20, sampling=params)
    second = generate(smollm2, PROMPTS[1], drafter, max_new_tokens=20, sampling=params)
    other = generate(smollm2, PROMPTS[1], drafter, max_new_tokens=20, sampling=SamplingParams(0.9, 0, 0.95, 99))
    assert first.tokens == second.tokens
    assert first.tokens != other.tokens


def test_stream_concatenates_to_the_generated_text(tiny_target):
    drafter = make_drafter("oracle", tiny_target, gamma=3)
    pieces = list(stream(tiny_target, [5, 6, 7], drafter, max_new_tokens=20))
    assert "".join(pieces) == generate(tiny_target, [5, 6, 7], max_new_tokens=20).text
    assert len(pieces) > 1


def test_auto_budget_turns_speculation_off_when_verify_is_expensive(tiny_target):
    # verifying k tokens costs k times one step: no draft can pay for itself, random drafts never hit
    steep = CostTable({}, [1, 2, 4, 8, 16], [1.0, 2.0, 4.0, 8.0, 16.0])
    policy = AutoBudget(steep, max_budget=6)
    steps = run(tiny_target, [[5, 6, 7]], make_drafter("random", tiny_target, gamma=3), 30, budget_policy=policy)
    results = _drain(steps)
    assert results[0].stats.drafted_tokens <= 6  # only the periodic single-token probes
    # flat cost and a perfect drafter: the policy drafts long chains
    flat = CostTable({}, [1, 16], [1000.0, 1000.0])  # a slow target: the drafting time is negligible
    results = _drain(run(tiny_target, [[5, 6, 7]], make_drafter("oracle", tiny_target, gamma=4), 30,
                         budget_policy=AutoBudget(flat, max_budget=8)))
    assert results[0].stats.tau > 4
    assert results[0].tokens == generate(tiny_target, [5, 6, 7], max_new_tokens=30).tokens


def test_bad_input_is_a_clear_error(tiny_target):
    with pytest.raises(ValueError, match="empty"):
        generate(tiny_target, "   ")
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_target, [1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(tiny_target, [1, 10_000])
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("no-such-drafter", tiny_target)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def _drain(steps):
    return steps.finish()


def test_sequences_join_and_leave_a_running_batch(tiny_target):
    """Continuous batching: a sequence added mid-way, and one removed, leave the others exact."""
    from specdec.loop import SpecBatch

    prompts = [[5, 6, 7], [30, 31, 32, 33, 34], [60, 61]]
    alone = [generate(tiny_target, p, max_new_tokens=12).tokens for p in prompts]
    batch = SpecBatch(tiny_target, make_drafter("random", tiny_target, gamma=3, tree=True), max_batch=3, max_len=64)
    greedy = SamplingParams()
    first, second = batch.add(prompts[:2], [greedy] * 2, [12, 12], [(), ()])
    batch.step()
    batch.step()
    (third,) = batch.add([prompts[2]], [greedy], [12], [()])
    batch.step()
    batch.remove(first)  # a client went away: its row is reused, the others move
    assert first.finish_reason == "cancelled" and len(batch.seqs) == 2
    while batch.seqs:
        batch.step()
    assert second.ctx.output_tokens == alone[1]
    assert third.ctx.output_tokens == alone[2]
    assert first.ctx.output_tokens == alone[0][: len(first.ctx.output_tokens)]
    with pytest.raises(ValueError, match="does not fit"):
        batch.add([list(range(1, 60))], [greedy], [12], [()])


def test_run_yields_each_steps_tokens_and_hands_back_the_result(tiny_target):
    generation = run(tiny_target, [[5, 6, 7], [20, 21]], make_drafter("oracle", tiny_target, gamma=3), 12)
    with pytest.raises(RuntimeError, match="not finished"):
        generation.result
    steps = list(generation)
    results = generation.result
    assert generation.finish() is results  # already finished: nothing runs again
    for row, result in enumerate(results):
        assert [token for step in steps for token in step[row]] == result.tokens
        assert result.tokens == generate(tiny_target, [[5, 6, 7], [20, 21]][row], max_new_tokens=12).tokens


def test_kv_room_sizes_both_the_batch_check_and_the_runs_cache(tiny_target):
    from specdec.budget import FixedBudget
    from specdec.loop import SpecBatch, kv_room

    drafter = make_drafter("oracle", tiny_target, gamma=5)
    assert kv_room(FixedBudget(), drafter, 10, 20) == 10 + 20 + 5 + 2
    assert kv_room(FixedBudget(3), None, 10, 20) == 10 + 20 + 2
    batch = SpecBatch(tiny_target, drafter, FixedBudget(4), max_batch=1, max_len=kv_room(FixedBudget(4), drafter, 3, 8))
    assert batch.room_needed(3, 8) == batch.cache.max_len
    batch.add([[5, 6, 7]], [SamplingParams()], [8], [()])  # exactly fits
    with pytest.raises(ValueError, match="does not fit"):
        SpecBatch(tiny_target, drafter, FixedBudget(4), max_batch=1, max_len=batch.cache.max_len - 1).add(
            [[5, 6, 7]], [SamplingParams()], [8], [()])


def test_stream_holds_back_stop_strings_like_the_server(tiny_target):
    """api.stream and the server share specdec.streaming.TextDeltas: no piece shows the stop string."""
    plain = generate(tiny_target, [5, 6, 7], max_new_tokens=20)
    stop = plain.text[6:8]
    stopped = generate(tiny_target, [5, 6, 7], max_new_tokens=20, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == plain.text[: plain.text.index(stop)]
    pieces = list(stream(tiny_target, [5, 6, 7], make_drafter("oracle", tiny_target, gamma=3), max_new_tokens=20, stop=[stop]))
    assert "".join(pieces) == stopped.text
    assert all(stop not in "".join(pieces[: i + 1]) for i in range(len(pieces)))
