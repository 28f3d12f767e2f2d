"""One prepared check for a lent GPU (run by benchmarks/gpu_check.sh), dry-runnable on the CPU.

1. Attention backends agree: the tiny test checkpoint (float32) through the Triton paged
   attention and through the torch SDPA path: the same greedy tokens, logprobs within 1e-4;
   with Triton, each request alone bit for bit as in its batch.
2. Speed on a model's shape with dummy weights (`--load-format dummy`, no checkpoint): an
   8B Llama shape (hidden 4096, 32 layers, 32 / 8 heads, MLP 14336, vocab 128256) in
   bfloat16 by default: the mean decode step at 64 rows x ~1,024 context, against the time
   to read the weights and that KV once at the copy bandwidth measured here, and output
   tokens per second without and with top-5 logprobs; for each attention backend.

Writes gpu_check.json and prints a table.

    python benchmarks/gpu_check.py --device cuda --out $OUT          # on the GPU
    python benchmarks/gpu_check.py --device cpu --shape tiny --backends sdpa   # dry run
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from tokenmill.cli.make_model import build_checkpoint
from tokenmill.tp_worker.config import RunnerConfig
from tokenmill.tp_worker.model_runner import ModelRunner
from tokenmill.tp_worker.offline import OfflineEngine, OfflineRequest

SHAPES = {
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256},
    "tiny": {},  # the tiny checkpoint's own shape, for dry runs
}  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shape", choices=SHAPES, default="8b")
    p.add_argument("--backends", default="sdpa,triton", help="attention backends, comma list")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--out", type=Path, default=Path("."))
    return p.parse_args()


def engine(
    model: Path,
    args: argparse.Namespace,
    backend: str,
    prefix_cache: bool = True,
    **overrides: object,
) -> OfflineEngine:
    length = args.context + args.steps + 64
    settings: dict = {
        "model": str(model), "kv_cache_tokens": args.rows * length,
        "max_running_requests": args.rows, "max_model_len": length, "dtype": args.dtype,
        "device": args.device, "attention_backend": backend, "cpu_kernels": False,
    }  # fmt: skip
    settings.update(overrides)
    runner = ModelRunner(RunnerConfig(**settings))
    return OfflineEngine(runner, max_prefill_tokens=8192, enable_prefix_cache=prefix_cache)


def agreement(tiny: Path, args: argparse.Namespace, backends: list[str]) -> dict:
    prompts = [list(range(20, 60)), list(range(100, 107)), list(range(20, 45)) + [9, 8, 7]]
    outs = {}
    for backend in backends:
        e = engine(tiny, args, backend, dtype="float32", kv_cache_tokens=4096, max_model_len=512)
        batch = e.generate([OfflineRequest(p, max_tokens=8, num_top=3) for p in prompts])
        alone = [e.generate([OfflineRequest(p, max_tokens=8, num_top=3)])[0] for p in prompts]
        bitwise = all(
            a.output_ids == b.output_ids and a.logprobs == b.logprobs
            for a, b in zip(batch, alone, strict=True)
        )
        outs[backend] = (batch, bitwise)
    report: dict = {
        name: {"alone_equals_batch_bitwise": bitwise} for name, (_, bitwise) in outs.items()
    }
    if len(backends) > 1:
        (a, _), (b, _) = outs[backends[0]], outs[backends[1]]
        report["same_tokens"] = all(x.output_ids == y.output_ids for x, y in zip(a, b, strict=True))
        report["max_logprob_diff"] = max(
            abs(p - q)
            for x, y in zip(a, b, strict=True)
            for p, q in zip(x.logprobs, y.logprobs, strict=True)
        )
    return report


def shaped_model(tiny: Path, shape: str, into: Path) -> Path:
    """The tiny checkpoint's tokenizer and config, reshaped; no weights (dummy load)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, into / name)
    config = json.loads((tiny / "config.json").read_text())
    config.update(SHAPES[shape])
    if shape != "tiny":
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    (into / "config.json").write_text(json.dumps(config, indent=2))
    return into


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (a read and a write each)."""
    size = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    started = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 2 * 10 * size / (time.perf_counter() - started)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speed(model: Path, args: argparse.Namespace, backend: str) -> dict:
    """Decode step time: (prefill + N steps) - (prefill + 1 step), over N - 1 steps."""
    e = engine(model, args, backend, prefix_cache=False, load_format="dummy")
    runner = e.runner
    gen = torch.Generator().manual_seed(0)
    top_id = min(30000, runner.model_config.vocab_size)
    prompts = [
        torch.randint(10, top_id, (args.context,), generator=gen).tolist() for _ in range(args.rows)
    ]
    e.generate([OfflineRequest(prompts[0][:64], max_tokens=4)])  # warm-up
    result: dict = {}
    for num_top in (0, 5):
        seconds = {}
        for steps in (1, args.steps):
            requests = [OfflineRequest(p, max_tokens=steps, num_top=num_top) for p in prompts]
            sync(runner.device)
            started = time.perf_counter()
            e.generate(requests)
            sync(runner.device)
            seconds[steps] = time.perf_counter() - started
        step = (seconds[args.steps] - seconds[1]) / (args.steps - 1)
        result[f"top{num_top}_decode_step_ms"] = 1e3 * step
        result[f"top{num_top}_decode_out_tok_s"] = args.rows / step
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    c = runner.model_config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * runner.dtype.itemsize
    result["weight_bytes"] = weights
    result["kv_bytes"] = per_token * args.rows * args.context
    return result


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    backends = args.backends.split(",")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    tiny = build_checkpoint(work / "tiny", "llama", "tiny")
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    }
    report["agreement"] = agreement(tiny, args, backends)
    print(json.dumps(report["agreement"], indent=2), flush=True)
    model = shaped_model(tiny, args.shape, work / f"shape-{args.shape}")
    bandwidth = copy_bandwidth(device)
    report["copy_bandwidth_gb_s"] = bandwidth / 1e9
    for backend in backends:
        r = speed(model, args, backend)
        r["read_once_ms"] = 1e3 * (r["weight_bytes"] + r["kv_bytes"]) / bandwidth
        r["step_over_read"] = r["top0_decode_step_ms"] / r["read_once_ms"]
        report[backend] = r
        print(
            f"{backend}: decode step {r['top0_decode_step_ms']:.2f} ms at {args.rows} rows x"
            f" {args.context} context = {r['step_over_read']:.2f} x the {r['read_once_ms']:.2f} ms"
            f" it takes to read the weights and KV once at {bandwidth / 1e9:.0f} GB/s;"
            f" {r['top0_decode_out_tok_s']:.0f} out tok/s, with top-5"
            f" {r['top5_decode_out_tok_s']:.0f} ("
            f"{r['top5_decode_out_tok_s'] / r['top0_decode_out_tok_s']:.3f})",
            flush=True,
        )
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
