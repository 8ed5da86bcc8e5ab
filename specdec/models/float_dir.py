"""A float HF directory of a model, for engines that read no GGUF blocks (vLLM rejects the cached
directory's block tensors with a shape error on the first projection).

Written once beside the cached model, `<models>/v<N>/<name>-hf-float/` (float32 safetensors, the
same config and tokenizer files, a marker written last), from the same verified GGUF file with
`convert_gguf_to_hf_dir(..., keep_blocks=False)`.
"""

from __future__ import annotations

from pathlib import Path

from ..paths import read_marker, writing_cache

FLOAT_DIR_SUFFIX = "-hf-float"


def holds_gguf_blocks(model_dir: Path) -> bool:
    """True when a HF directory's safetensors carry GGUF block tensors (specdec's cached conversion)."""
    from safetensors import safe_open

    from .gguf import BLOCK_TYPES_KEY

    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as weights:
            if BLOCK_TYPES_KEY in (weights.metadata() or {}):
                return True
    return False


def float_model_dir(name_or_path: str, progress: bool = True) -> Path:
    """A HF directory of `name_or_path` (registry name, HF dir or .gguf file) with float weights only.

    A directory without GGUF blocks is returned as it is; otherwise the float copy beside the
    cached conversion, converted from the same GGUF file the first time."""
    from .registry import _is_complete, convert_into_cache, resolve_model_dir, source_gguf_of

    model_dir = resolve_model_dir(name_or_path, progress=progress)
    if not holds_gguf_blocks(model_dir):
        return model_dir
    marker = read_marker(model_dir) or {}
    digest = marker.get("source_sha256")
    float_dir = model_dir.with_name(model_dir.name + FLOAT_DIR_SUFFIX)
    if _is_complete(float_dir, digest):
        return float_dir
    source = source_gguf_of(model_dir, progress=progress)
    with writing_cache(f"the float copy of {model_dir.name}"):
        return convert_into_cache(source, float_dir, digest, str(marker.get("name", model_dir.name)),
                                  progress=progress, keep_blocks=False)
