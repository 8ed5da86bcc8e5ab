"""How much of a forward over k new tokens is its linear layers, and how much everything else.

    SPECDEC_KERNEL_AMX=0 python scripts/forward_split.py --model qwen2.5-coder-1.5b --weights gguf-a8 --ks 1,4

Times k-token forwards after a 64-token prefix as they are, then with every linear layer (GGUF
blocks or dense kernel) returning a copy of the output it gave once for that input shape: what is
left is the rest of the forward (norms, rotary, KV writes, attention, SiLU, python). Real and
stubbed forwards alternate over `--rounds`; the minimum per setting is printed. While stubbed, the
backend's calls that run several linears at once (a whole block, q / k / v, gate / up) go through the
modules one by one, so the stubs see every linear.

A lower bound for the rest: stubbed, nothing streams weights between the other ops, so they run
from warm caches; in a real forward each op follows megabytes of weights and costs several times
more (docs/performance.md, "Between the linears").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's specdec
from specdec import load_target  # noqa: E402  (first: the package sets OMP_WAIT_POLICY before torch loads)

import torch  # noqa: E402, I001


def linear_classes() -> list[type]:
    from specdec.kernels.backends import FastLinear
    from specdec.kernels.gguf_linear import GGUFLinear

    return [GGUFLinear, FastLinear, torch.nn.Linear]


def stubbed(classes: list[type]):
    """Replace each class's forward by one that returns a copy of its first output per (module, shape)."""
    outputs: dict = {}
    originals = {cls: cls.forward for cls in classes}

    def make(original):
        def forward(self, x):
            key = (id(self), tuple(x.shape))
            if key not in outputs:
                outputs[key] = original(self, x)
            return outputs[key].clone()
        return forward

    for cls, original in originals.items():
        cls.forward = make(original)
    from specdec.kernels.backends import _CompiledBackend, separate_gate_up_silu, separate_linears

    for name, one_by_one in (("run_layer", lambda self, *args: None), ("linears", lambda self, x, layers: separate_linears(x, layers)),
                             ("gate_up_silu", lambda self, x, gate, up: separate_gate_up_silu(x, gate, up))):
        originals[(_CompiledBackend, name)] = getattr(_CompiledBackend, name)
        setattr(_CompiledBackend, name, one_by_one)
    return originals


def restore(originals) -> None:
    for key, original in originals.items():
        cls, name = key if isinstance(key, tuple) else (key, "forward")
        setattr(cls, name, original)


def forward_ms(target, cache, k: int, repeats: int) -> float:
    tokens = torch.randint(0, 1000, (1, k))
    positions = torch.arange(64, 64 + k)[None]  # [1, k]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.forward(tokens, positions, cache)
        best = min(best, time.perf_counter() - start)
        cache.truncate(64)
    return 1e3 * best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default=None, choices=["gguf", "gguf-a8", "fp32"])
    parser.add_argument("--ks", default="1,4", help="new tokens per forward, comma-separated")
    parser.add_argument("--repeats", type=int, default=20, help="forwards per setting and round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    target = load_target(args.model, weights=args.weights, progress=False)
    cache = target.new_cache(1, 512)
    target.forward(torch.randint(0, 1000, (1, 64)), torch.arange(64)[None], cache)
    classes = linear_classes()
    print(f"{target.name}, weights {target.weights}, {torch.get_num_threads()} threads: min ms per forward")
    for k in (int(part) for part in args.ks.split(",")):
        real = rest = float("inf")
        for _ in range(args.rounds):
            real = min(real, forward_ms(target, cache, k, args.repeats))
            originals = stubbed(classes)
            try:
                rest = min(rest, forward_ms(target, cache, k, args.repeats))
            finally:
                restore(originals)
        print(f"k={k}: forward {real:.2f} ms, without its linears {rest:.2f} ms ({100 * rest / real:.0f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
