"""Old-vs-new kernel: the GGUF linears of two builds give bitwise the same outputs.

A kernel change that is meant to be faster only (docs/performance.md, rule 4) must leave every
output bit as it was. This builds the kernel from another git ref's csrc (default `main`) next to
this checkout's, for each instruction set, and compares `sg_linear_gguf` (exact mode) and
`sg_linear_gguf_a8` on random inputs: every format, rows 1..16 (and a prefill-sized 100), 1 and 2
threads, shapes with edge tiles and several K chunks:

    python scripts/kernel_ab_bits.py                       # main vs this checkout, avx512 and avx2
    python scripts/kernel_ab_bits.py --ref HEAD~1 --isas avx2
    python scripts/kernel_ab_bits.py --old-lib A.so --new-lib B.so

Exit status 1 and the first differing case when any output differs. (A script, not a test: it
compiles the kernel twice per ISA, minutes on a small machine.)
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's specdec
from kernel_instructions import FORMATS, call_linear, synthetic_blocks  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHAPES = ((1536, 1536), (67, 512), (203, 2048))  # (N, K): full tiles; N % 4 and % 3 edges; 4 K chunks
ROWS = (*range(1, 17), 100)


def build_from_ref(ref: str, isa: str, out_dir: Path) -> Path:
    """The kernel as `ref` has it (its csrc), compiled with this checkout's flags for `isa`."""
    from specdec.kernels.build import COMMON_FLAGS, _compile, isa_build_flags, require_compiler

    source = out_dir / f"csrc-{isa}"
    source.mkdir(parents=True)
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{ref}:specdec/kernels/csrc"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    for name in names:
        text = subprocess.run(["git", "show", f"{ref}:specdec/kernels/csrc/{name}"], cwd=REPO, check=True,
                              capture_output=True).stdout  # fmt: skip
        (source / name).write_bytes(text)
    work = out_dir / f"build-{isa}"
    work.mkdir()
    flags = (*COMMON_FLAGS, *isa_build_flags(isa))
    return _compile(require_compiler(), flags, sorted(source.glob("*.cpp")), work)


def this_checkout(isa: str) -> Path:
    from specdec.kernels.build import build_library, kernel_cache_dir, require_compiler

    return build_library(require_compiler(), isa, kernel_cache_dir())


def compare(old_path: Path, new_path: Path, formats: list[str]) -> int:
    """Number of differing cases (each printed)."""
    old, new = ctypes.CDLL(str(old_path)), ctypes.CDLL(str(new_path))
    for lib in (old, new):
        if hasattr(lib, "sg_set_amx"):
            lib.sg_set_amx(0, 0)  # the VNNI / AVX2 paths (AMX has its own A/B where it exists)
    differing = 0
    rng = np.random.default_rng(0)
    for fmt in formats:
        for n, k in SHAPES:
            blocks = synthetic_blocks(fmt, n, k, seed=n + k)
            x_all = (rng.standard_normal((max(ROWS), k)) * rng.choice([0.01, 1.0, 30.0], size=(max(ROWS), 1))).astype(np.float32)
            for mode in ("exact", "a8"):
                for rows in ROWS:
                    x = np.ascontiguousarray(x_all[:rows])
                    for threads in (1, 2):
                        y_old = call_linear(old, fmt, mode, x, blocks, n, threads)
                        y_new = call_linear(new, fmt, mode, x, blocks, n, threads)
                        if not np.array_equal(y_old.view(np.uint32), y_new.view(np.uint32)):
                            bad = np.argwhere(y_old.view(np.uint32) != y_new.view(np.uint32))[0]
                            print(f"DIFFERENT {fmt} {mode} {n}x{k} rows {rows} threads {threads}: first at {tuple(bad)}")
                            differing += 1
        print(f"{fmt}: {len(SHAPES)} shapes x 2 modes x {len(ROWS)} row counts x 2 thread counts compared", flush=True)
    return differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", default="main", help="git ref whose csrc is the old kernel")
    parser.add_argument("--isas", default="avx512,avx2")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--old-lib", type=Path, help="an old build to use instead of --ref (one ISA)")
    parser.add_argument("--new-lib", type=Path, help="a new build to use instead of this checkout's (one ISA)")
    args = parser.parse_args()
    formats = args.formats.split(",")
    differing = 0
    with tempfile.TemporaryDirectory() as tmp:
        for isa in args.isas.split(","):
            old_path = args.old_lib or build_from_ref(args.ref, isa, Path(tmp))
            new_path = args.new_lib or this_checkout(isa)
            label = "given libraries" if args.old_lib or args.new_lib else isa
            print(f"{label}: old {old_path}  new {new_path}", flush=True)
            differing += compare(old_path, new_path, formats)
            if args.old_lib or args.new_lib:
                break
    print("bitwise equal" if differing == 0 else f"{differing} cases differ")
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
