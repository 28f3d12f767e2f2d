"""The engine's own throughput, in one process: no HTTP, no detokenizer, no client.

Runs the real controller over an in-process model runner (offline/engine.py) on one
device, for the two side-by-side workloads (64 prompts of 256 in / 64 out and of 64 in / 256
out, random token ids, no prefix cache), with and without top-5 logprobs, and prints output
tokens per second. The gap to `tokenmill bench` against a server on the same machine is what
the serving processes cost; on a GPU it is the figure for the torch path with no CUDA graphs.

    python benchmarks/engine/offline_throughput.py [--preset small|medium | --model DIR]
        [--device auto|cpu|cuda] [--dtype auto|bfloat16|float32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.checkpoints import add_model_args, resolve_model  # noqa: E402
from tokenmill.offline.engine import OfflineEngine, OfflineRequest  # noqa: E402
from tokenmill.tp_worker.config import RunnerConfig  # noqa: E402
from tokenmill.tp_worker.model_runner import ModelRunner  # noqa: E402

WORKLOADS = ((256, 64), (64, 256))  # (input tokens, output tokens)
PROMPTS = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "medium")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.add_argument("--dtype", default="auto", help="the runner's dtype (default auto)")
    return p.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace, input_len: int, output_len: int) -> None:
    config = RunnerConfig(
        model=str(resolve_model(args)),
        kv_cache_tokens=PROMPTS * (input_len + output_len + 32),
        max_running_requests=PROMPTS,
        max_model_len=input_len + output_len + 32,
        dtype=args.dtype,
        device=args.device,
    )
    runner = ModelRunner(config)
    engine = OfflineEngine(runner, max_prefill_tokens=8192, enable_prefix_cache=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, 30000, (input_len,), generator=gen).tolist() for _ in range(PROMPTS)
    ]
    engine.generate([OfflineRequest(p, max_tokens=output_len) for p in prompts[:4]])  # warm-up
    for num_top in (0, 5):
        requests = [OfflineRequest(p, max_tokens=output_len, num_top=num_top) for p in prompts]
        synchronize(runner.device)
        started = time.perf_counter()
        engine.generate(requests)
        synchronize(runner.device)
        seconds = time.perf_counter() - started
        print(
            f"{PROMPTS} x {input_len} in / {output_len} out, top {num_top}: "
            f"{PROMPTS * output_len / seconds:8.1f} out tok/s ({seconds:.2f} s)",
            flush=True,
        )


def main() -> None:
    args = parse_args()
    print(f"device {args.device}, dtype {args.dtype}, model {resolve_model(args)}")
    for input_len, output_len in WORKLOADS:
        run(args, input_len, output_len)


if __name__ == "__main__":
    main()
