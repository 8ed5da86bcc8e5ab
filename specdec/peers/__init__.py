"""Other inference engines beside the project: each in a virtualenv of its own under the cache.

    specdec peers                  list the engines, their pinned versions and where they are
    specdec peers install vllm     create vLLM's virtualenv (about 1 GB, network + pip)

An engine whose requirements conflict with the project's (vLLM pins `transformers<5.20`) cannot
share its environment: `install` (`peers/envs.py`) creates `$SPECDEC_CACHE/peers/<name>-<version>/`,
pip-installs the pinned packages, applies the engine's fixes, checks that it imports, and writes
the marker last (a killed install has none and is redone). The bench drives an installed engine
through its own interface in its own process (`bench/vllm_peer.py`, `peers/vllm_worker.py`).
"""

from .envs import ENGINES, EngineEnv, engine_env, installed_python

__all__ = ["ENGINES", "EngineEnv", "engine_env", "installed_python"]
