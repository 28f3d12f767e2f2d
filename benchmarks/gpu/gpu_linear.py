"""The Triton linear kernel against cuBLAS on a lent GPU, to try tile shapes (gpu_accept.py
checks the defaults):
an 8B Llama's weights in bfloat16 (qkv, o, gate_up, down, lm_head) at 1, 16, 64 and 4,096
rows. For each: time and the rate it reads the weight at (small rows: a decode step is a
read of the weights) or its TFLOP/s (4,096 rows: a prefill chunk), and whether row 0 has the
same bits alone as in the batch of 64 (cuBLAS: often not; Triton: must). Tile shapes other
than tile_config's can be tried with --configs.

    python benchmarks/gpu/gpu_linear.py [--configs 64x64x64x4x3,128x128x64x8x3]
    TRITON_INTERPRET=1 python benchmarks/gpu/gpu_linear.py --device cpu --tiny   # dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.tp_worker.cuda.linear import TileConfig, tile_config, triton_linear

SHAPES = {  # name: (out_features, in_features), an 8B Llama at TP=1
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
ROWS = (1, 16, 64, 4096)


def timed(fn, cuda: bool, repeat: int = 20) -> float:
    """Seconds per call, the median of `repeat` after warm-up (CUDA events on a GPU)."""
    for _ in range(3 if cuda else 1):
        fn()
    times = []
    for _ in range(repeat if cuda else 1):
        if not cuda:
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def parse_config(text: str) -> TileConfig:
    return TileConfig(*(int(v) for v in text.split("x")))


def one_weight(
    name: str, n: int, k: int, extra: list[TileConfig], device: torch.device, rows_list: tuple
) -> dict:
    """Every kernel kind on one weight [n, k]."""
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=g) * 0.02
    x = torch.randn(max(rows_list), k, device=device, dtype=dtype, generator=g)
    lm = name == "lm_head"  # NOTE: float32 logits: cuBLAS's rounded bfloat16, ours unrounded
    kinds: dict[str, TileConfig | None] = {"cublas": None, "triton": tile_config(n, k, dtype)}
    kinds.update({f"triton {c.block_m}x{c.block_n}x{c.block_k}": c for c in extra})
    report = {}
    for kind, cfg in kinds.items():

        def run(rows: int, cfg: TileConfig | None = cfg) -> torch.Tensor:
            if cfg is None:
                y = F.linear(x[:rows], w)
                return y.float() if lm else y
            return triton_linear(x[:rows], w, None, torch.float32 if lm else None, cfg)

        row: dict = {}
        for rows in rows_list:
            seconds = timed(lambda rows=rows: run(rows), device.type == "cuda")
            row[rows] = {
                "ms": 1e3 * seconds,
                "weight_gb_s": n * k * 2 / seconds / 1e9,
                "tflop_s": 2 * rows * n * k / seconds / 1e12,
            }
        row["row0_alone_equals_batch"] = bool(torch.equal(run(1)[0], run(64)[0]))
        if cfg is not None and not lm:  # NOTE: one rounding, to nearest even, from float32
            wide = triton_linear(x[:64], w, None, torch.float32, cfg)
            row["rounded_once"] = bool(torch.equal(run(64), wide.to(dtype)))
        report[f"{name} {kind}"] = row
        print(
            f"{name:8} {kind:22}"
            + "".join(
                f" {r}: {row[r]['ms']:.3f} ms ({row[r]['weight_gb_s']:.0f} GB/s,"
                f" {row[r]['tflop_s']:.0f} TF)"
                for r in rows_list
            )
            + f"  alone=batch {row['row0_alone_equals_batch']}"
            + f" rounded once {row.get('rounded_once', '-')}",
            flush=True,
        )
    return report


def sampler_rows_alone(device: torch.device, vocab: int) -> dict:
    """The torch path's log-softmax statistics, top-k, argmax and seeded sampling on a
    vocabulary of `vocab`: row 0 alone against row 0 of a batch of 64, bit for bit."""
    from tokenmill.tp_worker.sample.logprobs import LogSoftmax
    from tokenmill.tp_worker.sample.sampling import SamplingTensors, greedy_ids, sample

    g = torch.Generator(device=device).manual_seed(1)
    logits = 4 * torch.randn(64, vocab, device=device, generator=g)

    def params(rows: int) -> SamplingTensors:
        return SamplingTensors(
            temperature=torch.full((rows,), 0.8, device=device),
            top_k=torch.zeros(rows, dtype=torch.int64, device=device),
            top_p=torch.full((rows,), 0.9, device=device),
            min_p=torch.zeros(rows, device=device),
            seed=torch.arange(rows, device=device) + 7,
        )

    def all_of(rows: int) -> list[torch.Tensor]:
        x = logits[:rows]
        stats = LogSoftmax.of(x, False)
        top = torch.topk(x, 20, dim=-1)
        positions = torch.full((rows,), 100, device=device)
        return [
            stats.max,
            stats.logsum,
            top.values,
            top.indices,
            greedy_ids(x),
            sample(x, params(rows), positions),
        ]

    alone, batch = all_of(1), all_of(64)
    names = ("max", "logsum", "topk values", "topk ids", "argmax", "seeded sample")
    report = {n: bool(torch.equal(a[0], b[0])) for n, a, b in zip(names, alone, batch, strict=True)}
    print(f"sampler at vocab {vocab}, row alone = in a batch of 64: {report}", flush=True)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="", help="extra tile shapes MxNxKxWARPSxSTAGES")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="shapes / 64, rows up to 128: dry run")
    args = p.parse_args()
    extra = [parse_config(c) for c in args.configs.split(",") if c]
    device = torch.device(args.device)
    rows_list = (1, 16, 64, 128) if args.tiny else ROWS
    report: dict = {"sampler": sampler_rows_alone(device, 1000 if args.tiny else 128256)}
    for name, (n, k) in SHAPES.items():
        if args.tiny:
            n, k = n // 64, k // 64
        report.update(one_weight(name, n, k, extra, device, rows_list))
    (args.out / "gpu_linear.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
