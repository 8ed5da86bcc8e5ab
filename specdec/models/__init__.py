"""Model loading: registry names, local HF directories and .gguf files -> a Target."""

from __future__ import annotations

import json

from .llama import SUPPORTED_MODEL_TYPES, load_native


def load_target(name_or_path: str, dtype: str = "float32", progress: bool = True):
    """Resolve `name_or_path` to an HF-format directory, then load it natively when the
    architecture is supported (Llama family) or through transformers otherwise."""
    from .registry import resolve_model_dir

    model_dir = resolve_model_dir(name_or_path, progress=progress)
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return load_native(model_dir, dtype=dtype, name=name_or_path)
    from .hf import HFTarget

    return HFTarget.from_dir(model_dir, dtype=dtype, name=name_or_path)
