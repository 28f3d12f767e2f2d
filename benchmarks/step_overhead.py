"""The share of a decode step's wall time spent outside the model forward, at batch 32.

Starts one tokenmill server with --step-timing and --max-running-requests 32, sends 32
streaming requests at once (short prompts, ignore_eos, long outputs) so that the engine
decodes a full batch of 32, and reads the step totals from /metrics before and after.
Overhead = 1 - forward / period: the controller, IPC, detokenizer and frontend, plus the
worker's own step preparation and the lm_head / sampling. Target: <= 10%.

    python benchmarks/step_overhead.py [--preset small|medium | --model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from serving import add_model_args, read_metrics, resolve_model, start_server, stop_server

from tokenmill.frontend.bench.client import BenchOptions, fetch_model_id, run_requests
from tokenmill.frontend.bench.datasets import random_requests

TARGET = 0.10
KEYS = ("decode_steps", "period_seconds", "worker_busy_seconds", "forward_seconds", "rows")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "medium")
    p.add_argument("--batch", type=int, default=32, help="decode batch (default 32)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (default 128)")
    p.add_argument("--logprobs", type=int, default=0, help="top logprobs asked (default 0)")
    p.add_argument("--device", default="auto", help="the server's --device (default auto)")
    return p.parse_args()


def timing(base_url: str) -> dict[str, float]:
    metrics = read_metrics(base_url)
    return {k: metrics[f"tokenmill_step_timing_{k}"] for k in KEYS}


async def workload(base_url: str, args: argparse.Namespace, seed: int) -> None:
    model = await fetch_model_id(base_url)
    opts = BenchOptions(base_url=base_url, model=model, logprobs=args.logprobs, ignore_eos=True)
    requests = random_requests(
        args.batch, args.input_len, args.output_len, as_text=False, vocab_size=1000, seed=seed
    )
    results, _ = await run_requests(requests, opts, "completions", max_concurrency=args.batch)
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")


def main() -> int:
    args = parse_args()
    model = resolve_model(args)
    log_path = Path(tempfile.mkdtemp(prefix="tokenmill-bench-")) / "server.log"
    server_args = [
        "--step-timing",
        "--max-running-requests",
        str(args.batch),
        "--device",
        args.device,
        "--kv-cache-tokens",
        str(args.batch * 512),
    ]
    print(f"serving {model} (log: {log_path}) ...", flush=True)
    proc, base_url = start_server(model, server_args, log_path)
    try:
        asyncio.run(workload(base_url, args, seed=1))  # warm-up
        before = timing(base_url)
        asyncio.run(workload(base_url, args, seed=2))
        after = timing(base_url)
    finally:
        stop_server(proc)
    d = {k: after[k] - before[k] for k in KEYS}
    steps = d["decode_steps"]
    period, busy, forward = (d[k] / steps * 1e3 for k in KEYS[1:4])
    overhead = 1 - forward / period
    print(f"decode steps {steps:.0f}, mean batch {d['rows'] / steps:.1f}")
    print(f"{'step period':<28}{period:8.2f} ms")
    print(f"{'worker busy':<28}{busy:8.2f} ms")
    print(f"{'model forward':<28}{forward:8.2f} ms")
    print(
        f"{'outside the forward':<28}{period - forward:8.2f} ms = {overhead:.1%} "
        f"(target <= {TARGET:.0%}); of which outside the worker "
        f"{(period - busy) / period:.1%}"
    )
    return 0 if overhead <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
