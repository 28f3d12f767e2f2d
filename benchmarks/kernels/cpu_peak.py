"""This CPU's arithmetic peak for the instructions the kernels' inner loops run.

VDPBF16PS (bfloat16 pairs into float32: the linear layers and attention's q.k) and
VFMADD231PS (float32: attention's p.V, where the accuracy promise keeps the softmax weights
in float32), 12 independent chains a thread, and TDPBF16PS (the AMX kernels' tile products,
where the CPU has AMX) on four accumulator tiles, on 1 thread and on every thread torch
uses, best of --rounds. The ceiling against which docs/performance.md's "% of peak" figures
are read: a kernel at this rate does nothing but its arithmetic. Compiles
benchmarks/kernels/cpu_peak.cpp with the kernels' compiler and -march=native (needs AVX-512).

    python benchmarks/kernels/cpu_peak.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch

from tokenmill.tp_worker.cpu.kernels import _compiler

SOURCE = Path(__file__).with_name("cpu_peak.cpp")
ITERS = 20_000_000
# name: (kind, flops an instruction, rounds of 12 instructions: a tile product takes ~64x
# a vector one's time)
KINDS = {
    "VDPBF16PS (bfloat16)": (0, 64, ITERS),
    "VFMADD231PS (float32)": (1, 32, ITERS),
    "TDPBF16PS (AMX tiles)": (2, 16384, ITERS // 64),
}


def load(workdir: Path) -> ctypes.CDLL:
    target = workdir / "cpu_peak.so"
    command = [_compiler(), "-march=native", "-O3", "-fopenmp", "-shared", "-fPIC"]
    built = subprocess.run(
        [*command, str(SOURCE), "-o", str(target)], capture_output=True, text=True
    )
    if built.returncode != 0:
        raise SystemExit(f"cpu_peak.cpp did not build here (it needs AVX-512):\n{built.stderr}")
    lib = ctypes.CDLL(str(target))
    lib.tm_peak_seconds.restype = ctypes.c_double
    lib.tm_peak_seconds.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    return lib


def rates(lib: ctypes.CDLL, threads: int, rounds: int) -> dict[str, float | None]:
    """GFLOP/s of each instruction on `threads` threads, best of `rounds` (None: not built)."""
    out: dict[str, float | None] = {}
    for name, (kind, flops, iters) in KINDS.items():
        times = [lib.tm_peak_seconds(kind, threads, iters) for _ in range(rounds)]
        out[name] = None if min(times) < 0 else threads * iters * 12 * flops / min(times) / 1e9
    return out


def measure(rounds: int = 5) -> dict[str, float | None]:
    """This machine's peaks on every thread torch uses (what the kernels run on)."""
    with tempfile.TemporaryDirectory() as tmp:
        return rates(load(Path(tmp)), torch.get_num_threads(), rounds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds, best kept (default 5)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib = load(Path(tmp))
        for threads in sorted({1, torch.get_num_threads()}):
            for name, rate in rates(lib, threads, args.rounds).items():
                figure = "not in this build" if rate is None else f"{rate:8.0f} GFLOP/s"
                print(f"{threads} thread(s)  {name:<24} {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
