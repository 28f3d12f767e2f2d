"""The quantized products' speed (tp_worker/cpu/quantized.py's QuantLinear on GGUF blocks):
G weights/s and GB/s of blocks read, a product of 8,192 x 2,048 (an MLP's gate/up at
Llama-3.2-1B's width), --layers such matrices in turn so that none is in a cache, at --rows
rows (1, 4 and 16), each type beside the packed bfloat16 product of a float weight of the same
shape; the median of --rounds passes. Random blocks with float16 scales of a usual size.

    python benchmarks/kernels/quantized_kernels.py [--types Q4_K,Q6_K,Q8_0] [--dtype bfloat16]
        [--rows 1,4,16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tokenmill.tp_worker.cpu.ops import PackedLinear
from tokenmill.tp_worker.cpu.quantized import LAYOUTS, TYPE_NAMES, QuantLinear, QuantRows

ROWS, WIDTH = 8192, 2048
BY_NAME = {name: code for code, name in TYPE_NAMES.items()}


def random_rows(qtype: int, rng: np.random.Generator) -> QuantRows:
    layout = LAYOUTS[qtype]
    blocks = WIDTH // layout.block_k
    raw = rng.integers(0, 256, size=(ROWS, blocks, layout.file_bytes), dtype=np.uint8)
    scale = (rng.uniform(0.5, 2.0, size=(ROWS, blocks)) * 2.0**-8).astype(np.float16)
    at = layout.file_bytes - 2 if TYPE_NAMES[qtype] == "Q6_K" else 0  # NOTE: its d is last
    raw[..., at : at + 2] = scale.view(np.uint8).reshape(ROWS, blocks, 2)
    if layout.mins:
        raw[..., 2:4] = (scale / 2).view(np.uint8).reshape(ROWS, blocks, 2)
    return QuantRows(qtype, torch.from_numpy(raw.reshape(ROWS, -1)), WIDTH)


def seconds(products: list, x: torch.Tensor, rounds: int) -> float:
    for product in products:
        product(x)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for product in products:
            product(x)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q4_K,Q6_K,Q8_0", help="comma list of ggml type names")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--layers", type=int, default=12, help="matrices in turn (12)")
    p.add_argument("--rounds", type=int, default=10, help="passes (10)")
    p.add_argument("--rows", default="1,4,16", help="comma list of row counts (1,4,16)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(0)
    weights = ROWS * WIDTH * args.layers
    counts = [int(m) for m in args.rows.split(",")]
    print(
        f"torch threads {torch.get_num_threads()}, {args.dtype}, {args.layers} x [{ROWS}, {WIDTH}]"
    )
    print("| weights | rows | ms | G weights/s | GB/s read |")
    print("|---|---|---|---|---|")
    for name in args.types.split(","):
        rows = random_rows(BY_NAME[name], rng)
        products = [QuantLinear([rows], dtype) for _ in range(args.layers)]
        size = sum(q.nbytes() for q in products)
        for m in counts:
            t = seconds(products, torch.randn(m, WIDTH).to(dtype), args.rounds)
            print(
                f"| {name} | {m} | {t * 1e3:.2f} | {weights / t / 1e9:.1f} | {size / t / 1e9:.1f} |"
            )
        del products
    dense = [PackedLinear(torch.randn(ROWS, WIDTH).to(dtype), None) for _ in range(args.layers)]
    for m in counts:
        t = seconds(dense, torch.randn(m, WIDTH).to(dtype), args.rounds)
        size = weights * dtype.itemsize
        rates = f"{weights / t / 1e9:.1f} | {size / t / 1e9:.1f}"
        print(f"| {args.dtype} | {m} | {t * 1e3:.2f} | {rates} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
