"""One prepared check for a lent GPU (run by benchmarks/gpu/gpu_check.sh), dry-runnable on the CPU.

1. Attention backends agree: the tiny test checkpoint (float32, and bfloat16) through the
   Triton kernels (paged attention, linear layers, lm_head) and through the torch path (SDPA,
   cuBLAS): the same greedy tokens, logprobs within 1e-4 (float32); with Triton, each
   request alone bit for bit as in its batch.
2. Speed on a model's shape with dummy weights (`--load-format dummy`, no checkpoint): an
   8B Llama shape (hidden 4096, 32 layers, 32 / 8 heads, MLP 14336, vocab 128256) in
   bfloat16 by default: the median decode step at 1, 16 and 64 rows x 2,048 context against
   the time to read the weights and that KV once at the copy bandwidth measured here, output
   tokens per second without and with top-5 logprobs, and a 4,096-token prefill chunk's
   TFLOP/s against a bare 8192^3 bfloat16 product's (the Triton backend by default).
3. On a GPU, the KV cache sized by the profiling step (--gpu-memory-utilization 0.9): what
   it found, and the peak of 64 rows decoding over that cache against the share.

Writes gpu_check.json and prints a table.

    python benchmarks/gpu/gpu_check.py --device cuda --out $OUT          # on the GPU
    python benchmarks/gpu/gpu_check.py --device cpu --shape tiny --backends sdpa --rows 1,4 \
        --context 64 --prefill 128   # dry run
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from tokenmill.cli.make_model import build_checkpoint
from tokenmill.offline.engine import OfflineEngine, OfflineRequest
from tokenmill.tp_worker.config import RunnerConfig
from tokenmill.tp_worker.model_runner import ModelRunner

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
    p.add_argument("--backends", default="triton,sdpa", help="attention backends, comma list")
    p.add_argument(
        "--speed-backends",
        default="triton",
        help="backends timed on the model's shape (triton: the torch path's linear layers in "
        "32-row blocks take minutes over 64 x 2,048 prompt tokens)",
    )
    p.add_argument("--rows", default="64,16,1", help="decode batch sizes, comma list")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prefill", type=int, default=4096, help="prefill chunk timed (tokens)")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed")
    p.add_argument("--out", type=Path, default=Path("."))
    return p.parse_args()


def engine(
    model: Path,
    args: argparse.Namespace,
    backend: str,
    prefix_cache: bool = True,
    **overrides: object,
) -> OfflineEngine:
    rows = max(int(r) for r in args.rows.split(","))
    length = max(args.context, args.prefill) + args.steps + 64
    settings: dict = {
        "model": str(model), "kv_cache_tokens": rows * length,
        "max_running_requests": rows, "max_model_len": length, "dtype": args.dtype,
        "device": args.device, "attention_backend": backend, "cpu_kernels": False,
    }  # fmt: skip
    settings.update(overrides)
    runner = ModelRunner(RunnerConfig(**settings))
    chunk = max(args.prefill, 8192)
    return OfflineEngine(runner, max_prefill_tokens=chunk, enable_prefix_cache=prefix_cache)


def agreement(tiny: Path, args: argparse.Namespace, backends: list[str]) -> dict:
    prompts = [list(range(20, 60)), list(range(100, 107)), list(range(20, 45)) + [9, 8, 7]]
    report: dict = {}
    for dtype in ("float32", "bfloat16"):
        outs = {}
        for backend in backends:
            e = engine(tiny, args, backend, dtype=dtype, kv_cache_tokens=4096, max_model_len=512)
            batch = e.generate([OfflineRequest(p, max_tokens=8, num_top=3) for p in prompts])
            alone = [e.generate([OfflineRequest(p, max_tokens=8, num_top=3)])[0] for p in prompts]
            bitwise = all(
                a.output_ids == b.output_ids and a.logprobs == b.logprobs
                for a, b in zip(batch, alone, strict=True)
            )
            outs[backend] = batch
            report[f"{backend} {dtype} alone_equals_batch_bitwise"] = bitwise
        if len(backends) > 1:
            a, b = outs[backends[0]], outs[backends[1]]
            report[f"{dtype} same_tokens"] = all(
                x.output_ids == y.output_ids for x, y in zip(a, b, strict=True)
            )
            report[f"{dtype} max_logprob_diff"] = max(
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


def product_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a bare [n, n] x [n, n] product (n 8192 on a GPU)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 2 * n**3 * 10 / (time.perf_counter() - started)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Times every step an OfflineEngine runs (synchronised on a GPU): (tokens, decode-only,
    seconds) each."""

    def __init__(self, e: OfflineEngine) -> None:
        self.device = e.runner.device
        self.steps: list[tuple[int, bool, float]] = []
        inner = e.sockets.step

        def step(batch):
            sync(self.device)
            started = time.perf_counter()
            result = inner(batch)
            sync(self.device)
            decode = b"\x01" not in batch.is_prefill.data
            self.steps.append((batch.input_ids.shape[0], decode, time.perf_counter() - started))
            return result

        e.sockets.step = step


def speed(model: Path, args: argparse.Namespace, backend: str, bandwidth: float) -> dict:
    """A args.prefill-token prompt prefilled in one chunk, then the median decode step at
    each row count (with and without top-5; the second run finds its prompts cached), each
    printed as soon as it is known."""
    e = engine(model, args, backend, prefix_cache=True, load_format="dummy")
    timer = StepTimer(e)
    runner = e.runner
    gen = torch.Generator().manual_seed(0)
    top_id = min(30000, runner.model_config.vocab_size)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [torch.randint(10, top_id, (length,), generator=gen).tolist() for _ in range(n)]

    e.generate([OfflineRequest(prompts(1, 64)[0], max_tokens=4)])  # NOTE: warm-up, compiles
    result: dict = {}
    c = runner.model_config
    model_ = runner.model
    timer.steps.clear()
    e.generate([OfflineRequest(prompts(1, args.prefill)[0], max_tokens=1)])
    tokens, _, seconds = max(timer.steps, key=lambda s: s[0])
    layer_params = sum(p.numel() for p in model_.layers.parameters())
    attention = 2 * c.num_layers * c.num_heads * c.head_dim * tokens * tokens  # causal QK, PV
    result["prefill_tokens"] = tokens
    result["prefill_tflop_s"] = (2 * layer_params * tokens + attention) / seconds / 1e12
    print(f"{backend}: prefill of {tokens} tokens {result['prefill_tflop_s']:.0f} TFLOP/s",
          flush=True)  # fmt: skip
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * runner.dtype.itemsize
    weights = sum(p.numel() * p.element_size() for p in model_.parameters())
    if model_.lm_head is not model_.embed_tokens:  # NOTE: a step reads a few embedding rows
        weights -= model_.embed_tokens.weight.numel() * model_.embed_tokens.weight.element_size()
    for rows in (int(r) for r in args.rows.split(",")):
        batch = prompts(rows, args.context)
        for num_top in (0, 5):
            timer.steps.clear()
            e.generate([OfflineRequest(p, max_tokens=args.steps, num_top=num_top) for p in batch])
            decode = sorted(s for t, d, s in timer.steps if d and t == rows)
            step = decode[len(decode) // 2]
            result[f"{rows} rows top{num_top} decode_step_ms"] = 1e3 * step
            result[f"{rows} rows top{num_top} out_tok_s"] = rows / step
        bound = (weights + kv_per_token * rows * args.context) / bandwidth
        step = result[f"{rows} rows top0 decode_step_ms"] / 1e3
        top5 = result[f"{rows} rows top5 out_tok_s"] / result[f"{rows} rows top0 out_tok_s"]
        result[f"{rows} rows read_once_ms"] = 1e3 * bound
        result[f"{rows} rows bound_over_step"] = bound / step
        print(
            f"{backend}: {rows} rows x {args.context} context: decode step {1e3 * step:.2f} ms,"
            f" reading weights and KV once {1e3 * bound:.2f} ms: {bound / step:.2f} of the"
            f" bound; {rows / step:.0f} out tok/s, with top-5 x{top5:.3f}",
            flush=True,
        )
    return result


def kv_sizing(model: Path, args: argparse.Namespace) -> dict:
    """The KV cache sized by the profiling step (--gpu-memory-utilization 0.9, the default):
    what it found, then the peak of a 64-row decode over that cache against the share."""
    gc.collect()
    torch.cuda.empty_cache()
    rows, length = 64, args.context + args.steps + 64
    e = engine(
        model, args, "triton", load_format="dummy", kv_cache_tokens=0, max_running_requests=rows,
        max_model_len=length, profile_tokens=max(args.prefill, 8192),  # engine()'s chunk
    )  # fmt: skip
    budget = e.runner.kv_budget
    assert budget is not None, "the runner did not profile"
    print(f"KV sizing: {budget.describe()}", flush=True)
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, 30000, (rows, args.context), generator=gen).tolist()
    e.generate([OfflineRequest(p, max_tokens=8, num_top=5) for p in prompts])
    peak = torch.cuda.max_memory_allocated() + budget.use.outside_torch
    share = budget.utilization * budget.use.total
    print(f"KV sizing: {rows} rows x {args.context}: peak {peak / 2**30:.1f} GiB of the "
          f"{share / 2**30:.1f} GiB share", flush=True)  # fmt: skip
    return {"kv_tokens": budget.kv_tokens, "describe": budget.describe(), "peak": peak,
            "share": share}  # fmt: skip


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
    rate = product_rate(device, getattr(torch, args.dtype))
    report["copy_bandwidth_gb_s"] = bandwidth / 1e9
    report["product_tflop_s"] = rate / 1e12
    print(f"copy {bandwidth / 1e9:.0f} GB/s, {args.dtype} product {rate / 1e12:.0f} TFLOP/s")
    for backend in args.speed_backends.split(","):
        r = speed(model, args, backend, bandwidth)
        r["prefill_over_product"] = r["prefill_tflop_s"] * 1e12 / rate
        report[backend] = r
        print(f"{backend}: prefill = {r['prefill_over_product']:.2f} of the bare product's")
    if device.type == "cuda":  # NOTE: the CPU sizes its cache from free memory, unprofiled
        report["kv_sizing"] = kv_sizing(model, args)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
