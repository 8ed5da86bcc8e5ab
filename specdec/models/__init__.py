"""Model loading: registry names, local HF directories and .gguf files -> a Target."""

from __future__ import annotations

import json

from .llama import SUPPORTED_MODEL_TYPES, WEIGHT_FORMATS, load_native


def add_weights_argument(parser) -> None:
    """`--weights gguf|gguf-a8|fp32`, for every command that loads a target (load_target's `weights`)."""
    parser.add_argument(
        "--weights", choices=WEIGHT_FORMATS, default=None,
        help="GGUF-sourced models: 'gguf' runs the file's quantized blocks in the kernel (default when the "
             "kernel runs here), 'fp32' dequantizes them at load (same logits, ~6x the bytes per step), "
             "'gguf-a8' runs the blocks on int8-quantized activations (cheaper multi-token verify; lossy vs "
             "gguf/fp32, speculation exact w.r.t. it)",
    )


def has_gguf_blocks(name_or_path: str) -> bool:
    """Whether the model's weights hold GGUF blocks (a GGUF-sourced model: it can load as gguf / gguf-a8)."""
    from .gguf import read_block_types
    from .registry import resolve_model_dir

    return any(read_block_types(shard) for shard in resolve_model_dir(name_or_path, progress=False).glob("*.safetensors"))


def load_target(name_or_path: str, dtype: str = "float32", progress: bool = True, weights: str | None = None):
    """Resolve `name_or_path` to an HF-format directory, then load it natively when the
    architecture is supported (Llama family) or through transformers otherwise.

    `weights`: None = as stored ("gguf" for a GGUF-sourced Llama-family model when the kernel
    runs here, dense otherwise); "gguf" = keep the GGUF blocks (error if there are none);
    "gguf-a8" = the blocks on int8 activations (lossy, cheaper verify); "fp32" = dense weights
    (GGUF blocks dequantized at load). See `load_native`."""
    from .registry import resolve_model_dir

    model_dir = resolve_model_dir(name_or_path, progress=progress)
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return load_native(model_dir, dtype=dtype, name=name_or_path, weights=weights)
    if weights in ("gguf", "gguf-a8"):
        raise ValueError(f"weights={weights!r}: {name_or_path} ({model_type}) runs through transformers with dense weights; "
                         "use weights='fp32' (or leave it unset)")
    from .hf import HFTarget

    return HFTarget.from_dir(model_dir, dtype=dtype, name=name_or_path)
