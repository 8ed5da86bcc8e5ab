"""What a results.json records about how it was made: the command that reproduces the run and
the machine it ran on (CPU model, the instruction-set features the kernel uses, threads, versions).

Numbers from different CPUs are not comparable (the kernel is built for the widest instruction
set the CPU has: AVX2, AVX-512, VNNI, AMX int8 tiles), so every result names its machine by
these features; `scripts/results_page.py` prints them above each table.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from dataclasses import fields
from pathlib import Path

# /proc/cpuinfo flags the kernel's builds and paths depend on (kernels/build.py: AVX2 / AVX-512
# builds, VNNI and AMX int8 for the gguf-a8 dot products; avx512_bf16 / amx_bf16: the trainer's bf16 autocast)
KERNEL_CPU_FEATURES = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
                       "amx_bf16")
# the kernel's AVX2 builds (kernels/build.py), as a machine description names them
_AVX2_BUILDS = {"avx2": "AVX2", "avx2-vnni": "AVX2 + AVX-VNNI"}
# SPECDEC_* settings that do not change what a run measures (where files are kept)
_ENV_WITHOUT_EFFECT = {"SPECDEC_CACHE", "SPECDEC_DEBUG"}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_record(linear_backend: str | None = None) -> dict:
    """The machine and software a benchmark ran on, for results.json (`linear_backend`: the target's,
    "cpp" = the kernel, "int8" or "torch")."""
    import torch
    import transformers

    from ..kernels.build import cpu_flags  # bench may import kernels (never the other way)

    flags = cpu_flags()
    llama_cpp = sys.modules.get("llama_cpp")  # imported only when a llama-* peer ran
    kernel_isa = kernel_amx = None
    if linear_backend == "cpp":  # the build and AMX setting the target's linears ran on
        from ..kernels.library import load_library

        kernel = load_library()
        kernel_isa, kernel_amx = kernel.isa, kernel.amx
    return {
        "cpu": cpu_model(),
        "cpu_features": [feature for feature in KERNEL_CPU_FEATURES if feature in flags],
        "threads": torch.get_num_threads(),
        "linear_backend": linear_backend,
        "kernel_isa": kernel_isa,
        "kernel_amx": kernel_amx,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp": getattr(llama_cpp, "__version__", None),
        "machine": platform.machine(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def describe_machine(record: dict) -> str:
    """'AMD EPYC, AVX-512 VNNI/BF16, no AMX, 2 threads' from a machine record (results.json config);
    a kernel built for AVX2 on an AVX-512 CPU, or with its AMX tiles turned off, is named too."""
    features = set(record.get("cpu_features") or ())
    if "avx512f" in features:
        extras = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16")) if flag in features]
        isa = "AVX-512" + (" " + "/".join(extras) if extras else "")
        if record.get("kernel_isa") in _AVX2_BUILDS:
            isa += f" (kernel built for {_AVX2_BUILDS[record['kernel_isa']]}: SPECDEC_KERNEL_ISA={record['kernel_isa']})"
    else:
        isa = ("AVX2 + AVX-VNNI" if "avx_vnni" in features else "AVX2") if "avx2" in features else "no AVX2"
    amx = "AMX" if {"amx_tile", "amx_int8"} <= features else "no AMX"
    if amx == "AMX" and record.get("kernel_amx") is False:  # the AVX2 builds have no tile paths
        amx = "AMX unused" if record.get("kernel_isa") in _AVX2_BUILDS else "AMX off (SPECDEC_KERNEL_AMX=0)"
    return f"{record.get('cpu', 'unknown CPU')}, {isa}, {amx}, {record.get('threads', '?')} threads"


def bench_command(config, target_name: str | None = None) -> str:
    """The `specdec bench` command line that reproduces a run of `config` (a BenchConfig): the
    SPECDEC_* settings in effect, then every option that differs from its default (methods and
    target always). `target_name` replaces config.target when the run got an already loaded target."""
    defaults = type(config)()  # the BenchConfig defaults (runner.py imports this module, not the other way)
    changed = {f.name for f in fields(config) if getattr(config, f.name) != getattr(defaults, f.name)}
    args = ["--methods", ",".join(config.methods), "--target", target_name or config.target]
    options = (("draft_model", "--draft-model"), ("questions_path", "--questions"), ("max_new_tokens", "--max-new-tokens"),
               ("gamma", "--gamma"), ("temperature", "--temperature"), ("top_k", "--top-k"), ("top_p", "--top-p"),
               ("seed", "--seed"), ("dtype", "--dtype"), ("weights", "--weights"))
    for name, flag in options:
        if name in changed:
            args += [flag, str(getattr(config, name))]
    if "task_kinds" in changed:
        args += ["--kinds", ",".join(config.task_kinds)]
    if config.limit_per_kind is None:
        args.append("--full")
    elif config.limit_per_kind != defaults.limit_per_kind:
        args += ["--limit-per-category", str(config.limit_per_kind)]
    if not config.warmup:
        args.append("--no-warmup")
    if config.repeats != defaults.repeats:
        args += ["--repeats", str(config.repeats)]
    if config.out_dir:
        args += ["--out", str(config.out_dir)]
    settings = [f"{key}={shlex.quote(value)}" for key, value in sorted(os.environ.items())
                if key.startswith("SPECDEC_") and key not in _ENV_WITHOUT_EFFECT]
    return " ".join(settings + ["specdec", "bench"] + [shlex.quote(arg) for arg in args])
