"""What --serving-nice buys on a CPU server: decode throughput with the frontend and the
detokenizer at niceness 0 and at 10, a fresh server per run, alternated over rounds.

The workload is the side-by-side decode-heavy one (64 prompts of 64 random token ids, 256
tokens out, ignore_eos, all at once, streamed through /v1/completions by tokenmill's own
load generator in this process), with --logprobs top logprobs. Each run also prints the CPU
seconds every tokenmill process and this client spent (serving.cpu_seconds): what the serving
processes take from the cores the model's threads want.

    python benchmarks/serving_nice.py [--preset medium | --model DIR] [--rounds 3]
        [--logprobs 5] [--nice 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from serving import (
    add_model_args,
    cpu_seconds,
    resolve_model,
    start_server,
    stop_server,
    stream_random,
)

PROMPTS, INPUT_LEN, OUTPUT_LEN = 64, 64, 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "medium")
    p.add_argument("--rounds", type=int, default=3, help="runs per setting (default 3)")
    p.add_argument("--logprobs", type=int, default=5, help="top logprobs asked (default 5)")
    p.add_argument("--nice", type=int, default=10, help="the setting against 0 (default 10)")
    p.add_argument("--dtype", default="bfloat16", help="the server's --dtype (bfloat16)")
    return p.parse_args()


async def workload(base_url: str, logprobs: int, seed: int) -> None:
    await stream_random(base_url, PROMPTS, INPUT_LEN, OUTPUT_LEN, PROMPTS, seed, logprobs)


def one_run(model: Path, args: argparse.Namespace, nice: int, seed: int) -> float:
    log = Path(tempfile.mkdtemp(prefix="tokenmill-bench-")) / "server.log"
    server_args = ["--dtype", args.dtype, "--serving-nice", str(nice)]
    server_args += ["--max-running-requests", str(PROMPTS)]
    proc, base_url = start_server(model, server_args, log)
    try:
        asyncio.run(workload(base_url, args.logprobs, seed))  # warm-up
        before, started = cpu_seconds(proc.pid), time.perf_counter()
        asyncio.run(workload(base_url, args.logprobs, seed + 1))
        wall, after = time.perf_counter() - started, cpu_seconds(proc.pid)
    finally:
        stop_server(proc)
    spent = ", ".join(f"{k} {after[k] - before.get(k, 0.0):.1f}" for k in after)
    rate = PROMPTS * OUTPUT_LEN / wall
    print(f"  --serving-nice {nice:<3} {rate:7.1f} out tok/s   cpu s: {spent}", flush=True)
    return rate


def main() -> None:
    args = parse_args()
    model = resolve_model(args)
    print(
        f"{PROMPTS} prompts, {INPUT_LEN} in / {OUTPUT_LEN} out, top {args.logprobs} logprobs, "
        f"{model.name} ({args.dtype}), {os.cpu_count()} cores"
    )
    rates: dict[int, list[float]] = {0: [], args.nice: []}
    for r in range(args.rounds):
        for nice in rates:
            rates[nice].append(one_run(model, args, nice, seed=10 * r))
    base, other = (statistics.median(rates[n]) for n in rates)
    print(
        f"median: --serving-nice 0 {base:.1f}, --serving-nice {args.nice} {other:.1f} out tok/s "
        f"({other / base:.3f}x)"
    )


if __name__ == "__main__":
    main()
