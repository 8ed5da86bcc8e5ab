"""Where a serving step's time goes: SpecBatch.step's parts, timed in-process, per configuration.

    python scripts/step_breakdown.py --drafter dspark --drafter-arg checkpoint=DIR --configs plain,auto,plain,auto --users 8

Runs the load_bench prompts (`--requests-per-user` each, greedy) through one SpecBatch the way the
server does (a request joins as soon as a row is free) and prints ms per step of: the target
forward (prefills included), the proposals (the block forward inside them, for DFlash / DSpark),
the drafter's absorb of the target's rows, verification, the policy's plan / cut / observe;
and checks that every configuration's outputs equal the first one's. Configurations run one after
the other in this process (list one twice for A B A B on a busy machine). HTTP is left out: this is
the step itself, `scripts/load_bench.py` measures the server.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

# this checkout's specdec (not whichever one the environment installed), and load_bench's prompts
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from load_bench import PROMPTS  # noqa: E402


class Timers:
    """Wraps named callables so each call adds its wall time to one total (nested parts included)."""

    def __init__(self):
        self.ms = collections.defaultdict(float)
        self.calls = collections.Counter()
        self._originals = []

    def wrap(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.ms[name] += 1000.0 * (time.perf_counter() - start)
                self.calls[name] += 1

        self._originals.append((owner, attribute, original, attribute in vars(owner)))
        setattr(owner, attribute, timed)

    def restore(self) -> None:
        for owner, attribute, original, own in reversed(self._originals):
            if own:
                setattr(owner, attribute, original)
            else:  # a method found on the class: drop the instance's wrapper
                delattr(owner, attribute)
        self._originals.clear()


def run_config(target, drafter, config: str, users: int, requests_per_user: int, max_tokens: int):
    import specdec.drafters.dflash as dflash
    import specdec.loop as loop
    from specdec.budget import budget_policy_for
    from specdec.sampling import SamplingParams

    policy = budget_policy_for(target, None if config == "plain" else drafter, None if config == "plain" else config)
    batch = loop.SpecBatch(target, None if config == "plain" else drafter, policy, max_batch=users, max_len=1024)
    timers = Timers()
    timers.wrap(target, "forward", "target forward")
    timers.wrap(loop, "_propose", "propose")
    timers.wrap(dflash.DFlashRunner, "block_rows", "  block forward (in propose)")
    # absorbing the target's rows: at the next block (catch_up), or every step in on_verified (absorb, before issue 17)
    absorb = "catch_up" if hasattr(dflash.DFlashRunner, "catch_up") else "absorb"
    timers.wrap(dflash.DFlashRunner, absorb, f"  absorb target rows ({absorb})")
    timers.wrap(loop, "_verify", "verify")
    timers.wrap(dflash.DFlashDrafter, "on_verified", "drafter.on_verified")
    for name in ("plan", "verify_prefixes", "observe"):
        timers.wrap(policy, name, f"policy.{name}")
    waiting = [target.encode_prompt(PROMPTS[(user * requests_per_user + turn) % len(PROMPTS)])
               for turn in range(requests_per_user) for user in range(users)]
    seqs, steps = [], 0
    start = time.perf_counter()
    try:
        while waiting or batch.seqs:
            room = users - len(batch.seqs)
            if room and waiting:
                joining, waiting = waiting[:room], waiting[room:]
                seqs += batch.add(joining, [SamplingParams()] * len(joining), [max_tokens] * len(joining), [()] * len(joining))
            batch.step()
            steps += 1
    finally:
        timers.restore()
    total_ms = 1000.0 * (time.perf_counter() - start)
    tokens = sum(seq.generated for seq in seqs)
    verified = sum(seq.stats.drafted_tokens for seq in seqs)
    accepted = sum(seq.stats.accepted_tokens for seq in seqs)
    blocks = timers.calls["  block forward (in propose)"]
    print(f"{config}: {steps} steps, {tokens} tokens, {1000.0 * tokens / total_ms:.1f} tokens/s, "
          f"{total_ms / steps:.1f} ms/step; {blocks} blocks drafted, {verified} positions verified, {accepted} accepted")
    for name in timers.ms:
        print(f"    {name:36s} {timers.ms[name] / steps:8.2f} ms/step  ({timers.calls[name]} calls)")
    return [seq.ctx.output_tokens for seq in seqs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", default="dspark")
    parser.add_argument("--drafter-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--configs", default="plain,auto", help="comma list of plain, auto, or a fixed gamma")
    parser.add_argument("--users", type=int, default=4, help="rows of the batch (concurrent requests)")
    parser.add_argument("--requests-per-user", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.users < 1 or args.requests_per_user < 1 or args.max_tokens < 1:
        parser.error("--users, --requests-per-user and --max-tokens must be >= 1")
    from specdec.api import load_target
    from specdec.budget import parse_gamma
    from specdec.drafters.base import drafter_options, make_drafter

    configs = [c for c in args.configs.split(",") if c]
    for config in configs:
        if config != "plain":
            try:
                parse_gamma(config)
            except ValueError as error:
                parser.error(f"--configs: {error}")
    target = load_target(args.model, progress=False)
    drafter = make_drafter(args.drafter, target, **drafter_options(args.drafter, args.drafter_arg))
    reference = None
    for config in configs:
        outputs = run_config(target, drafter, config, args.users, args.requests_per_user, args.max_tokens)
        reference = outputs if reference is None else reference
        if outputs != reference:
            print(f"{config}: outputs differ from {configs[0]}'s", file=sys.stderr)
            return 1
    print(f"every configuration's outputs equal {configs[0]}'s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
