"""Output-token throughput of one tokenmill server with logprobs off, top 5 and top 20.

DESIGN.md promises that generation logprobs cost (almost) nothing: the target is a ratio of at
least 0.95 for top_logprobs 5 against logprobs off. The three variants run the same workload
(random 256 in / 64 out, ignore_eos, concurrency 16) interleaved, round after round, through
the `tokenmill bench` client in this process, against one server started here. Each variant's
CPU time per output token, process by process (the frontend, controller, detokenizer, worker
and this client, from /proc), says where a logprob ask's cost goes: on a machine whose cores
the model's threads fill, any process's extra CPU comes out of the model's.

    python benchmarks/serving/logprob_overhead.py [--preset small|medium | --model DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
from server import cpu_seconds, start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.checkpoints import add_model_args, resolve_model  # noqa: E402
from tokenmill.cli.bench.client import BenchOptions, fetch_model_id, run_requests  # noqa: E402
from tokenmill.cli.bench.datasets import random_requests  # noqa: E402
from tokenmill.cli.bench.metrics import BenchMetrics, compute_metrics  # noqa: E402

VARIANTS = {"off": 0, "top 5": 5, "top 20": 20}
TARGET_TOP5 = 0.95


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "medium")
    p.add_argument("--rounds", type=int, default=3, help="rounds of off / 5 / 20 (default 3)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run (default 64)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    p.add_argument("--max-concurrency", type=int, default=16, help="(default 16)")
    p.add_argument("--device", default="auto", help="the server's --device (default auto)")
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="(default 16384)")
    p.add_argument("--json", type=Path, help="also write every run's metrics here")
    return p.parse_args()


def server_args(args: argparse.Namespace) -> list[str]:
    return [
        "--device",
        args.device,
        "--kv-cache-tokens",
        str(args.kv_cache_tokens),
        "--max-model-len",
        str(args.input_len + args.output_len + 64),
    ]


def check_logprobs(base_url: str, model: str) -> None:
    """Fail unless the server really returns 5 alternatives when asked (else the ratio lies)."""
    body = {"model": model, "prompt": [10, 11, 12], "max_tokens": 2, "logprobs": 5}
    req = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as response:
        top = json.loads(response.read())["choices"][0]["logprobs"]["top_logprobs"]
    if not top or len(top[0]) != 5:
        raise RuntimeError(f"asked for 5 top logprobs, got {top!r}")


async def run_variant(
    base_url: str, model: str, args: argparse.Namespace, k: int, n: int, seed: int
) -> BenchMetrics:
    """`n` requests asking for top-`k` logprobs (0 = none), prompts drawn with `seed`."""
    opts = BenchOptions(base_url=base_url, model=model, logprobs=k, ignore_eos=True)
    # NOTE: every run gets its own prompts: with the same ones, the runs after the first
    # would find them all in the prefix cache and skip their prefill.
    requests = random_requests(
        n, args.input_len, args.output_len, as_text=False, vocab_size=1000, seed=seed
    )
    results, duration = await run_requests(
        requests, opts, "completions", max_concurrency=args.max_concurrency
    )
    return compute_metrics(results, duration)


# A run's CPU milliseconds per output token, by process (cpu_seconds' roles).
CpuPerToken = dict[str, float]


async def run_rounds(
    base_url: str, args: argparse.Namespace, server_pid: int
) -> tuple[dict[str, list[BenchMetrics]], dict[str, list[CpuPerToken]]]:
    model = await fetch_model_id(base_url)
    check_logprobs(base_url, model)
    print("warm-up ...", flush=True)
    seeds = iter(range(1, 1_000_000))
    for k in VARIANTS.values():
        await run_variant(base_url, model, args, k, args.max_concurrency, next(seeds))
    runs: dict[str, list[BenchMetrics]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[CpuPerToken]] = {name: [] for name in VARIANTS}
    for round_no in range(1, args.rounds + 1):
        for name, k in VARIANTS.items():
            before = cpu_seconds(server_pid)
            m = await run_variant(base_url, model, args, k, args.num_prompts, next(seeds))
            after = cpu_seconds(server_pid)
            tokens = max(m.total_output_tokens, 1)
            cpu[name].append({r: (after[r] - before.get(r, 0.0)) * 1e3 / tokens for r in after})
            runs[name].append(m)
            print(
                f"round {round_no} {name:>6}: {m.output_throughput:7.1f} tok/s, "
                f"TTFT {m.ttft_ms.median:7.1f} ms, TPOT {m.tpot_ms.median:6.1f} ms, "
                f"{m.duration_s:5.1f} s, failed {m.failed}",
                flush=True,
            )
    return runs, cpu


def report(runs: dict[str, list[BenchMetrics]]) -> float:
    """Print each variant's mean output throughput, its ratio to off (of the means, and the
    median of the per-round ratios, which drift between rounds cancels); return top 5's."""
    tps = {name: np.array([m.output_throughput for m in ms]) for name, ms in runs.items()}
    off = tps["off"]
    print(
        f"\n{'logprobs':<10}{'output tok/s':>14}{'ratio vs off':>14}{'per round':>11}{'failed':>8}"
    )
    for name, tp in tps.items():
        ratio = tp.mean() / off.mean() if off.mean() else float("nan")
        per_round = float(np.median(tp / np.maximum(off, 1e-9)))
        failed = sum(m.failed for m in runs[name])
        print(f"{name:<10}{tp.mean():>14.1f}{ratio:>14.3f}{per_round:>11.3f}{failed:>8}")
    ratio5 = tps["top 5"].mean() / off.mean() if off.mean() else float("nan")
    verdict = "meets" if ratio5 >= TARGET_TOP5 else "MISSES"
    print(f"top 5 / off = {ratio5:.3f}: {verdict} the target >= {TARGET_TOP5}")
    print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    for name, ms in runs.items():
        for m in ms:
            for error, count in m.errors.items():
                print(f"  {name}: {count} x {error}")
    return ratio5


def report_cpu(cpu: dict[str, list[CpuPerToken]]) -> None:
    """Each process's CPU ms per output token, the median over the rounds, per variant."""
    roles = sorted({role for runs in cpu.values() for run in runs for role in run})
    print("\nCPU ms per output token (median over the rounds):")
    print(f"{'logprobs':<10}" + "".join(f"{role:>13}" for role in roles))
    for name, runs in cpu.items():
        cells = [float(np.median([run.get(role, 0.0) for run in runs])) for role in roles]
        print(f"{name:<10}" + "".join(f"{cell:>13.3f}" for cell in cells))


def main() -> int:
    args = parse_args()
    model = resolve_model(args)
    log_path = Path(tempfile.mkdtemp(prefix="tokenmill-bench-")) / "server.log"
    print(f"serving {model} (log: {log_path}) ...", flush=True)
    print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    proc, base_url = start_server(model, server_args(args), log_path)
    try:
        runs, cpu = asyncio.run(run_rounds(base_url, args, proc.pid))
    finally:
        code = stop_server(proc)
    report(runs)
    report_cpu(cpu)
    if args.json is not None:
        data = {name: [m.to_dict() for m in ms] for name, ms in runs.items()}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    if code != 0:
        print(f"the server exited with {code} on SIGTERM; log: {log_path}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
