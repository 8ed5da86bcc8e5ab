"""The engine on an accelerator: lossless checks and the verify cost T(k), on a transformers target.

The project's suite runs on CPUs; this script is the check for a GPU (any torch device):

1. greedy lossless: tiny random Llama and Qwen2 targets (tests/conftest.py's) on `--device`, each drafter's
   output against plain greedy decoding on the same device, token for token, in float32 and bfloat16,
   and a batch of three prompts against each prompt alone;
2. sampling: the first generated token's frequencies under speculative sampling against the target's
   exact softmax (chi-square), the same statistic tests/test_sampling.py uses;
3. T(k): forward time of k new tokens after a 64-token prefix (the cost table `--gamma auto` reads) on a
   randomly initialised model of a real config (`--profile-config`: a folder holding its config.json), float32 and
   bfloat16: what verifying gamma + 1 tokens costs on this device relative to one decode step.

    python scripts/device_check.py --device cuda --profile-config MODEL_DIR --out runs/device

Prints one line per check and writes DIR/device_check.json; exits 1 when a greedy check differs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import specdec  # noqa: E402,F401  (first: it sets OMP_WAIT_POLICY before torch is imported)
import torch  # noqa: E402
from scipy.stats import chisquare  # noqa: E402

from specdec import SamplingParams, generate, generate_batch, make_drafter  # noqa: E402
from specdec.cost import measure_cost_table  # noqa: E402
from specdec.models.hf import HFTarget  # noqa: E402
from tests.conftest import make_tiny_hf_dir  # noqa: E402

PROMPTS = ([5, 6, 7, 8], [20, 21], list(range(30, 45)), [9, 9, 9, 9, 9, 9, 9, 9])
# (label, drafter name, options): chains, trees, retrieval, n-gram lookahead, a draft model
DRAFTERS = [
    ("random-chain", "random", {"gamma": 3}),
    ("random-tree", "random", {"gamma": 6, "tree": True, "branching": 2}),
    ("pld", "pld", {}),
    ("suffix", "suffix", {}),
    ("lookahead", "lookahead", {}),
    ("small-model", "small-model", {}),  # draft_target: a second tiny Llama (same tokenizer)
    ("small-model-tree", "small-model", {"tree": True}),
]


def greedy_checks(dirs: dict, kind: str, device: str, dtype: str, new_tokens: int) -> list[dict]:
    target = HFTarget.from_dir(dirs[kind], dtype=dtype, device=device)
    draft = HFTarget.from_dir(dirs["draft"], dtype=dtype, device=device)  # shares the Llama's tokenizer
    rows = []
    plain = {tuple(p): generate(target, p, max_new_tokens=new_tokens).tokens for p in PROMPTS}
    for label, name, options in DRAFTERS:
        if name == "small-model":
            if kind != "llama":
                continue
            options = {**options, "draft_target": draft}
        diffs = []
        for prompt in PROMPTS:
            spec = generate(target, prompt, make_drafter(name, target, **options), max_new_tokens=new_tokens).tokens
            reference = plain[tuple(prompt)]
            if spec != reference:
                first = next((i for i, (a, b) in enumerate(zip(spec, reference)) if a != b), min(len(spec), len(reference)))
                diffs.append({"prompt": prompt, "first_difference": first})
        rows.append({"check": "greedy", "target": kind, "dtype": dtype, "drafter": label, "prompts": len(PROMPTS), "differ": diffs})
    batch = generate_batch(target, list(PROMPTS[:3]), make_drafter("pld", target), max_new_tokens=new_tokens)
    alone_equal = [b.tokens == plain[tuple(p)] for b, p in zip(batch, PROMPTS[:3])]
    rows.append({"check": "batch of 3 = each alone", "target": kind, "dtype": dtype, "drafter": "pld", "prompts": 3,
                 "differ": [{"prompt": p} for p, ok in zip(PROMPTS[:3], alone_equal) if not ok]})
    return rows


def sampling_check(dirs: dict, device: str, runs: int) -> dict:
    """First-token frequencies of speculative sampling (a draft model that proposes from its own q)
    against the target's softmax at the prompt."""
    target = HFTarget.from_dir(dirs["llama"], dtype="float32", device=device)
    draft = HFTarget.from_dir(dirs["draft"], dtype="float32", device=device)
    prompt = [5, 6, 7, 8]
    cache = target.new_cache(1, 64)
    with torch.inference_mode():
        logits, _ = target.forward(torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device)[None], cache)
    probs = torch.softmax(logits[0, -1].float(), -1).cpu()  # [V]
    counts = torch.zeros_like(probs)
    drafter = make_drafter("small-model", target, draft_target=draft, gamma=3)
    for seed in range(runs):
        out = generate(target, prompt, drafter, max_new_tokens=2, sampling=SamplingParams(temperature=1.0, seed=seed))
        counts[out.tokens[0]] += 1
    support = probs * runs >= 5  # chi-square wants expected counts >= 5: the rest pooled into one cell
    observed = torch.cat([counts[support], counts[~support].sum()[None]])
    expected = torch.cat([probs[support], probs[~support].sum()[None]]) * runs
    pvalue = float(chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue)
    return {"check": "sampling first token vs target softmax", "runs": runs, "pvalue": pvalue}


def verify_cost(config_path: str, device: str, dtype: str, ks: list[int]) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).to(device).eval()
    target = HFTarget(model, None, name=f"random {config.model_type}", device=device)
    table = measure_cost_table(target, ks=ks, repeats=20, warmup=3, progress=False)
    del model, target
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    t1 = table.ms[0]
    return {"check": "T(k)", "dtype": dtype, "config": pathlib.Path(config_path).name, "k": table.k,
            "ms": [round(ms, 3) for ms in table.ms], "T(k)/T(1)": [round(ms / t1, 3) for ms in table.ms]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--sampling-runs", type=int, default=3000)
    parser.add_argument("--profile-config", default="", help="a folder with the config.json of a real model, for T(k) (random weights)")
    parser.add_argument("--ks", default="1,2,4,8,16,32")
    parser.add_argument("--out", default="", help="folder for device_check.json")
    args = parser.parse_args(argv)
    facts = {"device": args.device, "torch": torch.__version__,
             "name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"}
    print(json.dumps(facts), flush=True)
    rows: list[dict] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"llama": make_tiny_hf_dir(pathlib.Path(tmp) / "llama", "llama", seed=0)[0],
                "qwen2": make_tiny_hf_dir(pathlib.Path(tmp) / "qwen2", "qwen2", seed=1)[0],
                "draft": make_tiny_hf_dir(pathlib.Path(tmp) / "draft", "llama", seed=2)[0]}
        for dtype in args.dtypes.split(","):
            for row in greedy_checks(dirs, "llama", args.device, dtype, args.new_tokens) + greedy_checks(dirs, "qwen2", args.device, dtype, args.new_tokens):
                rows.append(row)
                print(json.dumps(row), flush=True)
        if args.sampling_runs:
            rows.append(sampling_check(dirs, args.device, args.sampling_runs))
            print(json.dumps(rows[-1]), flush=True)
    if args.profile_config:
        for dtype in args.dtypes.split(","):
            rows.append(verify_cost(args.profile_config, args.device, dtype, [int(k) for k in args.ks.split(",")]))
            print(json.dumps(rows[-1]), flush=True)
    facts["seconds"] = round(time.perf_counter() - start, 1)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "device_check.json").write_text(json.dumps({"facts": facts, "rows": rows}, indent=1))
    failed = [row for row in rows if row.get("differ")]
    print(f"{len(failed)} greedy check(s) differ; {facts['seconds']} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
