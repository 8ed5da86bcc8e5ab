"""The public Python API: load a target, pick a drafter, generate (one prompt, a batch, or a stream)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from .drafters.base import Drafter
from .budget import budget_policy_for
from .loop import Generation, run
from .sampling import SamplingParams
from .streaming import TextDeltas


def load_target(name_or_path: str, dtype: str = "float32", progress: bool = True, weights: str | None = None):
    """A registry name (`specdec models list`), a local HF model directory, or a local .gguf file.

    weights: None (as stored: GGUF blocks in the kernel for GGUF-sourced models), "gguf",
    "gguf-a8" (the blocks on int8 activations: lossy, cheaper verify) or "fp32" (the dequantized
    dense weights); see specdec.models.load_target."""
    from .models import load_target as _load

    return _load(name_or_path, dtype=dtype, progress=progress, weights=weights)


def generate_batch(
    target,
    prompts: Sequence[str | list[int]],
    drafter: Drafter | None = None,
    max_new_tokens: int = 128,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    stop: Sequence[str] = (),
    gamma: int | str | None = None,
) -> list[Generation]:
    """Generate for several prompts in one batch (ragged lengths); each result equals the prompt run alone."""
    prompt_ids = [target.encode_prompt(p) for p in prompts]
    generation = run(target, prompt_ids, drafter, max_new_tokens, sampling, stop, budget_policy_for(target, drafter, gamma))
    start = time.perf_counter()
    results = generation.finish()
    elapsed = time.perf_counter() - start
    for result in results:
        result.stats.time_total_s += elapsed
    return results


def generate(
    target,
    prompt: str | list[int],
    drafter: Drafter | None = None,
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    stop: Sequence[str] = (),
    gamma: int | str | None = None,
) -> Generation:
    """Generate one continuation. A list[int] prompt is used verbatim; a str gets the chat template."""
    return generate_batch(target, [prompt], drafter, max_new_tokens, sampling, stop, gamma)[0]


def stream(
    target,
    prompt: str | list[int],
    drafter: Drafter | None = None,
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    stop: Sequence[str] = (),
    gamma: int | str | None = None,
) -> Iterator[str]:
    """Yield the text as it is committed (several tokens per step when drafts are accepted).

    The text of the stream concatenates to `generate(...).text` (specdec.streaming.TextDeltas:
    stop strings are held back until it is clear they do not match)."""
    prompt_ids = [target.encode_prompt(prompt)]
    generation = run(target, prompt_ids, drafter, max_new_tokens, sampling, stop, budget_policy_for(target, drafter, gamma))
    deltas = TextDeltas(target.decode, (stop,) if isinstance(stop, str) else stop)
    for committed in generation:
        piece = deltas.push(committed[0])
        if piece:
            yield piece
    rest = deltas.finish(generation.result[0].text)
    if rest:
        yield rest
