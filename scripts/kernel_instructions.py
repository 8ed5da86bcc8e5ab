"""Instruction counts of the kernel's GGUF linears per row count (repeatable on a loaded machine).

Each case runs one `sg_linear_gguf` / `sg_linear_gguf_a8` call (1 thread) on synthetic blocks of a
format under `valgrind --tool=callgrind`, counting only the instructions of the call's work
(`--toggle-collect` on the tile walk and the activation quantization), and prints the total and the cost of every row past the first:

    python scripts/kernel_instructions.py --isa avx512 --formats q4_k,q6_k --rows 1,4,8 --shape 1536x1536
    python scripts/kernel_instructions.py --lib /tmp/old/skinny_gemm.so ...   # another build

`--functions` adds callgrind_annotate's per-function split of the last row count (tiles, the
activation quantization, the decode-once scratch). The child process (`--call`) imports only
numpy and ctypes, so valgrind does not run torch's import.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# ggml type id, block weights, block bytes, byte offsets of the fp16 scales in a block
FORMATS = {
    "q4_0": (2, 32, 18, (0,)),
    "q4_1": (3, 32, 20, (0, 2)),
    "q5_0": (6, 32, 22, (0,)),
    "q8_0": (8, 32, 34, (0,)),
    "q4_k": (12, 256, 144, (0, 2)),
    "q5_k": (13, 256, 176, (0, 2)),
    "q6_k": (14, 256, 210, (208,)),
}


def synthetic_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, k / block * bytes] uint8: random quants with small finite fp16 scales (no inf / NaN)."""
    _, block, nbytes, scale_offsets = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    for offset in scale_offsets:
        scales = (rng.random((n, k // block)) * 0.01 + 1e-4).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def call_linear(lib: ctypes.CDLL, fmt: str, mode: str, x: np.ndarray, blocks: np.ndarray, n: int, threads: int) -> np.ndarray:
    """y [rows, n] of one kernel call; x [rows, k] fp32."""
    fn = lib.sg_linear_gguf_a8 if mode == "a8" else lib.sg_linear_gguf
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    y = np.empty((x.shape[0], n), dtype=np.float32)
    status = fn(x.ctypes.data, x.shape[0], x.shape[1], blocks.ctypes.data, n, FORMATS[fmt][0], None, y.ctypes.data, threads)
    if status != 0:
        raise RuntimeError(f"kernel call failed ({fmt}, {mode}, status {status})")
    return y


def child(lib_path: str, fmt: str, mode: str, rows: int, n: int, k: int) -> None:
    lib = ctypes.CDLL(lib_path)
    blocks = synthetic_blocks(fmt, n, k)
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    if hasattr(lib, "sg_set_amx"):
        lib.sg_set_amx(0, 0)  # the VNNI / AVX2 paths (this count is about CPUs without tiles)
    call_linear(lib, fmt, mode, x, blocks, n, 1)


def count(lib_path: str, fmt: str, mode: str, rows: int, n: int, k: int, functions: bool) -> tuple[int, str]:
    """Instructions inside the kernel call (callgrind), and the per-function table if asked."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--collect-atstart=no",
                   "--toggle-collect=*sg::run_tiles<*", "--toggle-collect=*quantize_a8_row*", sys.executable, __file__, "--call", lib_path, fmt, mode,
                   str(rows), str(n), str(k)]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True)
        summary = next(line for line in out.read_text().splitlines() if line.startswith(("summary:", "totals:")))
        total = int(summary.split()[1])
        table = ""
        if functions:
            annotate = subprocess.run(["callgrind_annotate", "--inclusive=no", str(out)], capture_output=True, text=True)
            table = "\n".join(line for line in annotate.stdout.splitlines() if re.match(r"^\s*[\d,]+ \(", line))
        return total, table


def library_for(isa: str) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's specdec
    from specdec.kernels.build import build_library, kernel_cache_dir, require_compiler

    return str(build_library(require_compiler(), isa, kernel_cache_dir()))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--call":
        lib_path, fmt, mode, rows, n, k = sys.argv[2:8]
        child(lib_path, fmt, mode, int(rows), int(n), int(k))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", default=os.environ.get("SPECDEC_KERNEL_ISA", "avx512"))
    parser.add_argument("--lib", help="a built kernel library (default: this checkout's build for --isa)")
    parser.add_argument("--formats", default="q4_k,q6_k,q8_0,q4_1")
    parser.add_argument("--modes", default="a8,exact")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--shape", default="1536x1536", help="NxK (output features x input features)")
    parser.add_argument("--functions", action="store_true", help="per-function split of the last row count")
    args = parser.parse_args()
    lib_path = args.lib or library_for(args.isa)
    n, k = (int(v) for v in args.shape.split("x"))
    rows = [int(r) for r in args.rows.split(",")]
    print(f"library {lib_path}, shape {n}x{k}, 1 thread; instructions inside the call")
    for fmt in args.formats.split(","):
        for mode in args.modes.split(","):
            totals = {}
            for r in rows:
                totals[r], table = count(lib_path, fmt, mode, r, n, k, args.functions and r == rows[-1])
            per_row = "  ".join(f"{r}: {totals[r] / 1e6:.2f}M" for r in rows)
            extra = "  ".join(f"+{(totals[r] - totals[rows[0]]) / (r - rows[0]) / 1e6:.3f}M/row ({rows[0]}->{r})" for r in rows[1:])
            print(f"{fmt:5} {mode:5} {per_row}   {extra}", flush=True)
            if table:
                print(table)


if __name__ == "__main__":
    main()
