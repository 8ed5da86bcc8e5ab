"""Every model the registry lists generates end to end (a few tokens each, real weights):
plain greedy equals greedy with a drafter (pld), and a batch of two ragged prompts through the
loop equals each prompt alone. One model is loaded at a time and freed before the next.
"""

import gc
import json

import pytest

from specdec import generate, load_target, make_drafter
from specdec.loop import run
from specdec.models.hf import HFTarget
from specdec.models.registry import MODELS

pytestmark = pytest.mark.slow

NEW_TOKENS = 10
# raw text to continue (no chat template): the continuation repeats the prompt's n-grams, so
# prompt lookup has something to draft from
REPEATING = "red, green, blue, red, green, blue, red, green, blue, red, green, blue, red, green,"
SHORT = "The capital of France is"  # a chat message (the chat template applies where there is one)
CLI_MODELS = {"gemma3-270m"}  # the transformers-backed model; a CLI run loads a second copy of the model
# qwen2.5-coder-1.5b: a cold fetch (1.1 GB of packages, 2.5 min conversion) plus ~4 min of test on
# 2 busy cores is half of the default suite's budget, so it runs with `-m heavy`
HEAVY_MODELS = {"qwen2.5-coder-1.5b"}


def prompt_ids(target) -> dict[str, list[int]]:
    return {"repeating": target.tokenizer(REPEATING)["input_ids"], "chat": target.encode_prompt(SHORT)}


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.heavy) if name in HEAVY_MODELS else name for name in sorted(MODELS)
])
def registry_model(request):
    """[target] for one registry model; emptied and collected before the next model loads."""
    loaded = [load_target(request.param, progress=False)]
    yield loaded
    del loaded[0]
    gc.collect()


@pytest.fixture
def target(registry_model):
    return registry_model[0]


@pytest.fixture(scope="module")
def plain(registry_model):
    """Plain greedy generations of both prompts, each alone: the reference."""
    target = registry_model[0]
    return {key: generate(target, ids, max_new_tokens=NEW_TOKENS) for key, ids in prompt_ids(target).items()}


def test_plain_equals_pld(target, plain):
    reference = plain["repeating"]
    assert len(reference.tokens) >= 1 and reference.text.strip(), target.name
    speculative = generate(target, prompt_ids(target)["repeating"], make_drafter("pld", target), max_new_tokens=NEW_TOKENS)
    assert speculative.tokens == reference.tokens, target.name
    assert speculative.text == reference.text
    assert speculative.stats.drafted_tokens > 0  # prompt lookup did propose (the equality is not vacuous)


def test_batch_of_two_ragged_prompts_equals_each_alone(target, plain):
    prompts = list(prompt_ids(target).values())
    assert len(prompts[0]) != len(prompts[1])
    batch = run(target, prompts, make_drafter("pld", target), max_new_tokens=NEW_TOKENS).finish()
    assert [result.tokens for result in batch] == [result.tokens for result in plain.values()], target.name


def test_transformers_backed_models_match_transformers_generate(target, plain):
    """Models on the transformers backend (Gemma 3): specdec's greedy tokens equal model.generate's."""
    if not isinstance(target, HFTarget):
        pytest.skip(f"{target.name} runs on the native runtime (compared with transformers in test_smollm2.py)")
    import torch

    ids = prompt_ids(target)["chat"]
    with torch.no_grad():
        out = target.model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    eos_token_id=target.eos_token_ids)
    assert out[0, len(ids):].tolist() == plain["chat"].tokens


def test_cli_generate_with_pld_equals_api_plain(target, plain, capsys):
    """The issue's command, `specdec generate "..." --model gemma3-270m --drafter pld`, gives the API's plain tokens."""
    if target.name not in CLI_MODELS:
        pytest.skip(f"CLI run only for {sorted(CLI_MODELS)}")
    from specdec.cli import main

    argv = ["generate", SHORT, "--model", target.name, "--max-new-tokens", str(NEW_TOKENS), "--drafter", "pld", "--json"]
    assert main(argv) == 0
    output = json.loads(capsys.readouterr().out)
    assert output["tokens"] == plain["chat"].tokens
    assert output["text"] == plain["chat"].text
