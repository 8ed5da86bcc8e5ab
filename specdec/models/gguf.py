"""GGUF file -> HF-format model directory (config.json, model.safetensors, tokenizer files).

Weights: a fast native mapper for the llama and qwen2 architectures (rename llama.cpp names to
HF names, undo llama.cpp's rotary permutation of the llama Q/K rows) streamed one tensor at a
time into a safetensors file, so peak memory is one tensor, not the whole model. Tensors in a
block format the kernel computes on (`specdec.kernels.KERNEL_TYPES`: Q4_0 ... Q6_K) are kept as
the file stores them: uint8 [out, row_bytes] in ggml's row layout, their types listed in the
safetensors metadata under `gguf_types` (see `read_block_types`). Everything else is dequantised
to float32 with `gguf.quants.dequantize`, which is also how the native loader turns blocks into
fp32 weights when asked (`weights="fp32"`): the same numbers the old all-fp32 cache held. Any
other architecture (e.g. gemma3) goes through transformers' own GGUF loader
(`load_gguf_checkpoint`), float32, slower but aware of each architecture's quirks.

Config, tokenizer (incl. chat template) and generation config come from transformers' GGUF
support: that is the reference the converted directory must match.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..paths import read_marker

# Bump when the output of this module changes. Each version has its own cache directory
# (registry.models_root), so checkouts of different versions never rebuild each other's entries.
CONVERTER_VERSION = 2  # 2: GGUF blocks kept as stored (1: everything dequantised to float32)
WEIGHTS_FILE = "model.safetensors"
BLOCK_TYPES_KEY = "gguf_types"  # safetensors metadata: JSON {tensor name: ggml type id} of block tensors

# llama.cpp per-block tensor name -> HF name inside `model.layers.N.`
BLOCK_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp model-level tensor name -> HF name
GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_PATTERN = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_PATTERN = re.compile(r"^([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class FastArch:
    """How the native mapper treats one GGUF `general.architecture`."""

    permuted_qk: bool  # llama.cpp's converter interleaved the rotary halves of Q and K


FAST_ARCHS: dict[str, FastArch] = {
    "llama": FastArch(permuted_qk=True),
    "qwen2": FastArch(permuted_qk=False),  # llama.cpp does NOT permute qwen2
}


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name for a llama.cpp tensor name, or None if the fast mapper doesn't know it."""
    if match := _BLOCK_PATTERN.match(gguf_name):
        layer, part, kind = match.groups()
        hf_part = BLOCK_TENSOR_NAMES.get(part)
        return None if hf_part is None else f"model.layers.{layer}.{hf_part}.{kind}"
    if match := _GLOBAL_PATTERN.match(gguf_name):
        part, kind = match.groups()
        hf_part = GLOBAL_TENSOR_NAMES.get(part)
        return None if hf_part is None else f"{hf_part}.{kind}"
    return None


def unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute()` of a llama Q or K weight/bias (rows are [heads * head_dim]).

    llama.cpp reorders each head's rows from HF's "half-split" rotary layout [x0..x_{d/2-1},
    y0..] to the interleaved [x0, y0, x1, y1, ...]: reshape(heads, 2, d/2).swap(1, 2).
    The inverse is reshape(heads, d/2, 2).swap(1, 2).
    """
    rows = weights.shape[0]
    half_head_dim = rows // num_heads // 2
    grouped = weights.reshape(num_heads, half_head_dim, 2, *weights.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weights.shape)


# ----------------------------------------------------------------------------- safetensors


SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}


def write_safetensors_streaming(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    produce: Callable[[str], np.ndarray],
    metadata: dict[str, str] | None = None,
    dtypes: dict[str, np.dtype] | None = None,
) -> None:
    """Write tensors (float32, or as `dtypes` says: float32 / uint8) to `path` in safetensors
    format, producing them one at a time.

    Format: u64 little-endian header size, JSON header {name: {dtype, shape, data_offsets}},
    then the raw bytes. The header is known up front from the shapes, so no tensor has to wait
    in memory for the others.
    """
    dtypes = {name: np.dtype((dtypes or {}).get(name, np.float32)) for name in shapes}
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, shape in shapes.items():
        size = int(np.prod(shape, dtype=np.int64)) * dtypes[name].itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtypes[name]], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data must start 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(header_bytes)))
        out.write(header_bytes)
        for name, shape in shapes.items():
            array = np.ascontiguousarray(produce(name), dtype=dtypes[name])
            if tuple(array.shape) != tuple(shape):
                raise ValueError(f"tensor {name}: produced shape {array.shape}, header says {shape}")
            out.write(array.tobytes())


# ----------------------------------------------------------------------------- weights


def _field_value(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def fast_arch_of(reader) -> FastArch | None:
    """The FastArch for this file, or None when the native mapper can't cover every tensor."""
    arch = FAST_ARCHS.get(_field_value(reader, "general.architecture"))
    if arch is None:
        return None
    if any(hf_tensor_name(tensor.name) is None for tensor in reader.tensors):
        return None  # e.g. rope_freqs: let transformers decide what to do with it
    return arch


@dataclass
class TensorPlan:
    """What the native mapper writes: HF name -> shape, dtype, a thunk producing the array; and
    the ggml type of each tensor kept as blocks."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, np.dtype]
    producers: dict[str, Callable[[], np.ndarray]]
    block_types: dict[str, int]


def native_tensor_plan(reader, keep_blocks: bool = False) -> TensorPlan:
    """The HF tensors of a llama/qwen2 GGUF (fast archs only): float32, except that with
    `keep_blocks` every 2-D tensor in a kernel block format stays uint8 blocks [out, row_bytes]."""
    from gguf.quants import dequantize

    from ..kernels.gguf_linear import KERNEL_TYPES

    architecture = _field_value(reader, "general.architecture")
    arch = FAST_ARCHS[architecture]
    num_heads = int(_field_value(reader, f"{architecture}.attention.head_count"))
    num_kv_heads = int(_field_value(reader, f"{architecture}.attention.head_count_kv") or num_heads)
    heads_for = {"attn_q": num_heads, "attn_k": num_kv_heads}

    plan = TensorPlan({}, {}, {}, {})
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name)
        # GGUF lists dims fastest-first (ne0 = in_features); numpy/HF order is the reverse
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        part = tensor.name.split(".")[-2]
        unpermute_heads = heads_for.get(part) if arch.permuted_qk else None
        as_blocks = keep_blocks and len(shape) == 2 and int(tensor.tensor_type) in KERNEL_TYPES.values()
        if as_blocks:  # rows of blocks: the rotary row permutation is undone on whole rows, exactly
            plan.block_types[hf_name] = int(tensor.tensor_type)
            shape = (shape[0], int(tensor.data.nbytes) // shape[0])

        def produce(tensor=tensor, shape=shape, unpermute_heads=unpermute_heads, as_blocks=as_blocks) -> np.ndarray:
            if as_blocks:
                weights = np.asarray(tensor.data).reshape(shape)
            else:
                weights = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32, copy=False)
            return weights if unpermute_heads is None else unpermute_rotary(weights, unpermute_heads)

        plan.shapes[hf_name] = shape
        plan.dtypes[hf_name] = np.dtype(np.uint8 if as_blocks else np.float32)
        plan.producers[hf_name] = produce
    return plan


def read_block_types(weights_file: Path | str) -> dict[str, int]:
    """{tensor name: ggml type id} of the tensors a converted safetensors file keeps as GGUF blocks."""
    from safetensors import safe_open

    with safe_open(str(weights_file), framework="pt") as reader:
        metadata = reader.metadata() or {}
    return {name: int(ggml_type) for name, ggml_type in json.loads(metadata.get(BLOCK_TYPES_KEY, "{}")).items()}


def read_blocks_in_huge_pages(weights_file: Path | str, names) -> dict:
    """{name: uint8 tensor} for the block tensors `names` of a converted safetensors file, read with
    plain file reads (not through a mapping of the file, which would count twice in RSS) into one
    buffer in 2 MiB pages (`huge_page_buffer`: the kernel streams them every forward)."""
    from ..kernels import huge_page_buffer

    alignment = 4096  # each tensor starts on a page
    with open(weights_file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        entries, total = [], 0
        for name in names:
            if name not in header:
                raise KeyError(f"{weights_file} holds no tensor {name!r}")
            info = header[name]
            if info["dtype"] != "U8":
                raise ValueError(f"{weights_file}: block tensor {name} is {info['dtype']}, expected U8")
            begin, end = info["data_offsets"]
            entries.append((name, info["shape"], begin, end - begin, total))
            total += -(-(end - begin) // alignment) * alignment
        buffer = huge_page_buffer(total)
        view = memoryview(buffer.numpy())
        tensors = {}
        for name, shape, begin, size, offset in entries:
            f.seek(data_start + begin)
            if f.readinto(view[offset:offset + size]) != size:
                raise ValueError(f"{weights_file}: tensor {name} is truncated")
            tensors[name] = buffer[offset:offset + size].view(shape)
    return tensors


def read_gguf_state_dict(gguf_path: Path | str) -> dict[str, np.ndarray]:
    """Whole HF state dict (float32 numpy) from a llama/qwen2 GGUF (for tests and inspection)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    if fast_arch_of(reader) is None:
        raise ValueError(f"{gguf_path}: architecture {_field_value(reader, 'general.architecture')!r} not in the fast mapper ({', '.join(FAST_ARCHS)})")
    producers = native_tensor_plan(reader).producers
    return {name: np.array(produce(), copy=True) for name, produce in producers.items()}  # own memory, not the mmap


def _transformers_state_dict(gguf_path: Path, config) -> dict[str, np.ndarray]:
    """Fallback for other architectures: transformers' own GGUF loader (slow, but knows quirks)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only the parameter names are needed, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)
    expected = set(skeleton.state_dict())
    tensors = {name: t.float().numpy() for name, t in parsed["tensors"].items() if name in expected}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    return tensors


# ----------------------------------------------------------------------------- directory


def _hf_config(gguf_path: Path):
    from transformers import AutoConfig

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # e.g. mistral files say "llama"
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = "float32"
    config.name_or_path = ""
    return config


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))


def _save_generation_config(config, out_dir: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))


def convert_gguf_to_hf_dir(gguf_path: Path | str, out_dir: Path | str, progress: bool = True,
                           tokenizer: bool = True, fast: bool = True, keep_blocks: bool = True) -> Path:
    """Write config.json, model.safetensors, generation_config.json and tokenizer files.

    `out_dir` must exist (callers build into a temp dir and rename it; see registry.py).
    `keep_blocks` (llama/qwen2): kernel block formats stay GGUF blocks; False: all float32.
    `fast=False` forces transformers' loader even for llama/qwen2 (a cross-check / escape hatch;
    float32 only).
    """
    from gguf import GGUFReader
    from tqdm.auto import tqdm

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(str(gguf_path))
    config = _hf_config(gguf_path)
    arch = fast_arch_of(reader) if fast else None
    dtypes, metadata = None, None
    if arch is not None:
        plan = native_tensor_plan(reader, keep_blocks=keep_blocks)
        shapes, producers, dtypes = plan.shapes, plan.producers, plan.dtypes
        metadata = {BLOCK_TYPES_KEY: json.dumps(plan.block_types)} if plan.block_types else None
    else:
        tensors = _transformers_state_dict(gguf_path, config)
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        producers = {name: (lambda name=name: tensors.pop(name)) for name in tensors}
    if "lm_head.weight" not in shapes:
        config.tie_word_embeddings = True  # no `output` tensor: the head is the embedding

    bar = tqdm(total=len(shapes), unit="tensor", desc=f"converting {gguf_path.name}", disable=not progress)

    def produce(name: str) -> np.ndarray:
        bar.update(1)
        return producers[name]()

    with bar:
        write_safetensors_streaming(out_dir / WEIGHTS_FILE, shapes, produce, metadata=metadata, dtypes=dtypes)
    config.save_pretrained(str(out_dir))
    _save_generation_config(config, out_dir)
    if tokenizer:
        _save_tokenizer(gguf_path, out_dir)
    return out_dir

