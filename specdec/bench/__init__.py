"""Spec-Bench-style benchmark: methods x task kinds, specdec drafters and transformers peers side by side.

A *method* is anything that turns prompt ids into output ids on the benchmark's target. Methods
are looked up by name: first in the bench registry below (`plain`, the `hf-*` peers, anything a
test or plugin registers), then among the registered specdec drafters (`make_drafter(name, ...)`).

    from specdec.bench import register_method

    @register_method("my-method")
    def my_method(target, prompt_ids, max_new_tokens, sampling):
        ...
        return tokens, stats          # stats: a SpecStats or None

Run it with `specdec bench --methods plain,my-method` or `run_benchmark(BenchConfig(...))`.

A *peer* is a method of another library (transformers, llama.cpp) registered with the
`PeerRuntime` that loads that library's copy of the target: the runner loads each runtime once,
after every specdec method is done and freed, and runs its peers on it (`peers.py`).
"""

from .methods import (
    METHODS,
    BenchMethod,
    CallableMethod,
    MethodEntry,
    MethodOutput,
    MethodUnavailable,
    PeerRuntime,
    PeerSource,
    register_method,
    register_method_factory,
    unregister_method,
)
from .cli import add_bench_arguments, run_bench
from .runner import BenchConfig, run_benchmark

__all__ = [
    "METHODS", "BenchConfig", "BenchMethod", "CallableMethod", "MethodEntry", "MethodOutput", "MethodUnavailable",
    "PeerRuntime", "PeerSource", "add_bench_arguments",
    "register_method", "register_method_factory", "run_bench", "run_benchmark", "unregister_method",
]
