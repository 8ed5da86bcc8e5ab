"""The offline prompt supply: distinct prompts without running out, the requested mix per kind,
determinism (seed, prefix, resume of a data job), well-formed prompts of every kind, and no
Spec-Bench question among them."""

import json
import math
import random
import re
from fractions import Fraction

import pytest

from specdec.bench.questions import default_questions_path, load_questions
from specdec.train.prompt_kinds import KINDS
from specdec.train.prompt_kinds.maths import PROBLEMS, maths_problem
from specdec.train.prompt_kinds.reading import TARGET_LANGUAGES, rag_task, summarization_task
from specdec.train.prompts import (
    DEFAULT_MIX,
    FINITE_POOLS_MIX,
    SOURCES,
    PromptItem,
    PromptSupply,
    describe_mix,
    mixed_prompts,
    parse_mix,
)

MANY = 20_000


@pytest.fixture(scope="module")
def many_prompts():
    return PromptSupply(seed=0).take(MANY)


def share_tolerance(count: int, share: float) -> float:
    """Three binomial standard deviations of a kind's count among `count` prompts, at least 1."""
    return max(1.0, 3 * math.sqrt(count * share * (1 - share)))


def test_twenty_thousand_distinct_prompts_in_the_default_mix(many_prompts):
    assert len(many_prompts) == MANY
    assert len({p.text for p in many_prompts}) == MANY  # no repeat, and the supply did not run out
    assert all(p.text.strip() and p.source in DEFAULT_MIX for p in many_prompts)
    total = sum(DEFAULT_MIX.values())
    for count in (100, 1_000, 7_777, MANY):  # every prefix of the job has the mix, not just the whole
        got = {kind: sum(1 for p in many_prompts[:count] if p.source == kind) for kind in DEFAULT_MIX}
        for kind, weight in DEFAULT_MIX.items():
            share = weight / total
            assert abs(got[kind] - share * count) <= share_tolerance(count, share), (count, kind, got)


def test_every_tenth_prompt_still_has_the_whole_mix(many_prompts):
    # the trainer holds out evenly spaced samples: the kinds must not follow a period of the job
    held_out = many_prompts[5::10]
    total = sum(DEFAULT_MIX.values())
    for kind, weight in DEFAULT_MIX.items():
        share = weight / total
        got = sum(1 for p in held_out if p.source == kind)
        assert abs(got - share * len(held_out)) <= share_tolerance(len(held_out), share), kind


def test_a_requested_mix_is_followed_and_kinds_left_out_never_appear():
    mix = parse_mix("math=3,qa=1,translation=0")
    assert mix == {"math": 3.0, "qa": 1.0, "translation": 0.0}
    prompts = PromptSupply(mix, seed=2).take(1_000)
    counts = {kind: sum(1 for p in prompts if p.source == kind) for kind in ("math", "qa", "translation")}
    assert counts["translation"] == 0 and counts["math"] + counts["qa"] == 1_000
    assert abs(counts["math"] - 750) <= share_tolerance(1_000, 0.75)
    assert describe_mix(mix, prompts) == f"math 75% ({counts['math']}), qa 25% ({counts['qa']})"


@pytest.mark.parametrize("text, message", [
    ("maths=1", "unknown prompt kinds"), ("math=-1", ">= 0"), ("math=0,qa=0", "at least one"),
    ("math", "KIND=WEIGHT"), ("math=lots", "KIND=WEIGHT"), ("math=nan", ">= 0"),
])
def test_bad_mixes_get_clear_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_mix(text)


def test_same_seed_same_prompts_and_a_prefix_does_not_depend_on_the_count(many_prompts):
    again = PromptSupply(seed=0).take(3_000)
    assert again == many_prompts[:3_000]  # a longer job starts with a shorter job's prompts
    other = PromptSupply(seed=1).take(3_000)
    assert sum(a.text == b.text for a, b in zip(again, other)) < 30  # another seed: other prompts
    assert mixed_prompts(50, seed=0) == many_prompts[:50]


def test_the_finite_pools_still_mix_and_leave_the_mix_when_used_up():
    pools = {"self-instruct": 1.0, "math": 1.0}  # self-instruct holds 480 prompts
    prompts = PromptSupply(pools, seed=0).take(1_500)
    assert sum(p.source == "self-instruct" for p in prompts) == 480  # all of it, then math fills its share
    assert len({p.text for p in prompts}) == 1_500
    with pytest.raises(ValueError, match="holds only 480 distinct"):
        PromptSupply({"self-instruct": 1.0}, seed=0).take(481)


# ---------------------------------------------------------------------------- each kind is well formed
def _numbers(text: str) -> list[Fraction]:
    return [Fraction(n) for n in re.findall(r"-?\d+(?:\.\d+)?", text)]


def test_maths_problems_state_their_numbers_and_have_clean_answers():
    for make in PROBLEMS:  # every template, many draws
        rng = random.Random(make.__name__)
        for _ in range(300):
            problem = make(rng)
            assert _numbers(problem.text) == list(problem.numbers), problem.text  # every number parses, in order
            assert problem.answer >= 0 and (problem.answer * 100).denominator == 1, problem  # whole or cents
    rng = random.Random(1)
    assert len({maths_problem(rng).text for _ in range(200)}) == 200  # the kind's own draws do not repeat


def test_summarization_prompts_contain_their_whole_passage():
    rng = random.Random(0)
    news = 0
    for _ in range(500):
        passage, prompt = summarization_task(rng)
        assert passage.text in prompt and len(passage.text) >= 300
        if passage.questions:  # a news article
            news += 1
        else:
            assert len(passage.text) >= 1200, passage  # a reference window is at least min_chars long
    assert 150 <= news <= 350  # about half are news


def test_rag_prompts_hold_two_to_four_passages_and_a_question_one_answers():
    rng = random.Random(0)
    for _ in range(500):
        passages, gold, question, prompt = rag_task(rng)
        assert 2 <= len(passages) <= 4 and gold in passages
        assert all(p.text in prompt for p in passages)
        assert question in gold.questions or gold.title in question
        assert question[1:] in prompt and prompt.index(question[1:]) > prompt.index(passages[-1].text)


def test_kinds_in_the_mix_are_the_tested_ones(many_prompts):
    summaries = [p.text for p in many_prompts if p.source == "summarization"]
    assert summaries[:20] == [summarization_task(random.Random(f"0:summarization:{j}"))[1] for j in range(20)]


def test_translation_prompts_name_a_language_and_carry_text(many_prompts):
    translations = [p.text for p in many_prompts if p.source == "translation"]
    languages = set()
    for text in translations:
        named = [language for language in TARGET_LANGUAGES if language in text.split(":")[0] or f"in {language}?" in text]
        assert named, text
        languages.update(named)
        assert len(text) > 40
    assert languages == set(TARGET_LANGUAGES)


def test_every_kind_has_a_source_record_with_a_licence():
    for name in KINDS:
        assert SOURCES[name].description and SOURCES[name].licence
    assert "PSF" in SOURCES["summarization"].licence and "PSF" in SOURCES["python-docs"].licence


# ---------------------------------------------------------------------------- never Spec-Bench
def spec_bench_overlap(prompts: list[PromptItem], turns: list[str]) -> list[str]:
    """The question turns that equal or sit inside a prompt (one search per turn over all prompts)."""
    joined = "\0".join(p.text for p in prompts)
    exact = {p.text for p in prompts}
    return [turn for turn in turns if turn in exact or turn.strip() in joined]


QUESTIONS = default_questions_path()


@pytest.mark.skipif(not QUESTIONS.is_file(), reason=f"no Spec-Bench questions at {QUESTIONS}")
def test_no_prompt_is_or_contains_a_spec_bench_question(many_prompts):
    turns = [turn for question in load_questions(QUESTIONS) for turn in question.turns]
    assert len(turns) >= 200
    assert spec_bench_overlap(many_prompts, turns) == []
    planted = many_prompts[:10] + [PromptItem(f"Summarise this:\n\n{turns[7]}", "summarization")]
    assert spec_bench_overlap(planted, turns) == [turns[7]]  # the check does find one


# ---------------------------------------------------------------------------- data jobs resume with their prompts
def test_data_job_resumes_with_its_own_prompts_and_mix(tmp_path):
    from train_support import make_counter_target

    from specdec.train.data import DataSettings, build_dataset

    counter = make_counter_target(tmp_path / "counter", seed=0)
    quiet = lambda _: None  # noqa: E731
    settings = lambda **mix: DataSettings(num_prompts=6, max_new_tokens=4, shard_size=2, sampled_fraction=0.0, **mix)  # noqa: E731
    mix = {"math": 1.0, "qa": 1.0}
    partial = build_dataset(counter, tmp_path / "new", settings(prompt_weights=mix), progress=False, log=quiet,
                            stop_after_shards=1)
    assert len(partial["shards"]) == 1 and not partial["complete"]
    stored = (tmp_path / "new" / "prompts.jsonl").read_text()  # the prompts of the shards begun, made as they were needed
    assert [PromptItem(**json.loads(line)) for line in stored.splitlines()] == PromptSupply(mix, 0).take(2)
    logged = []
    done = build_dataset(counter, tmp_path / "new", settings(), progress=False, log=logged.append)  # no mix: the stored one
    assert done["complete"] and done["settings"]["prompt_weights"] == mix
    whole = (tmp_path / "new" / "prompts.jsonl").read_text()
    assert whole.startswith(stored)
    assert [PromptItem(**json.loads(line)) for line in whole.splitlines()] == PromptSupply(mix, 0).take(6)
    math_count = whole.count('"source": "math"')
    assert {name: info["prompts"] for name, info in done["sources"].items()} == {"math": math_count, "qa": 6 - math_count}
    assert "prompt mix, kind share: math 50%, qa 50%" in logged
    with pytest.raises(ValueError, match="other settings"):
        build_dataset(counter, tmp_path / "new", settings(prompt_weights=DEFAULT_MIX), progress=False, log=quiet)

    # a directory made before the prompt kinds (the three finite pools' mix in its manifest) resumes unchanged
    old = [PromptItem(f"{'!#$%'[i % 4]}{i}", "self-instruct") for i in range(6)]
    build_dataset(counter, tmp_path / "old", settings(prompt_weights=dict(FINITE_POOLS_MIX)), prompts=old,
                  progress=False, log=quiet, stop_after_shards=1)
    resumed = build_dataset(counter, tmp_path / "old", settings(), progress=False, log=quiet)
    assert resumed["complete"] and resumed["settings"]["prompt_weights"] == FINITE_POOLS_MIX
    lines = (tmp_path / "old" / "prompts.jsonl").read_text().splitlines()
    assert [PromptItem(**json.loads(line)) for line in lines] == old


def test_a_bad_mix_writes_nothing(tmp_path):
    from train_support import make_counter_target

    from specdec.train.data import DataSettings, build_dataset

    counter = make_counter_target(tmp_path / "counter", seed=0)
    with pytest.raises(ValueError, match="unknown prompt kinds"):
        build_dataset(counter, tmp_path / "data", DataSettings(num_prompts=2, prompt_weights={"news": 1.0}),
                      progress=False, log=lambda _: None)
    assert not (tmp_path / "data").exists()
