"""Data parallelism: does the router send each prompt where its prefix is cached?

Two workloads through the native /generate, each run on --data-parallel-size 1 and then 2
(one server at a time, the same machine, CPU threads shared out among the replicas):

- shared prefixes: --groups groups of --per-group requests, each group sharing a fresh
  --prefix-len-token prefix and adding a unique --suffix-len-token suffix, sent in an
  interleaved order with --max-concurrency in flight. Printed: the prefix-cache hit rate
  (hit / queried prompt tokens, summed over replicas) and each replica's share of the
  prompt tokens. Target: DP=2's hit rate close to DP=1's.
- distinct prompts: no shared prefix; printed: each replica's share of the prompt tokens
  (target: both replicas get work).

    python benchmarks/serving/data_parallel.py [--preset small|medium | --model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from server import read_metrics, settled_metrics, start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.checkpoints import add_model_args, resolve_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "small")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--max-concurrency", type=int, default=16)
    return p.parse_args()


def shared_prefix_prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(10, 1000, (args.groups, args.prefix_len))
    prompts = []
    for _ in range(args.per_group):  # NOTE: interleaved: group 0, 1, ..., 0, 1, ...
        for g in range(args.groups):
            suffix = rng.integers(10, 1000, args.suffix_len)
            prompts.append(prefixes[g].tolist() + suffix.tolist())
    return prompts


def distinct_prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    length = args.prefix_len + args.suffix_len
    return rng.integers(10, 1000, (args.groups * args.per_group, length)).tolist()


async def send(base_url: str, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """Seconds to answer every prompt."""
    limit = asyncio.Semaphore(args.max_concurrency)
    async with aiohttp.ClientSession() as session:

        async def one(ids: list[int]) -> None:
            sampling = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
            body = {"input_ids": ids, "sampling_params": sampling}
            async with limit, session.post(base_url + "/generate", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
                await response.read()

        started = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - started


def per_replica(metrics: dict[str, float], name: str) -> dict[str, float]:
    """replica label ("" with one replica) -> value of one engine counter."""
    found = {}
    for key, value in metrics.items():
        m = re.fullmatch(rf"tokenmill_{name}(?:{{replica=\"(\d+)\"}})?", key)
        if m:
            found[m[1] or ""] = value
    return found


def measure(base_url: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    before = read_metrics(base_url)
    seconds = asyncio.run(send(base_url, prompts, args))
    after = settled_metrics(base_url)

    def delta(name: str) -> dict[str, float]:
        b, a = per_replica(before, name), per_replica(after, name)
        return {k: a[k] - b.get(k, 0.0) for k in sorted(a)}

    queried = delta("prefix_cache_queried_tokens_total")
    hits = delta("prefix_cache_hit_tokens_total")
    total = sum(queried.values())
    return {
        "seconds": seconds,
        "hit_rate": sum(hits.values()) / total,
        "shares": [q / total for q in queried.values()],
    }


def run_server(model: Path, replicas: int, args: argparse.Namespace, seed: int) -> list[dict]:
    log = Path(tempfile.mkdtemp(prefix="tokenmill-bench-")) / "server.log"
    total = args.prefix_len + args.suffix_len + args.output_len
    server_args = [
        "--data-parallel-size", str(replicas),
        "--max-running-requests", str(args.max_concurrency),
        "--kv-cache-tokens", str(4 * args.max_concurrency * total),
    ]  # fmt: skip
    print(f"serving {model} with --data-parallel-size {replicas} (log: {log}) ...", flush=True)
    proc, base_url = start_server(model, server_args, log)
    try:
        measure(base_url, distinct_prompts(args, seed + 99)[:8], args)  # warm-up
        shared = measure(base_url, shared_prefix_prompts(args, seed), args)
        distinct = measure(base_url, distinct_prompts(args, seed + 1), args)
        return [shared, distinct]
    finally:
        stop_server(proc)


def main() -> int:
    args = parse_args()
    model = resolve_model(args)
    results = {d: run_server(model, d, args, seed=7) for d in (1, 2)}
    n = args.groups * args.per_group
    print(
        f"\n{n} requests; shared prefixes: {args.groups} groups x {args.per_group}, "
        f"{args.prefix_len} + {args.suffix_len} prompt tokens, {args.output_len} out"
    )
    for d, (shared, distinct) in results.items():
        shares = " / ".join(f"{s:.2f}" for s in shared["shares"])
        spread = " / ".join(f"{s:.2f}" for s in distinct["shares"])
        print(
            f"DP={d}: shared prefixes: hit rate {shared['hit_rate']:.3f}, "
            f"{shared['seconds']:.1f} s, prompt-token share per replica {shares}; "
            f"distinct prompts: hit rate {distinct['hit_rate']:.3f}, share per replica {spread}"
        )
    ratio = results[2][0]["hit_rate"] / results[1][0]["hit_rate"]
    print(f"DP=2 hit rate / DP=1 hit rate on shared prefixes: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
