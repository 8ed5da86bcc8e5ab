"""Micro-benchmark of the linear backends (a developer tool): ms per linear call, method x rows, for the Qwen2.5-Coder layer shapes.

    python scripts/bench_linear.py                       # 8960x1536 and 1536x1536, rows 1..16
    python scripts/bench_linear.py --shapes model        # every 0.5B/1.5B layer shape + LM heads
    python scripts/bench_linear.py --methods torch,cpp_avx512 --rows 1,8 --reps 30
    python scripts/bench_linear.py --forward qwen2.5-0.5b   # whole native forward, random weights
    python scripts/bench_linear.py --perplexity smollm2-135m  # fp32 vs int8 accuracy

Shapes are weight shapes [out, in]. By default weights are "cold": each method cycles through
enough copies of the weight to overflow the CPU caches (~1 GiB per shape), as in a real forward
where every layer's weights come from DRAM; --hot reuses one copy (an upper bound on speed).
Methods run interleaved per repetition, so background load hits them alike; the table prints
the median (and with --min the minimum) over repetitions. Prints a markdown table.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see docs/architecture.md "Machine facts"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specdec.kernels import BACKENDS, KernelUnavailable  # noqa: E402

DEFAULT_SHAPES = ((8960, 1536), (1536, 1536))
MODEL_SHAPES = (
    (896, 896), (4864, 896), (896, 4864), (151936, 896),  # Qwen2.5-Coder-0.5B: attn/o, gate/up, down, lm_head
    (1536, 1536), (8960, 1536), (1536, 8960), (151936, 1536),  # Qwen2.5-Coder-1.5B
)  # fmt: skip
COLD_BYTES = 1 << 30  # weight copies per shape so that one pass overflows the caches


def _prepared_backend(name: str, **options) -> Callable:
    backend = BACKENDS[name](**options)
    return lambda weight, bias: (lambda x: backend.linear(x, weight, bias))


def _mkl_packed(weight, bias):
    """MKL packed-weight GEMM (what inductor's freezing uses for fp32 linears)."""
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 8)
    return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, bias, 8)


def _onednn_packed(weight, bias):
    """oneDNN linear with a weight reordered once to its blocked layout."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def method_table(compiler: str | None = None) -> dict[str, Callable]:
    """name -> prepare(weight, bias) -> run(x). Methods that cannot run here are left out (printed)."""
    methods = {
        "torch": _prepared_backend("torch"),
        "rowwise": _prepared_backend("rowwise"),
        "mkl_packed": _mkl_packed,
        "onednn_packed": _onednn_packed,
    }
    for isa in ("avx512", "avx2"):
        try:
            methods[f"cpp_{isa}"] = _prepared_backend("cpp", compiler=compiler, isa=isa)
        except KernelUnavailable as exc:
            print(f"# cpp_{isa}: unavailable ({exc})")
    try:
        methods["int8"] = _prepared_backend("int8", compiler=compiler)
    except KernelUnavailable as exc:
        print(f"# int8: unavailable ({exc})")
    try:
        kernel = BACKENDS["cpp"](compiler=compiler)
        for type_name in ("Q4_K", "Q6_K", "Q8_0", "Q5_0"):
            methods[f"gguf_{type_name.lower()}"] = _gguf_blocks(type_name, kernel)
            methods[f"gguf_{type_name.lower()}_a8"] = _gguf_blocks(type_name, kernel, activations="int8")
            if kernel.library.amx and type_name.endswith("_K"):  # the same kernel with AMX off (A/B)
                name = f"gguf_{type_name.lower()}_a8"
                methods[f"{name}_noamx"] = _without_amx(kernel.library, methods[name])
    except KernelUnavailable as exc:
        print(f"# gguf: unavailable ({exc})")
    return methods


def _without_amx(library, prepare: Callable) -> Callable:
    """prepare(weight, bias) -> run(x) with AMX tiles turned off for the call (same bits, VNNI speed)."""

    def prepare_without(weight, bias):
        run = prepare(weight, bias)

        def run_without(x):
            library.set_amx(False)
            try:
                return run(x)
            finally:
                library.set_amx(True)

        return run_without

    return prepare_without


def _gguf_blocks(type_name: str, kernel, activations: str = "fp32") -> Callable:
    """GGUFLinear on random valid blocks of the weight's shape (timing only: the kernel's work
    and bytes do not depend on the values; finite fp16 scales keep the arithmetic ordinary).
    activations="int8": the gguf-a8 mode."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from specdec.kernels import GGUFLinear

    qtype = GGMLQuantizationType[type_name]
    block, nbytes = GGML_QUANT_SIZES[qtype]
    scale_offsets = {"Q6_K": (208,)}.get(type_name, (0, 2) if type_name.endswith("_K") else (0,))

    def prepare(weight, bias):
        out_features, in_features = weight.shape
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, size=(out_features, in_features // block, nbytes), dtype=np.uint8)
        scales = np.full((out_features, in_features // block), 0.01, dtype=np.float16).view(np.uint8)
        for offset in scale_offsets:
            data[..., offset : offset + 2] = scales.reshape(out_features, -1, 2)
        layer = GGUFLinear(torch.from_numpy(data.reshape(out_features, -1)), int(qtype), in_features, bias, kernel,
                           activations)
        return layer

    return prepare


def time_methods(prepared: dict[str, list[Callable]], x: torch.Tensor, reps: int) -> dict[str, list[float]]:
    """ms per call for each method, interleaved. Every call (of any method) takes the next weight
    copy in turn, so no call finds its weight still cached from the call before it."""
    times = {name: [] for name in prepared}
    for name, runs in prepared.items():  # warm-up: touch every copy once
        for run in runs:
            run(x)
    calls = 0
    for _ in range(reps):
        for name, runs in prepared.items():
            run = runs[calls % len(runs)]
            calls += 1
            start = time.perf_counter()
            run(x)
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def bench_shape(out_features: int, in_features: int, rows: list[int], methods: dict, reps: int, hot: bool):
    """{method: {rows: [ms, ...]}} for one weight shape."""
    copies = 1 if hot else max(2, -(-COLD_BYTES // (out_features * in_features * 4)))
    weights = [torch.randn(out_features, in_features) * in_features**-0.5 for _ in range(copies)]  # [N, K] each
    bias = torch.randn(out_features)
    results = {name: {} for name in methods}
    for name, prepare in methods.items():
        try:
            prepare(weights[0], bias)(torch.randn(1, in_features))
        except RuntimeError as exc:  # e.g. an op missing from this torch build
            print(f"# {name}: failed on {out_features}x{in_features} ({str(exc)[:120]})")
            results.pop(name)
    prepared = {name: [methods[name](w, bias) for w in weights] for name in results}
    with torch.inference_mode():
        for num_rows in rows:
            x = torch.randn(num_rows, in_features)  # [M, K]
            for name, samples in time_methods(prepared, x, reps).items():
                results[name][num_rows] = samples
    return results


def format_table(title: str, results: dict, rows: list[int], show_min: bool) -> str:
    header = f"| {title} | " + " | ".join(f"{r} rows" for r in rows) + " | 8/1 |"
    lines = [header, "|" + "---|" * (len(rows) + 2)]
    for name, per_rows in results.items():
        cells = []
        for r in rows:
            median = statistics.median(per_rows[r])
            cells.append(f"{median:.2f} ({min(per_rows[r]):.2f})" if show_min else f"{median:.2f}")
        ratio = ""
        if 1 in per_rows and 8 in per_rows:
            ratio = f"{statistics.median(per_rows[8]) / statistics.median(per_rows[1]):.2f}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


# Qwen2.5-Coder shapes (config.json of the released models) for a random-weight native forward
FORWARD_CONFIGS = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
}


def random_native_target(config_name: str):
    """A native Qwen2 target with the named model's shapes and random weights (nothing downloaded)."""
    from transformers import AutoConfig

    from specdec.models.llama import LlamaModel, NativeTarget, rope_inv_freq

    cfg = AutoConfig.for_model(
        "qwen2", vocab_size=151936, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True, **FORWARD_CONFIGS[config_name],
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model.lm_head.weight = model.model.embed_tokens.weight
    inv_freq, model.attention_scaling = rope_inv_freq(cfg)
    model.inv_freq = inv_freq
    return NativeTarget(model, tokenizer=None, name=f"random-{config_name}")


def bench_forward(config_name: str, rows: list[int], backends: list[str], reps: int, prefix_len: int = 64) -> dict:
    """{backend: {k: [ms, ...]}}: one target forward over k new tokens after a fixed prefix."""
    from specdec.kernels import FastLinear, fast_linear_modules, make_backend

    target = random_native_target(config_name)
    fast_linear_modules(target.model, backend="torch")
    linears = [module for module in target.model.modules() if isinstance(module, FastLinear)]
    # one instance per backend for the whole run (int8 quantises each weight once, at first use)
    instances = {name: make_backend(name).backend for name in backends}
    cache = target.new_cache(1, prefix_len + max(rows) + 1)
    tokens = torch.randint(0, target.vocab_size, (1, prefix_len + max(rows)))  # [1, P + k]
    target.forward(tokens[:, :prefix_len], torch.arange(prefix_len)[None], cache)
    results = {name: {k: [] for k in rows} for name in backends}
    for rep in range(reps + 1):  # rep 0 warms up every backend / row count
        for name in backends:
            for module in linears:
                module.backend = instances[name]
            for k in rows:
                positions = torch.arange(prefix_len, prefix_len + k)[None]  # [1, k]
                start = time.perf_counter()
                target.forward(tokens[:, prefix_len : prefix_len + k], positions, cache)
                elapsed = (time.perf_counter() - start) * 1e3
                cache.truncate(prefix_len)
                if rep:
                    results[name][k].append(elapsed)
    return results


def perplexity_by_backend(model_name: str, backends: list[str], max_tokens: int = 1024) -> dict[str, tuple]:
    """{backend: (perplexity, top-1 agreement with the first backend)} for `model_name` (a registry
    name, e.g. smollm2-135m) on a fixed text.

    The text is the source of Python's `textwrap` module (code, fixed for a Python version)."""
    import inspect
    import math
    import textwrap

    from specdec import load_target
    from specdec.kernels import fast_linear_modules

    target = load_target(model_name, progress=False)
    ids = target.tokenizer(inspect.getsource(textwrap))["input_ids"][:max_tokens]
    tokens = torch.tensor([ids])  # [1, T]
    results, reference_argmax = {}, None
    for name in backends:
        fast_linear_modules(target.model, backend=name)
        logits, _ = target.forward(tokens, torch.arange(len(ids))[None], target.new_cache(1, len(ids)))  # [1, T, V]
        nll = F.cross_entropy(logits[0, :-1].double(), tokens[0, 1:])
        argmax = logits[0].argmax(-1)  # [T]
        reference_argmax = argmax if reference_argmax is None else reference_argmax
        agreement = float((argmax == reference_argmax).float().mean())
        results[name] = (math.exp(float(nll)), agreement)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes", default="default", help="'default', 'model', or e.g. '8960x1536,896x896' ([out]x[in])"
    )
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--methods", default="", help="comma list (default: all that run here)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--hot", action="store_true", help="reuse one weight copy (cache-resident)")
    parser.add_argument("--min", action="store_true", help="also print the minimum: 'median (min)'")
    parser.add_argument("--forward", choices=sorted(FORWARD_CONFIGS), help="time whole native forwards instead")
    parser.add_argument("--perplexity", metavar="MODEL", help="perplexity per backend (torch,cpp,int8) on a fixed text")
    args = parser.parse_args(argv)
    if args.perplexity:
        backends = args.methods.split(",") if args.methods else ["torch", "cpp", "int8"]
        for name, (value, agreement) in perplexity_by_backend(args.perplexity, backends).items():
            print(f"{args.perplexity} {name}: perplexity {value:.4f}, argmax = {backends[0]}'s at {agreement:.1%}")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    if args.forward:
        backends = args.methods.split(",") if args.methods else ["torch", "cpp"]
        results = bench_forward(args.forward, rows, backends, args.reps)
        print(f"# native forward over k new tokens (64-token prefix), {args.forward} random weights, "
              f"{torch.get_num_threads()} threads, median{' (min)' if args.min else ''} ms of {args.reps} reps\n")
        print(format_table(f"forward {args.forward}", results, rows, args.min))
        return

    named = {"default": DEFAULT_SHAPES, "model": MODEL_SHAPES}
    if args.shapes in named:
        shapes = named[args.shapes]
    else:
        try:
            shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
        except ValueError:
            raise SystemExit(f"--shapes: expected 'default', 'model' or OUTxIN[,OUTxIN...], got {args.shapes!r}")
    methods = method_table()
    if args.methods:
        wanted = args.methods.split(",")
        unknown = [m for m in wanted if m not in methods]
        if unknown:
            raise SystemExit(f"--methods: {unknown} not available here; choose from {sorted(methods)}")
        methods = {m: methods[m] for m in wanted}
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY')}, {'hot' if args.hot else 'cold'} weights, median"
        f"{' (min)' if args.min else ''} ms of {args.reps} reps"
    )
    for shape in shapes:
        results = bench_shape(shape[0], shape[1], rows, methods, args.reps, args.hot)
        print()
        print(format_table(f"{shape[0]}x{shape[1]}", results, rows, args.min), flush=True)


if __name__ == "__main__":
    main()
