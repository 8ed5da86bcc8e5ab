"""Wall-clock A/B of two checkouts' kernels: `specdec profile` T(k) on one model, alternating, min per k.

Each round runs every configuration once per checkout, the checkouts' order swapped every other round,
so a slow spell of a shared machine lands on both alike; the summary keeps the minimum per k over the
rounds (the least disturbed forward) and T(4)/T(1), T(8)/T(1) of those minimums.

    git worktree add --detach /tmp/base 8d1e658
    python scripts/kernel_ab.py --out runs/ab --rounds 3 /tmp/base . --configs a8-vnni,exact-avx2

Configurations: the weights mode and the kernel's ISA switches (SPECDEC_KERNEL_AMX=0 runs the VNNI path
on a CPU with AMX; SPECDEC_KERNEL_ISA=avx2 the AVX2 build).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

CONFIGS = {
    "a8-vnni": ("gguf-a8", {"SPECDEC_KERNEL_AMX": "0"}),
    "a8-avx2": ("gguf-a8", {"SPECDEC_KERNEL_ISA": "avx2", "SPECDEC_KERNEL_AMX": "0"}),
    "a8-avx2-vnni": ("gguf-a8", {"SPECDEC_KERNEL_ISA": "avx2-vnni", "SPECDEC_KERNEL_AMX": "0"}),
    "exact-vnni": ("gguf", {"SPECDEC_KERNEL_AMX": "0"}),
    "exact-avx2": ("gguf", {"SPECDEC_KERNEL_ISA": "avx2", "SPECDEC_KERNEL_AMX": "0"}),
    "a8-amx": ("gguf-a8", {}),
    "a8-vnni-raw": ("gguf-a8", {"SPECDEC_KERNEL_AMX": "0", "SPECDEC_KERNEL_INTERLEAVE": "0"}),  # no interleaved copy
}


def profile(checkout: str, args, weights: str, env: dict) -> dict:
    """One `specdec profile --json` with the package imported from `checkout`."""
    cmd = [sys.executable, "-m", "specdec.cli", "profile", "--model", args.model, "--weights", weights,
           "--ks", args.ks, "--repeats", str(args.repeats), "--json"]
    done = subprocess.run(cmd, env={**os.environ, **env, "PYTHONPATH": checkout}, capture_output=True, text=True, cwd=checkout)
    if done.returncode:
        raise SystemExit(f"profile failed in {checkout}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    ks = runs[0]["k"]
    min_ms = [min(run["ms"][i] for run in runs) for i in range(len(ks))]
    row = {"k": ks, "min_ms": [round(ms, 2) for ms in min_ms]}
    for k in (4, 8):
        if k in ks and 1 in ks:
            row[f"T{k}/T1"] = round(min_ms[ks.index(k)] / min_ms[ks.index(1)], 3)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout_a")
    parser.add_argument("checkout_b")
    parser.add_argument("--out", required=True, help="folder for raw.json and summary.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="a8-vnni,a8-avx2,exact-vnni,exact-avx2", help=f"comma-separated of {', '.join(CONFIGS)}")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--ks", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    unknown = [name for name in configs if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration {unknown[0]!r} (choose from {', '.join(CONFIGS)})")
    checkouts = [str(pathlib.Path(c).resolve()) for c in (args.checkout_a, args.checkout_b)]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {name: {c: [] for c in checkouts} for name in configs}
    for round_index in range(args.rounds):
        for name in configs:
            weights, env = CONFIGS[name]
            for checkout in checkouts if round_index % 2 == 0 else checkouts[::-1]:
                result = profile(checkout, args, weights, env)
                runs[name][checkout].append(result)
                print(name, checkout, round_index, [round(ms, 1) for ms in result["ms"]], flush=True)
        (out / "raw.json").write_text(json.dumps(runs, indent=1))
    summary = {name: {c: summarize(runs[name][c]) for c in checkouts} for name in configs}
    for name, rows in summary.items():
        for checkout, row in rows.items():
            print(name, checkout, row)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
