"""specdec: lossless speculative decoding (drafters, verification, benchmarks, serving)."""

import os

# Must precede the first torch import: OpenMP spin-waiting makes every skinny matmul ~16 ms slower here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .api import generate, generate_batch, load_target, stream  # noqa: E402
from .drafters import make_drafter  # noqa: E402
from .loop import Generation  # noqa: E402
from .sampling import SamplingParams  # noqa: E402
from .stats import SpecStats  # noqa: E402

__all__ = ["Generation", "SamplingParams", "SpecStats", "generate", "generate_batch", "load_target", "make_drafter", "stream"]
