"""What random sampling costs a decode step: the torch path against csrc/sample.cpp.

First, one sampling call on [batch, vocab] float32 logits for the settings clients send
(greedy, temperature 1, top-p 0.9, top-k 50 with top-p 0.95 and min-p 0.05), both paths in
one run, alternated over rounds; then the engine's own decode step in one process
(offline/engine.py, `--batch` requests of 32 prompt tokens and 128 outputs) greedy and at
temperature 1 with top-p 0.9, the sampler the runner picks on this machine.

    python benchmarks/engine/sampling.py [--preset small|medium | --model DIR] [--batch 32]
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
from tokenmill.tp_worker.sample.sampling import SamplingTensors, sample  # noqa: E402

# (label, temperature, top_k, top_p, min_p)
SETTINGS = (
    ("greedy", 0.0, 0, 1.0, 0.0),
    ("temperature 1", 1.0, 0, 1.0, 0.0),
    ("top-p 0.9", 1.0, 0, 0.9, 0.0),
    ("top-k 50, top-p 0.95, min-p 0.05", 0.8, 50, 0.95, 0.05),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "medium")
    p.add_argument("--batch", type=int, default=32, help="rows sampled at once (default 32)")
    p.add_argument("--vocab", type=int, default=32768, help="logits per row (default 32768)")
    p.add_argument("--rounds", type=int, default=5, help="timed calls per path (default 5)")
    return p.parse_args()


def tensors(batch: int, temperature: float, top_k: int, top_p: float, min_p: float):
    return SamplingTensors(
        temperature=torch.full((batch,), temperature),
        top_k=torch.full((batch,), top_k, dtype=torch.int64),
        top_p=torch.full((batch,), top_p),
        min_p=torch.full((batch,), min_p),
        seed=torch.arange(batch) * 7919,
    )


def time_calls(args: argparse.Namespace) -> None:
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    positions = torch.arange(args.batch) + 100
    print(f"one sampling call, [{args.batch} x {args.vocab}] logits, ms (median of rounds):")
    print(f"  {'setting':<36}{'torch':>9}{'kernel':>9}{'speed-up':>10}")
    for label, *setting in SETTINGS:
        params = tensors(args.batch, *setting)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for kernel in (False, True):
                started = time.perf_counter()
                sample(logits, params, positions, cpu_kernel=kernel)
                times[kernel].append(time.perf_counter() - started)
        torch_ms, kernel_ms = (sorted(times[k])[len(times[k]) // 2] * 1e3 for k in (False, True))
        print(f"  {label:<36}{torch_ms:9.2f}{kernel_ms:9.2f}{torch_ms / kernel_ms:9.1f}x")


def time_steps(args: argparse.Namespace) -> None:
    config = RunnerConfig(
        model=str(resolve_model(args)),
        kv_cache_tokens=args.batch * 200,
        max_running_requests=args.batch,
        max_model_len=200,
        dtype="auto",
        device="cpu",
    )
    runner = ModelRunner(config)
    engine = OfflineEngine(runner, max_prefill_tokens=4096, enable_prefix_cache=False)
    prompts = torch.randint(10, 30000, (args.batch, 32), generator=torch.Generator().manual_seed(1))
    print(
        f"decode in one process ({runner.dtype}, batch {args.batch}, kernels "
        f"{'on' if runner.cpu_kernels else 'off'}), 128 tokens each, ms per token "
        "(prefill included):"
    )
    for label, temperature, top_k, top_p, min_p in (SETTINGS[0], SETTINGS[2]):
        requests = [
            OfflineRequest(p, 128, temperature, top_k, top_p, min_p, seed=i)
            for i, p in enumerate(prompts.tolist())
        ]
        engine.generate(requests[:2])  # warm-up
        started = time.perf_counter()
        engine.generate(requests)
        print(f"  {label:<36}{(time.perf_counter() - started) / 128 * 1e3:9.2f}")


def main() -> None:
    args = parse_args()
    time_calls(args)
    time_steps(args)


if __name__ == "__main__":
    main()
