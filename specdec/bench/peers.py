"""Peers: other libraries' decoding methods on the same model, the same prompt ids and token budget.

    hf-plain      model.generate (greedy / sampling), the transformers baseline
    hf-assisted   assisted generation with a draft model (`assistant_model=`), same draft as small-model
    hf-pld        prompt lookup decoding (`prompt_lookup_num_tokens=`)
    llama-plain   llama.cpp (llama-cpp-python) decoding the target's GGUF file as it is (quantized)
    llama-lookup  llama-cpp-python's prompt lookup (`draft_model=LlamaPromptLookupDecoding(...)`)

Each peer is registered with the `PeerRuntime` that loads its library's copy of the target:
`TRANSFORMERS` (an `HFTarget`, AutoModelForCausalLM from `target.model_dir`, float32) or
`LLAMA_CPP` (the registry's GGUF file, `fetch_gguf`). The runner loads a runtime after every
specdec method is done and freed, so two copies of a large target are never in memory together.
Prompts are encoded by specdec's tokenizer and chat template and handed to every peer as token
ids. Peers count target forwards (a forward hook; llama.cpp eval calls), so their tau is "tokens
per target forward", the first forward, which also reads the prompt, included. Their greedy output
is compared with their reference (specdec's plain decoding; for llama-lookup llama-plain), but a
mismatch is only a warning: another library runs another float path (transformers: sdpa, fused
ops; llama.cpp: quantized weights with int8-quantized activations, batch-size-dependent kernels).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from .methods import BenchMethod, MethodOutput, MethodUnavailable, PeerRuntime, PeerSource, register_method_factory
from ..models.base import Target

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


class TransformersRuntime(PeerRuntime):
    """transformers' AutoModelForCausalLM on the target's HF-format directory (float32 unless --dtype)."""

    name = "transformers"

    def reuses(self, target) -> bool:
        from ..models.hf import HFTarget

        return isinstance(target, HFTarget)

    def load(self, source: PeerSource, config):
        from ..models.hf import HFTarget

        if source.model_dir is None:
            raise MethodUnavailable("the target has no HF model directory to load with transformers")
        return HFTarget.from_dir(source.model_dir, dtype=config.dtype, name=source.name)


TRANSFORMERS = TransformersRuntime()


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


register_method_factory("hf-plain", _build_hf_plain, TRANSFORMERS, help="transformers generate()")
register_method_factory("hf-assisted", _build_hf_assisted, TRANSFORMERS, help="transformers assisted generation (draft model)")
register_method_factory("hf-pld", _build_hf_pld, TRANSFORMERS, help="transformers prompt lookup decoding")


# ============================================================================ llama.cpp

LLAMA_CPP_VERSION = "0.3.36"  # = pyproject's `peers` extra
# llama.cpp's AMX matmul segfaults on this project's Sapphire Rapids CPU (llama.cpp issue 20824); a
# native build enables it wherever the CPU has AMX, so the build leaves it out (the AVX-512 kernels stay)
LLAMA_CPP_CMAKE_ARGS = "CMAKE_ARGS='-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8'"
LLAMA_CPP_INSTALL = (f"llama-cpp-python is not installed: get it with {LLAMA_CPP_CMAKE_ARGS} pip install 'specdec[peers]' "
                     f"(llama-cpp-python=={LLAMA_CPP_VERSION}; compiles llama.cpp from source, several minutes)")
LLAMA_CPP_WITH_AMX = (f"this llama-cpp-python build runs llama.cpp's AMX kernel, which crashes on AMX CPUs: rebuild it "
                      f"with {LLAMA_CPP_CMAKE_ARGS} pip install --force-reinstall --no-deps --no-cache-dir "
                      f"llama-cpp-python=={LLAMA_CPP_VERSION}")
LLAMA_OPTIONS = {"n_ctx": int, "threads": int}
LLAMA_LOOKUP_OPTIONS = {**LLAMA_OPTIONS, "num_pred_tokens": int, "max_ngram_size": int}
DEFAULT_LLAMA_CTX = 4096  # KV positions for prompt + new tokens (longest Spec-Bench first turn: 1473 Qwen tokens)
DEFAULT_LOOKUP_NGRAM = 2  # LlamaPromptLookupDecoding's own default


def machine_cores() -> int:
    """The cores this process may run on: llama.cpp's thread count, for decoding and for the prompt."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def gguf_file_of(source: PeerSource, progress: bool = True) -> Path:
    """The GGUF file the benchmark target was converted from: a registry model's verified file
    (`fetch_gguf`, assembled in the cache for multi-part models) or the .gguf path it was loaded from."""
    from ..models.registry import MODELS, fetch_gguf

    if source.name in MODELS:
        try:
            return fetch_gguf(source.name, progress=progress)
        except (FileNotFoundError, ValueError, RuntimeError) as error:
            raise MethodUnavailable(f"no GGUF file for {source.name!r}: {error}") from None
    path = Path(source.name).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    raise MethodUnavailable(f"target {source.name!r} is not a GGUF model (a registry name or a .gguf file): "
                            "llama.cpp peers run the GGUF file itself")


class LlamaCppTarget:
    """What llama.cpp peers run on: the GGUF file, plus specdec's own tokenizer so that the runner
    encodes prompts (chat template included) exactly as for specdec's methods; llama.cpp gets ids."""

    encode_prompt = Target.encode_prompt  # the same prompt code as every specdec target
    decode = Target.decode

    def __init__(self, gguf_path: Path, source: PeerSource):
        self.gguf_path, self.name = gguf_path, source.name
        self.tokenizer, self.vocab_size = source.tokenizer, source.vocab_size
        self.eos_token_ids = list(source.eos_token_ids)

    def new_llama(self, n_ctx: int, threads: int, draft_model=None):
        """A llama_cpp.Llama on the file (weights are mmapped: two instances share one copy in memory)."""
        from llama_cpp import Llama

        # with a draft model every position's logits are kept: the buffer must then hold n_ctx rows
        # (llama-cpp-python sizes it from the logits_all argument, not from draft_model)
        return Llama(model_path=str(self.gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                     draft_model=draft_model, logits_all=draft_model is not None, verbose=False)


class LlamaCppRuntime(PeerRuntime):
    """llama.cpp through llama-cpp-python, on the GGUF file the target was converted from."""

    name = "llama.cpp"
    beside_target = True  # llama.cpp maps the GGUF file: no second float copy of the target

    def missing(self) -> str | None:
        try:
            import llama_cpp
        except ImportError:
            return LLAMA_CPP_INSTALL
        except OSError as error:  # installed, but its shared library does not load
            return f"llama-cpp-python is installed but does not load ({error}); reinstall it: pip install 'specdec[peers]'"
        if "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace"):
            return LLAMA_CPP_WITH_AMX  # it would kill the whole bench process (and its results) mid-run
        return None

    def load(self, source: PeerSource, config) -> LlamaCppTarget:
        return LlamaCppTarget(gguf_file_of(source, progress=config.progress), source)


LLAMA_CPP = LlamaCppRuntime()


class LlamaCppMethod(BenchMethod):
    """`Llama.generate` on specdec's prompt ids, stopped at specdec's EOS ids or the token budget."""

    exact = False  # another library's arithmetic: a mismatch with the reference is a warning

    def __init__(self, llama, eos_ids: list[int], description: str):
        self.llama, self.eos_ids, self.description = llama, set(eos_ids), description
        self.forwards = 0
        generate_eval = llama.eval

        def counted_eval(tokens):  # one call = one forward over the new (prompt or drafted) tokens
            self.forwards += 1
            return generate_eval(tokens)

        llama.eval = counted_eval  # Llama.generate calls self.eval: count target forwards like the hf hook

    def generate(self, prompt_ids, max_new_tokens, sampling) -> MethodOutput:
        prompt_ids = [int(t) for t in prompt_ids]
        n_ctx, n_vocab = self.llama.n_ctx(), self.llama.n_vocab()
        if len(prompt_ids) + max_new_tokens > n_ctx:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed llama.cpp's "
                             f"context of {n_ctx}: pass a larger n_ctx (e.g. llama-plain:n_ctx=8192)")
        if max(prompt_ids) >= n_vocab:
            raise ValueError(f"prompt id {max(prompt_ids)} is outside llama.cpp's vocabulary of {n_vocab}")
        if sampling.greedy:
            sampler = dict(temp=0.0)
        else:  # llama.cpp's order: top-k, top-p, then temperature (peers are not compared when sampling)
            sampler = dict(temp=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, min_p=0.0)
            if sampling.seed is not None:
                self.llama.set_seed(sampling.seed)
        # forget the previous prompt: no KV prefix reuse, every call reads its whole prompt (as specdec's methods do)
        self.llama.reset()
        self.forwards = 0
        tokens: list[int] = []
        for token in self.llama.generate(prompt_ids, reset=True, **sampler):
            tokens.append(int(token))
            if token in self.eos_ids or len(tokens) >= max_new_tokens:
                break
        return MethodOutput(tokens, None, self.forwards)

    def close(self) -> None:
        if self.llama is not None:
            self.llama.close()
        self.llama = None


def _llama_settings(method: str, options: dict, allowed: dict) -> dict:
    parsed = {"n_ctx": DEFAULT_LLAMA_CTX, "threads": machine_cores(), **parse_options(method, options, allowed)}
    for key, value in parsed.items():
        if value < 1:
            raise ValueError(f"method {method!r}: option {key}={value} must be >= 1")
    return parsed


def _build_llama_plain(target: LlamaCppTarget, options: dict, config) -> BenchMethod:
    settings = _llama_settings("llama-plain", options, LLAMA_OPTIONS)
    llama = target.new_llama(settings["n_ctx"], settings["threads"])
    return LlamaCppMethod(llama, target.eos_token_ids, f"llama.cpp plain decoding of {target.gguf_path.name} "
                                                       f"({settings['threads']} threads)")


def _build_llama_lookup(target: LlamaCppTarget, options: dict, config) -> BenchMethod:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    settings = {"num_pred_tokens": DEFAULT_PROMPT_LOOKUP_TOKENS, "max_ngram_size": DEFAULT_LOOKUP_NGRAM,
                **_llama_settings("llama-lookup", options, LLAMA_LOOKUP_OPTIONS)}
    draft = LlamaPromptLookupDecoding(max_ngram_size=settings["max_ngram_size"], num_pred_tokens=settings["num_pred_tokens"])
    llama = target.new_llama(settings["n_ctx"], settings["threads"], draft_model=draft)
    return LlamaCppMethod(llama, target.eos_token_ids, f"llama.cpp prompt lookup (num_pred_tokens="
                                                       f"{settings['num_pred_tokens']}, max_ngram_size="
                                                       f"{settings['max_ngram_size']}, {settings['threads']} threads)")


register_method_factory("llama-plain", _build_llama_plain, LLAMA_CPP,
                        help="llama.cpp (llama-cpp-python) plain decoding of the target's GGUF file")
register_method_factory("llama-lookup", _build_llama_lookup, LLAMA_CPP, reference="llama-plain",
                        help="llama.cpp prompt lookup (LlamaPromptLookupDecoding), compared with llama-plain")
