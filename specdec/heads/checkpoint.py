"""Head checkpoints: `config.json` + `model.safetensors` (head weights only), tied to one target.

A checkpoint records the target's fingerprint, so loading heads next to another model is a clear
error rather than silently wrong drafts. The state-dict keys are the modules' own parameter names.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..files import open_output_dir, save_safetensors, write_text_atomic
from .modules import HEAD_TYPES, LABEL_CONVENTION, DraftHeads

CHECKPOINT_FORMAT = "specdec-draft-heads"
CHECKPOINT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

_FINGERPRINT_CONFIG_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "rope_theta", "rope_parameters",
)
_SAMPLES_PER_TENSOR = 4096


def target_fingerprint(target) -> str:
    """sha256 of the target's architecture config and a strided sample of every weight tensor.

    Weights are rounded to bfloat16 before hashing, so one model loaded in float32 or bfloat16
    has one fingerprint, while a different model (or another fine-tune) gets another.
    """
    digest = hashlib.sha256()
    cfg = target.config
    described = {key: getattr(cfg, key, None) for key in _FINGERPRINT_CONFIG_KEYS}
    digest.update(json.dumps(described, sort_keys=True, default=str).encode())
    model = getattr(target, "model", None)
    if model is None or not hasattr(model, "named_parameters"):
        raise ValueError(f"cannot fingerprint target {getattr(target, 'name', target)!r}: it exposes no weights")
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            flat = param.detach().reshape(-1)
            stride = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::stride][:_SAMPLES_PER_TENSOR].to("cpu", torch.bfloat16).contiguous()
            digest.update(f"{name}:{tuple(param.shape)}".encode())
            digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def target_description(target) -> dict:
    return {
        "name": getattr(target, "name", ""),
        "fingerprint": target_fingerprint(target),
        "model_type": target.config.model_type,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "num_layers": target.num_layers,
    }


def save_checkpoint(directory: str | Path, heads: DraftHeads, target_info: dict, extra: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (head weights only, fp32) into `directory` atomically per file
    (a directory that is not a specdec checkpoint is refused: specdec.files)."""
    directory = open_output_dir(directory, "checkpoint")
    state = {name: tensor.detach().to("cpu", torch.float32 if tensor.is_floating_point() else tensor.dtype).contiguous()
             for name, tensor in heads.state_dict().items()}  # index buffers (EAGLE-3's d2t / t2d) keep their dtype
    save_safetensors(directory / WEIGHTS_FILE, state)
    config = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_VERSION,
        "drafter": heads.drafter,
        "head": heads.head_config(),
        "label_convention": LABEL_CONVENTION,
        "target": target_info,
        **(extra or {}),
    }
    write_text_atomic(directory / CONFIG_FILE, json.dumps(config, indent=2))
    return directory


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file (a checkpoint's, an export's, a data shard); a truncated
    or damaged file is one clear error naming it, for every reader alike."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as error:
        raise ValueError(f"{path} is truncated or corrupt ({error}); write it again") from None


def read_checkpoint_config(directory: str | Path) -> dict:
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{directory} is not a specdec head checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
    except ValueError:
        raise ValueError(f"{config_path} is truncated or corrupt (not JSON); write it again") from None
    if config.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{config_path} is not a specdec head checkpoint (format {config.get('format')!r})")
    if config.get("format_version") != CHECKPOINT_VERSION:
        raise ValueError(f"{config_path} has format version {config.get('format_version')}; this specdec reads {CHECKPOINT_VERSION}")
    return config


def check_target_matches(config: dict, target, source: str) -> None:
    """A clear error when `source` (a checkpoint or data dir) was made for a different target."""
    expected = config.get("target", {})
    actual = target_fingerprint(target)
    if expected.get("fingerprint") != actual:
        raise ValueError(
            f"{source} was made for target {expected.get('name')!r} (fingerprint {str(expected.get('fingerprint'))[:12]}, "
            f"{expected.get('model_type')}, hidden {expected.get('hidden_size')}, vocab {expected.get('vocab_size')}), "
            f"but the loaded target is {getattr(target, 'name', '')!r} (fingerprint {actual[:12]}, "
            f"{target.config.model_type}, hidden {target.hidden_size}, vocab {target.vocab_size}): "
            "train heads for this target, or load the target they were trained for"
        )


def load_checkpoint(directory: str | Path, target, drafter: str | None = None) -> tuple[DraftHeads, dict]:
    """(heads in the target's dtype/device, config) from a checkpoint; errors for a wrong target or drafter."""
    config = read_checkpoint_config(directory)
    if drafter is not None and config["drafter"] != drafter:
        raise ValueError(
            f"checkpoint {directory} holds {config['head']['kind']!r} heads for the {config['drafter']!r} drafter, "
            f"not for {drafter!r}"
        )
    check_target_matches(config, target, f"checkpoint {directory}")
    kind = config["head"]["kind"]
    if kind not in HEAD_TYPES:
        raise ValueError(f"checkpoint {directory} has unknown head type {kind!r}; known: {', '.join(HEAD_TYPES)}")
    heads = HEAD_TYPES[kind].from_config(config["head"], target.config)
    heads.load_state_dict(load_weights(Path(directory) / WEIGHTS_FILE))
    return heads.to(device=target.device, dtype=target.dtype).eval(), config
