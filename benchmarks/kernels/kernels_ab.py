"""Two builds of the CPU kernels, alternated round by round, each in a process of its own:
the quantized products' time with each (quantized_kernels.py's shapes: --layers products of
8,192 x 2,048 in bfloat16 at --rows rows), the median per build and B's over A's.

On a shared machine the memory's speed drifts by a third within minutes, so two runs one
after the other compare the minutes, not the builds; alternating them does not. Each build
runs in its own process because two builds loaded into one would share their static
kernel tables (GCC makes a static local of an inline function one symbol for the whole
process), so both would run the first one's kernels. A build is the library that
`python -m tokenmill.tp_worker.cpu.kernels` prints, copied aside:

    python -m tokenmill.tp_worker.cpu.kernels        # prints the library's path
    cp <that path> /tmp/a.so   # then change csrc/, build again, copy to /tmp/b.so
    python benchmarks/kernels/kernels_ab.py /tmp/a.so /tmp/b.so [--types Q4_K,Q6_K,Q8_0]
        [--rows 1] [--rounds 16]

Both builds read the panels this checkout's cpu/quantized.py writes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path


def serve(library: Path, name: str, rows: int, layers: int) -> None:
    """The child: products of `name` on `library`; a line in, one timing (ms) out."""
    import numpy as np
    import torch
    from quantized_kernels import BY_NAME, random_rows

    from tokenmill.tp_worker.cpu import kernels, quantized

    build = kernels.load(library)
    quantized.library = lambda: build  # type: ignore[assignment]
    blocks = random_rows(BY_NAME[name], np.random.default_rng(0))
    products = [quantized.QuantLinear([blocks], torch.bfloat16) for _ in range(layers)]
    x = torch.randn(rows, 2048).to(torch.bfloat16)
    print("ready", flush=True)
    for _ in sys.stdin:
        for product in products:  # NOTE: a warm pass first
            product(x)
        started = time.perf_counter()
        for product in products:
            product(x)
        print(f"{(time.perf_counter() - started) * 1e3:.4f}", flush=True)


def child(library: Path, name: str, args: argparse.Namespace) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--serve", str(library), "--types", name]
    command += ["--rows", str(args.rows), "--layers", str(args.layers)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


def timing(process: subprocess.Popen[str]) -> float:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("run\n")
    process.stdin.flush()
    return float(process.stdout.readline())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path, nargs="?", help="build A (a .so)")
    p.add_argument("b", type=Path, nargs="?", help="build B (a .so)")
    p.add_argument("--types", default="Q4_K,Q6_K,Q8_0", help="comma list of ggml type names")
    p.add_argument("--rows", type=int, default=1, help="rows of x (1)")
    p.add_argument("--layers", type=int, default=12, help="products in turn (12)")
    p.add_argument("--rounds", type=int, default=16, help="rounds, each timing both (16)")
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve is not None:
        serve(args.serve, args.types, args.rows, args.layers)
        return 0
    if args.a is None or args.b is None:
        p.error("two builds, A and B")
    print(f"bfloat16, {args.layers} x [8192, 2048], {args.rounds} rounds, alternated")
    print("| weights | rows | A ms | B ms | B / A |")
    print("|---|---|---|---|---|")
    for name in args.types.split(","):
        processes = {"A": child(args.a, name, args), "B": child(args.b, name, args)}
        times: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for key in ("A", "B") if r % 2 == 0 else ("B", "A"):
                times[key].append(timing(processes[key]))
        for process in processes.values():
            assert process.stdin is not None
            process.stdin.close()
            process.wait()
        a, b = statistics.median(times["A"]), statistics.median(times["B"])
        print(f"| {name} | {args.rows} | {a:.2f} | {b:.2f} | {b / a:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
