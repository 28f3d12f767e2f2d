"""The share of a decode step's wall time spent outside the model forward, at batch 32.

Starts one tokenmill server with --step-timing and --max-running-requests 32, sends 32
streaming requests at once (short prompts, ignore_eos, long outputs) so that the engine
decodes a full batch of 32, and reads the step totals from /metrics before and after.
Overhead = 1 - forward / period: the controller, IPC, detokenizer and frontend, plus the
worker's own step preparation and sampling. Target: <= 10%. The workload runs --rounds times
after a warm-up, each round's figure printed (this host's speed swings within a minute), and
the median decides the exit status.

Then, in this process, one prefill step of --prefill-tokens tokens (8 prompts) through the
real runner: its model forward's achieved GFLOP/s (the layers' and lm_head's multiply-adds
plus attention's, counting the work done: the last layer computes past its keys and values
only each prompt's last token) against a bare torch F.linear of [prefill-tokens x hidden x
intermediate] on the same machine and dtype, the speed a GEMM library reaches on that shape.

    python benchmarks/serving/step_overhead.py [--preset small|medium | --model DIR]
        [--batch 32] [--decode-steps 1] [--overlap-schedule] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from server import layer_multiply_adds, settled_metrics, start_server, stop_server, stream_random

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.checkpoints import add_model_args, resolve_model  # noqa: E402
from tokenmill.tp_worker.model.config import ModelConfig  # noqa: E402

TARGET = 0.10
ROUNDS = 5  # prefill steps and bare products, in turn
KEYS = ("decode_steps", "period_seconds", "worker_busy_seconds", "forward_seconds", "rows")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "medium")
    p.add_argument("--batch", type=int, default=32, help="decode batch (default 32)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (default 128)")
    p.add_argument("--logprobs", type=int, default=0, help="top logprobs asked (default 0)")
    p.add_argument("--device", default="auto", help="the server's --device (default auto)")
    p.add_argument("--dtype", default="auto", help="the server's --dtype (default auto)")
    p.add_argument(
        "--decode-steps", type=int, default=1, help="the server's --decode-steps (default 1)"
    )
    p.add_argument(
        "--overlap-schedule",
        action="store_true",
        help="the server's --overlap-schedule (the next step scheduled while this one runs)",
    )
    p.add_argument(
        "--prefill-tokens", type=int, default=2048, help="tokens of the prefill step (2048)"
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="measured workloads, each its own figure (3)"
    )
    return p.parse_args()


def timing(base_url: str) -> dict[str, float]:
    metrics = settled_metrics(base_url)
    return {k: metrics[f"tokenmill_step_timing_{k}"] for k in KEYS}


async def workload(base_url: str, args: argparse.Namespace, seed: int) -> None:
    await stream_random(
        base_url, args.batch, args.input_len, args.output_len, args.batch, seed, args.logprobs
    )


def report_round(d: dict[str, float]) -> float:
    """Prints one round's per-step figures; returns its share outside the forward."""
    steps = d["decode_steps"]
    period, busy, forward = (d[k] / steps * 1e3 for k in KEYS[1:4])
    print(
        f"{steps:.0f} decode steps (mean batch {d['rows'] / steps:.1f}): period {period:.2f} ms,"
        f" worker busy {busy:.2f}, model forward {forward:.2f}; outside the forward "
        f"{period - forward:.2f} ms = {1 - forward / period:.1%}, of which outside the worker "
        f"{(period - busy) / period:.1%}"
    )
    return 1 - forward / period


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
        "--dtype",
        args.dtype,
        "--decode-steps",
        str(args.decode_steps),
    ] + (["--overlap-schedule"] if args.overlap_schedule else [])
    print(f"serving {model} (log: {log_path}) ...", flush=True)
    proc, base_url = start_server(model, server_args, log_path)
    rounds = []
    try:
        asyncio.run(workload(base_url, args, seed=1))  # warm-up
        for i in range(args.rounds):
            before = timing(base_url)
            asyncio.run(workload(base_url, args, seed=2 + i))
            after = timing(base_url)
            rounds.append({k: after[k] - before[k] for k in KEYS})
    finally:
        stop_server(proc)
    shares = [report_round(d) for d in rounds]
    overhead = statistics.median(shares)
    print(
        f"{'outside the forward':<28}median {overhead:.1%} of {len(shares)} rounds "
        f"({', '.join(f'{x:.1%}' for x in shares)}; target <= {TARGET:.0%})"
    )
    prefill_gflops(model, args)
    return 0 if overhead <= TARGET else 1


def prefill_gflops(model: Path, args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from tokenmill.offline.engine import OfflineEngine, OfflineRequest
    from tokenmill.tp_worker.config import RunnerConfig
    from tokenmill.tp_worker.cpu.host_memory import keep_freed_memory
    from tokenmill.tp_worker.model_runner import ModelRunner

    num_prompts, tokens = 8, args.prefill_tokens
    per_prompt = tokens // num_prompts
    config = RunnerConfig(
        model=str(model),
        kv_cache_tokens=2 * tokens,
        max_running_requests=num_prompts,
        max_model_len=per_prompt + 8,
        dtype=args.dtype,
        device="cpu",
    )
    keep_freed_memory()  # NOTE: as the worker process does (no page faults per step)
    runner = ModelRunner(config)
    engine = OfflineEngine(runner, max_prefill_tokens=tokens, enable_prefix_cache=False)
    rng = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 1000, (num_prompts, per_prompt), generator=rng).tolist()
    requests = [OfflineRequest(p, max_tokens=1) for p in prompts]
    c = runner.model_config
    x = torch.randn(tokens, c.hidden_size, dtype=runner.dtype)
    w = torch.randn(c.intermediate_size, c.hidden_size, dtype=runner.dtype)
    engine.generate(requests)  # warm-up
    F.linear(x, w)
    # NOTE: the two in turn, best of ROUNDS each: this host's speed swings 2x within a minute.
    forward_s, linear_s = [], []
    for _ in range(ROUNDS):
        runner.time_forward, runner.forward_s = True, 0.0
        engine.generate(requests)  # one prefill step: max_tokens=1 finishes every request
        forward_s.append(runner.forward_s)
        started = time.perf_counter()
        for _ in range(3):
            F.linear(x, w)
        linear_s.append((time.perf_counter() - started) / 3)
    ours = prefill_flop(c, num_prompts, per_prompt) / min(forward_s) / 1e9
    bare = 2 * tokens * c.hidden_size * c.intermediate_size / min(linear_s) / 1e9
    print(
        f"{'prefill step':<28}{tokens} tokens ({runner.dtype}) in {min(forward_s) * 1e3:.1f} ms"
        f" = {ours:.0f} GFLOP/s; bare F.linear [{tokens} x {c.hidden_size} x "
        f"{c.intermediate_size}] {bare:.0f} GFLOP/s; ratio {ours / bare:.2f} (best of {ROUNDS})"
    )


def prefill_flop(c: ModelConfig, num_prompts: int, per_prompt: int) -> float:
    """Multiply-adds x 2 of prefilling num_prompts prompts of per_prompt tokens: every layer
    for every token, except that the last layer computes keys and values for every token and
    the rest (q, with its k/v again) only for each prompt's last token (the one state the
    step reads), and the lm_head that token."""
    tokens = num_prompts * per_prompt
    kv, q_kv, rest = layer_multiply_adds(c)
    attention = 2 * c.num_heads * c.head_dim * per_prompt * (per_prompt + 1)  # q.k and p.V
    last_attention = 2 * 2 * c.num_heads * c.head_dim * per_prompt  # one query of each
    flop = 2 * (c.num_layers - 1) * (q_kv + rest) * tokens + 2 * kv * tokens
    flop += 2 * (q_kv + rest) * num_prompts + 2 * c.hidden_size * c.vocab_size * num_prompts
    return flop + num_prompts * ((c.num_layers - 1) * attention + last_attention)


if __name__ == "__main__":
    raise SystemExit(main())
