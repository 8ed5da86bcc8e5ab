"""Peers: transformers' own decoding methods on the same converted model and the same prompts.

    hf-plain     model.generate (greedy / sampling), the transformers baseline
    hf-assisted  assisted generation with a draft model (`assistant_model=`), same draft as small-model
    hf-pld       prompt lookup decoding (`prompt_lookup_num_tokens=`)

They run on an `HFTarget` (AutoModelForCausalLM from `target.model_dir`, float32) that the runner
loads after every specdec method is done and freed, so the native and transformers copies of a
large target are never in memory together. Peers count target forward calls with a forward hook,
so their tau is "tokens per target forward" (the first forward, which also reads the prompt,
included). Their greedy output is compared with specdec's plain decoding too, but a mismatch is
only a warning: transformers runs a different float path (sdpa, fused ops) than the native runtime.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import BenchMethod, MethodOutput, MethodUnavailable, register_method_factory

# option name -> type, per peer (parsed from `hf-pld:prompt_lookup_num_tokens=5`)
ASSISTED_OPTIONS = {
    "draft_model": str,
    "num_assistant_tokens": int,
    "num_assistant_tokens_schedule": str,
    "assistant_confidence_threshold": float,
}
PROMPT_LOOKUP_OPTIONS = {"prompt_lookup_num_tokens": int, "max_matching_ngram_size": int}
DEFAULT_PROMPT_LOOKUP_TOKENS = 10


def parse_options(method: str, options: dict[str, str], allowed: dict[str, type]) -> dict:
    """Raw `key=value` strings -> typed values; unknown keys are an error naming the allowed ones."""
    parsed = {}
    for key, raw in options.items():
        if key not in allowed:
            raise ValueError(f"method {method!r} has no option {key!r}; allowed: {', '.join(allowed) or 'none'}")
        try:
            parsed[key] = allowed[key](raw)
        except ValueError:
            raise ValueError(f"method {method!r}: option {key}={raw!r} is not a valid {allowed[key].__name__}") from None
    return parsed


def clean_generation_config(model):
    """A GenerationConfig with only the model's special token ids: no sampling defaults from the
    model's generation_config.json (Qwen ships do_sample / repetition_penalty there)."""
    from transformers import GenerationConfig

    original = getattr(model, "generation_config", None)
    ids = {key: getattr(original, key, None) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return GenerationConfig(**{key: value for key, value in ids.items() if value is not None})


@contextlib.contextmanager
def _clean_defaults(model) -> Iterator[None]:
    """generate() fills every unset field from model.generation_config: swap in a clean one meanwhile."""
    original = model.generation_config
    model.generation_config = clean_generation_config(model)
    try:
        yield
    finally:
        model.generation_config = original


class _ForwardCounter:
    def __init__(self):
        self.calls = 0

    def __call__(self, module, inputs, output) -> None:
        self.calls += 1


class HFGenerateMethod(BenchMethod):
    """`model.generate` on an HFTarget's transformers model, with extra generate kwargs."""

    exact = False  # a different float path than the native runtime: mismatches are warnings

    def __init__(self, target, eos_ids: list[int], extra_kwargs: dict, description: str, assistant=None):
        model = getattr(target, "model", None)
        if model is None or not callable(getattr(model, "generate", None)):
            raise MethodUnavailable(f"target {getattr(target, 'name', target)!r} is not a transformers model")
        self.target, self.model, self.assistant = target, model, assistant
        self.eos_ids = list(eos_ids)
        self.extra_kwargs = dict(extra_kwargs)
        self.description = description

    def generate(self, prompt_ids, max_new_tokens, sampling) -> MethodOutput:
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.target.device)  # [1, T]
        kwargs = dict(
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.eos_ids[0] if self.eos_ids else None,
            do_sample=not sampling.greedy,
            **self.extra_kwargs,
        )
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        counter = _ForwardCounter()
        hook = self.model.register_forward_hook(counter)
        try:
            with _clean_defaults(self.model), torch.no_grad():
                output = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        finally:
            hook.remove()
        tokens = output[0, input_ids.shape[1] :].tolist()
        return MethodOutput(tokens, None, counter.calls)

    def close(self) -> None:
        self.target = self.model = self.assistant = None


def _build_hf_plain(target, options: dict, config) -> BenchMethod:
    parse_options("hf-plain", options, {})
    return HFGenerateMethod(target, target.eos_token_ids, {}, "transformers generate()")


def _build_hf_pld(target, options: dict, config) -> BenchMethod:
    parsed = {"prompt_lookup_num_tokens": DEFAULT_PROMPT_LOOKUP_TOKENS, **parse_options("hf-pld", options, PROMPT_LOOKUP_OPTIONS)}
    settings = ", ".join(f"{k}={v}" for k, v in parsed.items())
    return HFGenerateMethod(target, target.eos_token_ids, parsed, f"transformers prompt lookup ({settings})")


def _build_hf_assisted(target, options: dict, config) -> BenchMethod:
    from transformers import AutoModelForCausalLM

    from ..models.registry import resolve_model_dir

    parsed = parse_options("hf-assisted", options, ASSISTED_OPTIONS)
    draft_name = parsed.pop("draft_model", None) or getattr(config, "draft_model", None)
    if not draft_name:
        raise MethodUnavailable("no draft model for this target (pass --draft-model NAME)")
    draft_dir = resolve_model_dir(draft_name, progress=False)
    assistant = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    assistant_vocab = assistant.config.get_text_config().vocab_size
    if target.tokenizer is not None and len(target.tokenizer) > assistant_vocab:
        raise MethodUnavailable(f"draft {draft_name!r} has a smaller vocabulary ({assistant_vocab}) than the target")
    # assisted generation reads num_assistant_tokens etc. from the ASSISTANT's generation config
    assistant.generation_config = clean_generation_config(assistant)
    for key, value in parsed.items():
        setattr(assistant.generation_config, key, value)
    settings = ", ".join(f"{k}={v}" for k, v in parsed.items()) or "transformers defaults"
    return HFGenerateMethod(
        target, target.eos_token_ids, {}, f"transformers assisted generation, draft {draft_name} ({settings})", assistant
    )


register_method_factory("hf-plain", _build_hf_plain, peer=True, help="transformers generate()")
register_method_factory("hf-assisted", _build_hf_assisted, peer=True, help="transformers assisted generation (draft model)")
register_method_factory("hf-pld", _build_hf_pld, peer=True, help="transformers prompt lookup decoding")
