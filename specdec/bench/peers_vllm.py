"""vLLM CPU as bench peers, each method one `LLM(...)` in vLLM's own virtualenv and process
(`specdec peers install vllm`; `peers/vllm_worker.py`), run with vLLM's defaults as a user would:

    vllm-plain          plain decoding
    vllm-ngram          prompt lookup (speculative_config method "ngram")
    vllm-suffix         suffix decoding (method "suffix"; needs arctic-inference in the venv)
    vllm-draft-model    the bench's draft model (the 0.5B for the 1.5B; method "draft_model")
    vllm-eagle3, vllm-dflash, vllm-dspark, vllm-medusa   a drafter exported by `specdec export`
                        (checkpoint=DIR, required)

Options (`vllm-ngram:num_speculative_tokens=5`): num_speculative_tokens, enforce_eager (0/1:
skip inductor compilation), max_model_len, kv_cache_memory_bytes (default 2 GiB here: vLLM CPU's
own advice, VLLM_CPU_KVCACHE_SPACE, instead of sizing the cache from gpu_memory_utilization, the
fraction of the node's memory it reserves for weights and cache: 0.92 by default, which a shared
machine never has free, and any fixed fraction is too small for a target and a draft model together),
gpu_memory_utilization (given, it replaces the explicit cache size), dtype (vLLM's own: auto, bfloat16, float32), plus each method's own (prompt_lookup_min /
_max for ngram). vLLM runs the target's float HF directory (`models/float_dir.py`) in its default dtype
(bf16 on CPU) unless dtype is given. max_model_len defaults to 8192 (or the model's own limit, if lower):
vLLM's default, the model's (32768 for Qwen2.5), needs a KV cache for one whole such request, which 0.25
of a 24 GiB machine does not hold (vLLM's worker raises and dies at start); a Spec-Bench question and its
answer fit 8192. tau = tokens / target forwards, forwards = tokens - accepted draft tokens (vLLM's
spec-decode counters). The outputs are compared with vllm-plain's; a difference is a warning
(vLLM's bf16 arithmetic and batch-dependent kernels are not specdec's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .methods import BenchMethod, MethodOutput, MethodUnavailable, PeerRuntime, PeerSource, register_method_factory
from .peers import parse_options
from .report import BASELINE
from ..models.base import Target

COMMON_OPTIONS = {"num_speculative_tokens": int, "enforce_eager": int, "max_model_len": int, "kv_cache_memory_bytes": int,
                  "gpu_memory_utilization": float, "dtype": str}
ENGINE_OPTIONS = ("enforce_eager", "max_model_len", "kv_cache_memory_bytes", "gpu_memory_utilization", "dtype")  # LLM(...) arguments
DEFAULT_MAX_MODEL_LEN = 8192  # instead of the model's own limit (module doc)
# vLLM CPU sizes its KV cache as gpu_memory_utilization (0.92) of the node's memory minus what the process
# holds after loading and warming up, and refuses to start when that much is not free: on a shared machine it
# never is, and any fraction small enough to be free leaves nothing once a draft model is loaded too (the 1.5B
# and the 0.5B at 0.25 of 24 GiB: -1.38 GiB for the cache). An explicit cache size (vLLM CPU's advice) holds
# max_model_len tokens of both models with room: the 1.5B needs 28 KiB per token, 0.22 GiB at 8192.
DEFAULT_KV_CACHE_BYTES = 2 << 30
# arctic-inference 0.1.1, vLLM's suffix decoding, has no wheel for this Python: its source archive's build
# pins torch==2.7.0, so pip would fetch a second (CUDA) torch and build an extension this venv's torch cannot load
SUFFIX_MISSING = ("arctic-inference==0.1.1 has no wheel here and its source build pins torch==2.7.0 (not this venv's "
                  "2.13.0); `specdec peers install vllm` leaves it out")
DEFAULT_SPECULATIVE_TOKENS = 5  # vLLM's examples use 3-5; our exported drafters draft 5 (export's printed line)


class VllmTarget:
    """What vLLM peers run on: the float HF directory, plus specdec's tokenizer (vLLM gets ids)."""

    encode_prompt = Target.encode_prompt
    decode = Target.decode

    def __init__(self, model_dir: Path, source: PeerSource, version: str):
        self.model_dir, self.name, self.version = model_dir, source.name, version
        self.tokenizer, self.vocab_size = source.tokenizer, source.vocab_size
        self.eos_token_ids = list(source.eos_token_ids)


class VllmRuntime(PeerRuntime):
    name = "vllm"
    methods_at_once = False  # every method is its own engine

    def missing(self) -> str | None:
        from ..peers.envs import VLLM

        if VLLM.marker() is None:
            return (f"vLLM {VLLM.version} is {VLLM.status()}: run `specdec peers install vllm` "
                    f"(its own virtualenv under the cache; network + pip, about 1 GB)")
        return None

    def load(self, source: PeerSource, config) -> VllmTarget:
        from ..models.float_dir import float_model_dir
        from ..peers.envs import VLLM

        model_dir = float_model_dir(source.model_dir or source.name, progress=config.progress)
        return VllmTarget(model_dir, source, VLLM.version)


VLLM_RUNTIME = VllmRuntime()


class VllmMethod(BenchMethod):
    exact = False  # vLLM's arithmetic (bf16): a difference from vllm-plain is a warning

    def __init__(self, target: VllmTarget, speculative_config: dict | None, llm_kwargs: dict, description: str):
        from ..peers.vllm_client import VllmError, VllmWorker

        self.eos_ids, self.description = list(target.eos_token_ids), description
        try:
            self.worker = VllmWorker(target.model_dir, speculative_config, llm_kwargs)
        except VllmError as error:
            raise MethodUnavailable(str(error)) from None

    def generate(self, prompt_ids, max_new_tokens, sampling) -> MethodOutput:
        answer = self.worker.generate(prompt_ids, max_new_tokens, self.eos_ids, sampling.temperature, sampling.top_k,
                                      sampling.top_p, sampling.seed)
        return MethodOutput(answer.tokens, None, answer.target_forwards)

    def close(self) -> None:
        if getattr(self, "worker", None) is not None:
            self.worker.close()
        self.worker = None


def _default_max_model_len(model_dir: Path) -> int:
    """DEFAULT_MAX_MODEL_LEN, or the model's max_position_embeddings when lower (vLLM refuses more)."""
    try:
        limit = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        limit = None
    return min(DEFAULT_MAX_MODEL_LEN, limit) if isinstance(limit, int) and limit > 0 else DEFAULT_MAX_MODEL_LEN


@dataclass(frozen=True)
class VllmMethodKind:
    """One vLLM bench method: its speculative_config method and options."""

    method: str | None  # speculative_config["method"]; None = plain decoding
    help: str
    options: dict = field(default_factory=dict)  # method-specific option name -> type
    drafter_dir: str = ""  # "checkpoint": a specdec export is required; "draft_model": the bench's draft model
    requires: str = ""  # a module this method needs in the vLLM venv, beyond vLLM's own requirements

    def speculative_config(self, parsed: dict, config) -> dict | None:
        if self.method is None:
            return None
        spec = {"method": self.method, "num_speculative_tokens": parsed.pop("num_speculative_tokens", DEFAULT_SPECULATIVE_TOKENS)}
        spec.update({key: parsed.pop(key) for key in self.options if key in parsed})
        if self.drafter_dir == "checkpoint":
            spec["model"] = _export_dir(parsed.pop("checkpoint", None), self.method)
        elif self.drafter_dir == "draft_model":
            spec["model"] = str(_draft_model_dir(config))
        return spec


def _export_dir(checkpoint: str | None, method: str) -> str:
    if not checkpoint:
        raise ValueError(f"method 'vllm-{method.replace('_', '-')}' needs checkpoint=DIR (a `specdec export` directory)")
    directory = Path(checkpoint).expanduser()
    if not (directory / "config.json").is_file():
        raise ValueError(f"checkpoint {directory} has no config.json: pass a directory written by `specdec export`")
    return str(directory.resolve())


def _draft_model_dir(config) -> Path:
    from ..models.float_dir import float_model_dir

    if not getattr(config, "draft_model", None):
        raise MethodUnavailable("no draft model for this target (pass --draft-model NAME)")
    return float_model_dir(config.draft_model, progress=config.progress)


VLLM_METHODS = {
    "vllm-plain": VllmMethodKind(None, "vLLM CPU plain decoding (its own venv and process)"),
    "vllm-ngram": VllmMethodKind("ngram", "vLLM CPU prompt lookup (ngram)", {"prompt_lookup_min": int, "prompt_lookup_max": int}),
    "vllm-suffix": VllmMethodKind("suffix", "vLLM CPU suffix decoding (arctic-inference)", requires="arctic_inference"),
    "vllm-draft-model": VllmMethodKind("draft_model", "vLLM CPU with the bench's draft model", drafter_dir="draft_model"),
    "vllm-eagle3": VllmMethodKind("eagle3", "vLLM CPU with an exported EAGLE-3 drafter", drafter_dir="checkpoint"),
    "vllm-dflash": VllmMethodKind("dflash", "vLLM CPU with an exported DFlash drafter", drafter_dir="checkpoint"),
    "vllm-dspark": VllmMethodKind("dspark", "vLLM CPU with an exported DSpark drafter", drafter_dir="checkpoint"),
    "vllm-medusa": VllmMethodKind("medusa", "vLLM CPU with exported Medusa heads", drafter_dir="checkpoint"),
}


def _describe(name: str, spec: dict | None, llm_kwargs: dict, version: str) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in (spec or {}).items() if k != "model")
    drafter = f", drafter {spec['model']}" if spec and "model" in spec else ""
    mode = "eager (enforce_eager=True)" if llm_kwargs.get("enforce_eager") else "compiled (vLLM's default)"
    memory = (f"kv_cache_memory_bytes={llm_kwargs['kv_cache_memory_bytes']}" if "kv_cache_memory_bytes" in llm_kwargs
              else f"gpu_memory_utilization={llm_kwargs['gpu_memory_utilization']}")
    mode += f", {memory}, max_model_len={llm_kwargs['max_model_len']}, dtype={llm_kwargs.get('dtype', 'default')}"
    return f"vLLM {version} CPU {name.removeprefix('vllm-')}" + (f" ({settings}{drafter})" if spec else "") + f", {mode}"


def _builder(name: str, kind: VllmMethodKind):
    allowed = {**COMMON_OPTIONS, **kind.options, **({"checkpoint": str} if kind.drafter_dir == "checkpoint" else {})}

    def build(target: VllmTarget, options: dict, config) -> BenchMethod:
        from ..peers.envs import VLLM

        parsed = parse_options(name, options, allowed if kind.method else {k: allowed[k] for k in ENGINE_OPTIONS})
        if kind.requires and not VLLM.has_module(kind.requires):
            raise MethodUnavailable(f"{kind.requires} is not in the vLLM venv ({VLLM.directory}): {SUFFIX_MISSING}")
        llm_kwargs = {key: parsed.pop(key) for key in ("max_model_len", "kv_cache_memory_bytes", "gpu_memory_utilization", "dtype")
                      if key in parsed}
        if "gpu_memory_utilization" not in llm_kwargs:
            llm_kwargs.setdefault("kv_cache_memory_bytes", DEFAULT_KV_CACHE_BYTES)
        if parsed.pop("enforce_eager", 0):
            llm_kwargs["enforce_eager"] = True
        spec = kind.speculative_config(parsed, config)  # checks the drafter's options before the target is read
        llm_kwargs.setdefault("max_model_len", _default_max_model_len(target.model_dir))
        return VllmMethod(target, spec, llm_kwargs, _describe(name, spec, llm_kwargs, target.version))

    return build


for _name, _kind in VLLM_METHODS.items():
    register_method_factory(_name, _builder(_name, _kind), VLLM_RUNTIME, help=_kind.help,
                            reference=BASELINE if _kind.method is None else "vllm-plain")
