"""Per-step draft cost of block drafters (DSpark, DFlash), EAGLE-3's per-depth forwards and a draft model, on one target.

Each drafter is built untrained (the cost of a forward does not depend on the weights), saved and
loaded back through its real constructor (so the draft vocabulary is the default 8192 rows of the
target's LM head, as for a trained checkpoint), and run through the loop at a fixed gamma. Untrained
drafts are rejected, so every step drafts its full budget: the loop's draft time per verify step is
the cost of one proposal (+ absorbing the step's new context rows). Plain decoding's verify time per
step in the same process gives T(1), so the costs are also reported in units of T(1).

    python scripts/draft_cost.py --model qwen2.5-coder-1.5b --max-new-tokens 24

`--small-model NAME` adds the small-model drafter (a real model: its drafts are sometimes accepted) as a
chain of --small-model-gamma tokens, once per `--draft-vocabs` size (0 = its whole vocabulary); its
cost per drafted token is one draft-model step, the number the cost model weighs against T(1). The
loop's per-step times include each generation's prefills, so the draft step is also timed alone: one
-token forwards of the draft model (with its draft vocabulary's head) and of the target, alternating:

    python scripts/draft_cost.py --model qwen2.5-coder-1.5b --weights gguf-a8 --small-model qwen2.5-coder-0.5b \
        --draft-vocabs 0,32768,8192 --eagle-depths 1 --skip-block

`--prefill N` also times the small-model drafter's catch-up of an N-token prompt (its prefill, as
drafting runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from specdec import generate, load_target, make_drafter  # first: the package sets OMP_WAIT_POLICY before torch loads
from specdec.heads import build_heads
from specdec.heads.checkpoint import save_checkpoint, target_description

import torch  # noqa: E402, I001  (after specdec, see above)

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def per_step_ms(target, drafter, max_new_tokens: int, gamma) -> dict:
    """One run after a warm-up: draft and verify milliseconds per verify step."""
    generate(target, PROMPT, drafter, max_new_tokens=4, gamma=gamma)  # warm-up (allocations, kernel builds)
    stats = generate(target, PROMPT, drafter, max_new_tokens=max_new_tokens, gamma=gamma).stats
    steps = max(1, stats.steps)
    return {"steps": stats.steps, "tau": stats.tau, "draft_ms": 1e3 * stats.time_draft_s / steps,
            "verify_ms": 1e3 * stats.time_verify_s / steps, "drafted_per_step": stats.drafted_tokens / steps}


def forward_ms(model, lm_head=None, rounds: int = 30) -> list[float]:
    """Milliseconds of `rounds` one-token forwards of `model` after a 64-token prefix (lm_head: a draft head)."""
    cache = model.new_cache(1, 64 + rounds + 1)
    model.forward(torch.arange(100, 164)[None], torch.arange(64)[None], cache, lm_head=lm_head)  # [1, 64] prefix
    times = []
    for i in range(rounds):
        start = time.perf_counter()
        model.forward(torch.tensor([[300 + i]]), torch.tensor([[64 + i]]), cache, lm_head=lm_head)
        times.append(1e3 * (time.perf_counter() - start))
    return times


def step_ratio(target, drafter, rounds: int) -> dict:
    """One draft-model forward / one target forward, 1 token each: blocks of 10 forwards alternating
    between the two models (a slow spell of a shared machine lands on both), median of each."""
    draft_times, target_times = [], []
    for _ in range(max(1, rounds // 10)):
        target_times += forward_ms(target, rounds=10)
        draft_times += forward_ms(drafter.draft_target, drafter.lm_head, rounds=10)
    draft_ms, target_ms = statistics.median(draft_times), statistics.median(target_times)
    return {"draft_forward_ms": draft_ms, "target_forward_ms": target_ms, "step_ratio": draft_ms / target_ms}


def prefill_ms(drafter, num_tokens: int, rounds: int = 3) -> float:
    """The small-model drafter's catch-up of a `num_tokens` prompt (its first sync, as drafting
    runs it: the LM head on the last row only), minimum over `rounds` fresh caches."""
    times = []
    for round_index in range(rounds):
        prompt = torch.randint(100, 20000, (num_tokens,), generator=torch.Generator().manual_seed(round_index)).tolist()
        lm = drafter._new_draft_lm(num_tokens + 1)
        start = time.perf_counter()
        lm.sync(prompt)
        times.append(1e3 * (time.perf_counter() - start))
    return min(times)


def untrained_drafter(target, kind: str, directory: str, num_positions: int, **options):
    heads = build_heads(kind, target, num_positions, **options)
    ranking = {"draft_vocab": {"ids": list(range(target.vocab_size))}}  # any ranking: only its size matters for cost
    save_checkpoint(directory, heads, target_description(target), ranking)
    return heads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default=None, choices=["gguf", "gguf-a8", "fp32"], help="the target's weights (load_target)")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--eagle-depths", default="1,4,8", help="EAGLE-3 chain lengths to time")
    parser.add_argument("--draft-weights", default="int8", choices=["int8", "fp32"],
                        help="the drafters' own linears while drafting (specdec.heads.draft_linears)")
    parser.add_argument("--small-model", default=None, help="also time the small-model drafter with this draft model")
    parser.add_argument("--small-model-gamma", type=int, default=4)
    parser.add_argument("--draft-vocabs", default="0,32768", help="small-model draft_vocab sizes to time (0 = all)")
    parser.add_argument("--step-rounds", type=int, default=40,
                        help="one-token forwards of each model for the draft step / target step ratio")
    parser.add_argument("--prefill", type=int, default=0,
                        help="also time the small-model drafter's catch-up of a prompt this long (its prefill)")
    parser.add_argument("--skip-block", action="store_true", help="leave out the DSpark / DFlash / EAGLE-3 rows")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    target = load_target(args.model, weights=args.weights, progress=False)
    rows = {}
    plain = per_step_ms(target, None, args.max_new_tokens, None)
    t1 = plain["verify_ms"]
    rows["plain"] = plain
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_block:
            block_drafter_rows(target, args, tmp, rows)
    for vocab in [int(v) for v in args.draft_vocabs.split(",")] if args.small_model else []:
        drafter = make_drafter("small-model", target, draft_model=args.small_model, tree=False,
                               gamma=args.small_model_gamma, draft_vocab=vocab)
        row = per_step_ms(target, drafter, args.max_new_tokens, args.small_model_gamma)
        rows[f"small-model vocab {vocab or 'all'}"] = {**row, **step_ratio(target, drafter, args.step_rounds)}
        if args.prefill:
            rows[f"small-model vocab {vocab or 'all'}"]["prefill_ms"] = prefill_ms(drafter, args.prefill)
        del drafter
    print(f"{args.model} ({args.weights or 'default'} weights), draft weights {args.draft_weights}: T(1) = {t1:.1f} ms (plain decoding's verify per step, this process)")
    print(f"{'config':24s} {'drafted':>8s} {'draft ms':>9s} {'/T(1)':>6s} {'per token /T(1)':>16s} {'verify ms':>10s} {'/T(1)':>6s}")
    for name, row in rows.items():
        per_token = f"{row['draft_ms'] / row['drafted_per_step'] / t1:.2f}" if row["drafted_per_step"] else "-"
        print(f"{name:24s} {row['drafted_per_step']:8.1f} {row['draft_ms']:9.1f} {row['draft_ms'] / t1:6.2f} {per_token:>16s} "
              f"{row['verify_ms']:10.1f} {row['verify_ms'] / t1:6.2f}")
    for name, row in rows.items():
        if "step_ratio" in row:
            print(f"{name}: one draft-model forward {row['draft_forward_ms']:.1f} ms / one target forward "
                  f"{row['target_forward_ms']:.1f} ms = {row['step_ratio']:.2f} (1 token each, medians, alternating)")
        if "prefill_ms" in row:
            print(f"{name}: catch-up of a {args.prefill}-token prompt {row['prefill_ms']:.0f} ms "
                  f"({row['prefill_ms'] / args.prefill:.2f} ms a token, minimum of 3)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": args.model, "t1_ms": t1, "rows": rows}, out, indent=2)
    return 0


def block_drafter_rows(target, args, tmp: str, rows: dict) -> None:
    """DSpark / DFlash blocks and EAGLE-3 chains and tree, untrained (cost does not depend on weights)."""
    for kind, positions, options in (("dspark", args.block_size, {"block_size": args.block_size}),
                                     ("dflash", args.block_size - 1, {"block_size": args.block_size})):
        directory = os.path.join(tmp, kind)
        untrained_drafter(target, kind, directory, positions, **options)
        drafter = make_drafter(kind, target, checkpoint=directory, draft_weights=args.draft_weights)
        rows[f"{kind} block {args.block_size}"] = per_step_ms(target, drafter, args.max_new_tokens, positions)
        del drafter
    directory = os.path.join(tmp, "eagle3")
    depths = [int(d) for d in args.eagle_depths.split(",")]
    untrained_drafter(target, "eagle3", directory, max(depths))
    for depth in depths:
        drafter = make_drafter("eagle3", target, checkpoint=directory, tree=False, gamma=depth,
                               draft_weights=args.draft_weights)
        rows[f"eagle3 chain {depth}"] = per_step_ms(target, drafter, args.max_new_tokens, depth)
    drafter = make_drafter("eagle3", target, checkpoint=directory, draft_weights=args.draft_weights)
    rows["eagle3 tree (default)"] = per_step_ms(target, drafter, args.max_new_tokens, None)


if __name__ == "__main__":
    raise SystemExit(main())
