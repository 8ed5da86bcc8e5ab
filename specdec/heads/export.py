"""Checkpoints in the layouts serving engines load unchanged: EAGLE-3 (SGLang, vLLM) and Medusa (vLLM).

EAGLE-3 directory (`export_eagle3`, read back by `load_eagle3_export`):
    config.json        LlamaForCausalLMEagle3, model_type llama (for every target family), one layer,
                       vocab_size / draft_vocab_size, the target's heads / kv heads / head_dim / rope /
                       rms_norm_eps; no aux-layer ids (the engines' default fused layers are ours)
    model.safetensors  the module's state dict as is: fc, midlayer.*, norm, lm_head [V', H],
                       d2t int64 (target id = i + d2t[i]), t2d bool [V]; no embed_tokens
DFlash directory (`export_dflash`, read back by `load_dflash_export`):
    config.json        DFlashDraftModel, model_type qwen3 (for every target family), the draft's own
                       layers / heads / kv heads / head_dim / intermediate size / rope / eps, block_size,
                       dflash_config {mask_token_id, target_layer_ids (0-based target blocks)},
                       num_target_layers, vocab_size (the target's: the engines share its embeddings)
    model.safetensors  fc [H, F*H], hidden_norm, layers.{i}.*, norm; no embed_tokens, no lm_head
DSpark directory (`export_dspark`, read back by `load_dspark_export`), DeepSpec's public layout:
    config.json        Qwen3DSparkModel: the DFlash fields above plus, at the top level,
                       block_size, mask_token_id, target_layer_ids (0-based target blocks),
                       num_target_layers, markov_rank, markov_head_type (vanilla | rnn),
                       enable_confidence_head, confidence_head_with_markov, and specdec's fitted
                       confidence_temperatures [K] (no tensor in DeepSpec's layout holds them)
    model.safetensors  the DFlash backbone tensors, markov_head.{markov_w1,markov_w2}.weight
                       (+ joint_proj.{weight,bias} for rnn), confidence_head.proj.{weight,bias}, and
                       embed_tokens / lm_head (copies of the target's, which DeepSpec's class holds)
Medusa directory (`export_medusa`): vLLM's MedusaModel — blocks.{k}.layers.{j}.{weight,bias} and
lm_heads.{k}.weight (a copy of the target's LM head: our heads read it frozen).
Speculators format (`--format speculators`, `speculators_export_config`), what vLLM reads for
`speculators_model_type` eagle3 / dflash / dspark (not Medusa): the same model.safetensors as the
layout above, and a config.json whose `transformer_layer_config` is that layout's config, with
    speculators_model_type  eagle3 | dflash | dspark
    speculators_config      {algorithm, proposal_methods [{proposal_type greedy, speculative_tokens}],
                             default_proposal_method greedy, verifier {name_or_path, architectures}}
    eagle3                  draft_vocab_size, norm_before_residual false (ours adds the residual to the
                            un-normed input; the format's default is true), norm_before_fc false
    dflash / dspark         aux_hidden_state_layer_ids (= target_layer_ids + 1: the format counts the
                            embeddings as layer 0), mask_token_id, block_size, sample_from_anchor (DFlash: false,
                            the anchor is the bonus token; DSpark: true, its anchor row predicts); dspark: markov_rank, markov_head_type,
                            enable_confidence_head, confidence_head_with_markov
A speculators directory alone is a whole model for vLLM: `vllm serve DIR` / `LLM(model=DIR)` runs
the verifier it names with the drafter; `name_or_path` must then be a float HF directory vLLM loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..files import open_output_dir, save_safetensors, write_text_atomic
from .checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_weights
from .dflash import DFlashModule
from .dspark_module import SEQUENTIAL_HEADS, DSparkModule
from .eagle import Eagle3Module
from .modules import FrozenTargetParts, MedusaHeads

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
DFLASH_ARCHITECTURE = "DFlashDraftModel"
DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
_SEQUENTIAL_PREFIX = "sequential."  # DSparkModule.sequential: DeepSpec keeps markov_head / confidence_head at the top
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def eagle3_export_config(module: Eagle3Module, dtype: str) -> dict:
    cfg = module.config
    rope = dict(cfg.rope_parameters or {})
    rope_theta = rope.pop("rope_theta", 10000.0)
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }


def _write_directory(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """config.json + model.safetensors, each written to a temp file and renamed (nothing half-written),
    into a directory that is new, empty or an earlier export (specdec.files)."""
    out_dir = open_output_dir(out_dir, "export", flag="OUT_DIR")
    save_safetensors(out_dir / WEIGHTS_FILE, {name: tensor.contiguous() for name, tensor in tensors.items()},
                     metadata={"format": "pt"})
    write_text_atomic(out_dir / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return out_dir


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype)


def export_eagle3(module: Eagle3Module, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write `module` as an EAGLE-3 directory SGLang and vLLM load unchanged."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    tensors = {name: _cast(tensor, EXPORT_DTYPES[dtype]) for name, tensor in module.state_dict().items()}
    return _write_directory(Path(out_dir), eagle3_export_config(module, dtype), tensors)


def dflash_export_config(module: DFlashModule, dtype: str) -> dict:
    cfg = module.config
    rope = dict(cfg.rope_parameters or {"rope_type": "default"})
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "num_hidden_layers": len(module.layers),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * len(module.layers),
        "block_size": module.block_size,
        "num_target_layers": module.target_num_layers,
        "dflash_config": {"mask_token_id": module.mask_token_id, "target_layer_ids": module.target_layer_ids},
        "torch_dtype": dtype,
    }


def _check_published_layout(module: DFlashModule) -> None:
    if module.anchor_feature:
        raise ValueError(f"this {module.kind} checkpoint was trained with --anchor-feature, which no engine's layout has: "
                         "it runs in specdec only")


def export_dflash(module: DFlashModule, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write `module` as a DFlashDraftModel directory SGLang and vLLM load (no embeddings, no LM head)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    if module.mask_token_id is None:
        raise ValueError("the DFlash module has no mask_token_id (build it with build_heads, which chooses one)")
    _check_published_layout(module)
    tensors = {name: _cast(tensor, EXPORT_DTYPES[dtype]) for name, tensor in module.state_dict().items()}
    return _write_directory(Path(out_dir), dflash_export_config(module, dtype), tensors)


def export_dspark(module: DSparkModule, target, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write `module` in the layout of DeepSpec's public DSpark checkpoints (with copies of the
    target's embeddings and LM head, which that layout carries)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    if module.mask_token_id is None:
        raise ValueError("the DSpark module has no mask_token_id (build it with build_heads, which chooses one)")
    _check_published_layout(module)
    torch_dtype = EXPORT_DTYPES[dtype]
    sequential = module.sequential
    tensors = {name.removeprefix(_SEQUENTIAL_PREFIX): _cast(tensor, torch_dtype) for name, tensor in module.state_dict().items()
               if name != _SEQUENTIAL_PREFIX + "confidence_temperatures"}
    parts = FrozenTargetParts.from_target(target)
    tensors["embed_tokens.weight"] = _cast(parts.embed_weight, torch_dtype).clone()
    tensors["lm_head.weight"] = _cast(parts.lm_head_weight, torch_dtype).clone()
    config = dflash_export_config(module, dtype)
    for engine_only in ("auto_map", "dflash_config"):
        config.pop(engine_only)
    config.update({
        "architectures": [DSPARK_ARCHITECTURE], "mask_token_id": module.mask_token_id,
        "target_layer_ids": module.target_layer_ids, "num_anchors": 512, "markov_rank": sequential.markov_head.rank,
        "markov_head_type": sequential.markov_head.deepspec_type, "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "confidence_temperatures": [float(t) for t in sequential.confidence_temperatures],
    })
    return _write_directory(Path(out_dir), config, tensors)


def export_medusa(heads: MedusaHeads, target, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write Medusa heads in vLLM's MedusaModel layout (each head gets a copy of the target's LM head)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    torch_dtype = EXPORT_DTYPES[dtype]
    lm_head = FrozenTargetParts.from_target(target).lm_head_weight
    tensors = {}
    for head, blocks in enumerate(heads.heads):
        for index, linear in enumerate(blocks):
            tensors[f"blocks.{head}.layers.{index}.weight"] = _cast(linear.weight, torch_dtype)
            tensors[f"blocks.{head}.layers.{index}.bias"] = _cast(linear.bias, torch_dtype)
        tensors[f"lm_heads.{head}.weight"] = _cast(lm_head, torch_dtype).clone()  # one tensor per key (safetensors)
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": heads.hidden_size,
        "vocab_size": int(lm_head.shape[0]),
        "truncated_vocab_size": int(lm_head.shape[0]),
        "num_heads": heads.num_positions,
        "num_hidden_layers": heads.num_blocks,
        "medusa_fc_bias": True,
        "torch_dtype": dtype,
    }
    return _write_directory(Path(out_dir), config, tensors)


SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config format this writes
SPECULATORS_TYPES = {EAGLE3_ARCHITECTURE: "eagle3", DFLASH_ARCHITECTURE: "dflash", DSPARK_ARCHITECTURE: "dspark"}


def speculators_export_config(layer_config: dict, speculative_tokens: int, verifier: str,
                              verifier_architectures: list[str]) -> dict:
    """The speculators-format config.json around one of our layouts' configs (`layer_config`)."""
    architecture = layer_config["architectures"][0]
    kind = SPECULATORS_TYPES.get(architecture)
    if kind is None:
        raise ValueError(f"vLLM reads no speculators format for {architecture}; kinds: {', '.join(SPECULATORS_TYPES.values())}")
    config = {
        "architectures": [architecture],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer_config,
        "torch_dtype": layer_config.get("torch_dtype"),
    }
    if kind == "eagle3":
        config.update(draft_vocab_size=layer_config["draft_vocab_size"], norm_before_residual=False, norm_before_fc=False)
        return config
    target_layer_ids = (layer_config.get("dflash_config") or layer_config)["target_layer_ids"]
    mask_token_id = (layer_config.get("dflash_config") or layer_config)["mask_token_id"]
    config.update(aux_hidden_state_layer_ids=[int(i) + 1 for i in target_layer_ids], mask_token_id=mask_token_id,
                  block_size=layer_config["block_size"], draft_vocab_size=layer_config["vocab_size"],
                  sample_from_anchor=kind == "dspark")
    if kind == "dspark":
        config.update({key: layer_config[key] for key in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                                           "confidence_head_with_markov", "confidence_temperatures")})
    return config


def rewrite_as_speculators(out_dir: Path, speculative_tokens: int, verifier: str, verifier_architectures: list[str]) -> Path:
    """Turn an export of ours in `out_dir` into the speculators format (its config.json wrapped, weights as they are)."""
    layer_config = json.loads((Path(out_dir) / CONFIG_FILE).read_text())
    config = speculators_export_config(layer_config, speculative_tokens, verifier, verifier_architectures)
    write_text_atomic(Path(out_dir) / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return Path(out_dir)


def export_config(directory: Path) -> dict:
    """An export's own config: a speculators-format directory's `transformer_layer_config`, else config.json."""
    config = json.loads((Path(directory) / CONFIG_FILE).read_text())
    return config["transformer_layer_config"] if "speculators_model_type" in config else config


def _architectures(directory: Path) -> list[str]:
    if not (Path(directory) / CONFIG_FILE).is_file():
        return []
    try:
        return list(export_config(directory).get("architectures") or [])
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
        return []


def is_eagle3_export(directory: Path) -> bool:
    return EAGLE3_ARCHITECTURE in _architectures(directory)


def is_dflash_export(directory: Path) -> bool:
    return DFLASH_ARCHITECTURE in _architectures(directory)


def is_dspark_export(directory: Path) -> bool:
    return DSPARK_ARCHITECTURE in _architectures(directory)


def _target_shape_mismatch(config: dict, cfg) -> dict:
    expected = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_key_value_heads,
                "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads}
    return {key: (config.get(key), value) for key, value in expected.items() if config.get(key, value) != value}


def _read_weights(directory: Path, what: str) -> dict[str, torch.Tensor]:
    weight_files = sorted(directory.glob("*.safetensors"))
    if not weight_files:
        raise FileNotFoundError(f"{directory} has a {what} config.json but no *.safetensors weights")
    state = {}
    for path in weight_files:
        state.update(load_weights(path))
    return state


def _load_into(module: torch.nn.Module, state: dict[str, torch.Tensor], directory: Path, layout: str, target):
    """Load `state` into `module` (every key must match: a wrong layout is a clear error) and put it
    on the target's device / dtype."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory} is not {layout}: missing {sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]}")
    return module.to(device=target.device, dtype=target.dtype).eval()


def load_dflash_export(directory: str | Path, target) -> DFlashModule:
    """A DFlashDraftModel directory (ours or a published one for this target) as a module on the target's device / dtype."""
    directory = Path(directory)
    config = export_config(directory)
    cfg = target.config
    wrong = _target_shape_mismatch(config, cfg)
    dflash = config.get("dflash_config") or {}
    if config.get("num_target_layers", cfg.num_hidden_layers) != cfg.num_hidden_layers:
        wrong["num_target_layers"] = (config.get("num_target_layers"), cfg.num_hidden_layers)
    if wrong:
        raise ValueError(f"DFlash drafter {directory} does not fit target {getattr(target, 'name', '')!r} "
                         f"(field: drafter, target): {wrong}")
    if "block_size" not in config or dflash.get("mask_token_id") is None:
        raise ValueError(f"{directory} is not a DFlash drafter: config.json needs block_size and dflash_config.mask_token_id")
    num_layers = int(config.get("num_hidden_layers", 1))
    layer_ids = dflash.get("target_layer_ids")
    module = DFlashModule(cfg, block_size=int(config["block_size"]), num_draft_layers=num_layers,
                          mask_token_id=int(dflash["mask_token_id"]), intermediate_size=config.get("intermediate_size"),
                          input_layers=tuple(int(i) + 1 for i in layer_ids) if layer_ids else None)
    state = _read_weights(directory, "DFlash")
    for unused in ("embed_tokens.weight", "lm_head.weight"):  # some drafters carry the target's: we use the target's own
        state.pop(unused, None)
    state = {name.removeprefix("model."): tensor.float() for name, tensor in state.items()}
    return _load_into(module, state, directory, "a DFlash drafter in the DFlashDraftModel layout", target)


def load_eagle3_export(directory: str | Path, target) -> Eagle3Module:
    """An EAGLE-3 directory (ours or a published one for this target) as a module on the target's device / dtype."""
    directory = Path(directory)
    config = export_config(directory)
    cfg = target.config
    wrong = _target_shape_mismatch(config, cfg)
    if wrong:
        raise ValueError(f"EAGLE-3 drafter {directory} does not fit target {getattr(target, 'name', '')!r} "
                         f"(field: drafter, target): {wrong}")
    module = Eagle3Module(cfg, draft_vocab_size=config.get("draft_vocab_size") or cfg.vocab_size,
                          intermediate_size=config.get("intermediate_size"))
    aux_layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux_layers:
        module.fused_layers = tuple(int(layer) for layer in aux_layers)
    state = _read_weights(directory, "EAGLE-3")
    state.pop("embed_tokens.weight", None)  # some published drafters carry the target's embeddings: we use the target's own
    if "d2t" not in state and module.d2t.shape[0] == cfg.vocab_size:
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
    if "t2d" not in state and "d2t" in state:
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(
            0, torch.arange(state["d2t"].shape[0]) + state["d2t"].long(), True)
    state = {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    return _load_into(module, state, directory, "an EAGLE-3 drafter in the LlamaForCausalLMEagle3 layout", target)


def load_dspark_export(directory: str | Path, target) -> DSparkModule:
    """A DSpark directory in DeepSpec's layout (ours, or a published one for this target) as a
    module on the target's device / dtype; its embed_tokens / lm_head copies are dropped (the
    target's own are used)."""
    directory = Path(directory)
    config = export_config(directory)
    cfg = target.config
    wrong = _target_shape_mismatch(config, cfg)
    if config.get("num_target_layers", cfg.num_hidden_layers) != cfg.num_hidden_layers:
        wrong["num_target_layers"] = (config.get("num_target_layers"), cfg.num_hidden_layers)
    if wrong:
        raise ValueError(f"DSpark drafter {directory} does not fit target {getattr(target, 'name', '')!r} "
                         f"(field: drafter, target): {wrong}")
    missing_keys = [key for key in ("block_size", "mask_token_id", "target_layer_ids", "markov_rank") if config.get(key) is None]
    if missing_keys:
        raise ValueError(f"{directory} is not a DSpark drafter: config.json lacks {missing_keys}")
    head = {cls.deepspec_type: kind for kind, cls in SEQUENTIAL_HEADS.items()}.get(config.get("markov_head_type", "vanilla"))
    if head is None or not config.get("enable_confidence_head", True) or not config.get("confidence_head_with_markov", True):
        raise ValueError(f"{directory}: specdec runs DSpark with a vanilla or rnn Markov head and a confidence head "
                         f"reading it; this one has markov_head_type {config.get('markov_head_type')!r}, "
                         f"confidence head {config.get('enable_confidence_head')}, with markov {config.get('confidence_head_with_markov')}")
    module = DSparkModule(cfg, block_size=int(config["block_size"]), num_draft_layers=int(config.get("num_hidden_layers", 1)),
                          mask_token_id=int(config["mask_token_id"]), intermediate_size=config.get("intermediate_size"),
                          input_layers=tuple(int(i) + 1 for i in config["target_layer_ids"]),
                          markov_rank=int(config["markov_rank"]), sequential_head=head)
    state = {}
    for name, tensor in _read_weights(directory, "DSpark").items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            continue
        is_sequential = name.startswith(("markov_head.", "confidence_head."))
        state[(_SEQUENTIAL_PREFIX if is_sequential else "") + name] = tensor.float()
    temperatures = config.get("confidence_temperatures") or [1.0] * module.block_size
    if len(temperatures) != module.block_size:
        raise ValueError(f"{directory}: {len(temperatures)} confidence_temperatures for a block of {module.block_size}")
    state[_SEQUENTIAL_PREFIX + "confidence_temperatures"] = torch.tensor(temperatures, dtype=torch.float32)
    return _load_into(module, state, directory, "a DSpark drafter in DeepSpec's layout", target)
