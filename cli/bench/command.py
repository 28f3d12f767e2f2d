"""`tokenmill bench`: load-test an OpenAI-compatible server (a client process, not the server).

Builds the prompts, sends them streamed with a concurrency cap and Poisson arrivals, prints
throughput and TTFT / TPOT / ITL percentiles, and writes the same as JSON. Works against
tokenmill, vLLM, SGLang or anything else that speaks /v1/completions and /v1/chat/completions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DESCRIPTION = (
    "Sends NUM_PROMPTS streamed requests to an OpenAI-compatible server (tokenmill, vLLM, "
    "SGLang, ...) and prints successful / failed requests, duration, request and token "
    "throughput, and mean / median / p99 of TTFT (time to first token), TPOT (time per output "
    "token after the first) and ITL (inter-token latency). Random prompts for the completions "
    "endpoint are token-id lists drawn from [10, --vocab-size), so their length is exact; chat "
    "needs text, so there a prompt is --input-len random common words (about one token each: "
    "the length is approximate, and the server's usage is what the results count)."
)


def _dataset(value: str) -> str:
    if value in ("random", "shared-prefix") or value.endswith(".jsonl"):
        return value
    raise argparse.ArgumentTypeError("use random, shared-prefix or a PATH ending in .jsonl")


def _positive_int(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value}: must be > 0")
    return number


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        type=_dataset,
        default="random",
        help="random: independent random prompts; shared-prefix: one --prefix-len-token prefix "
        'plus --input-len unique tokens each; PATH.jsonl: one {"prompt": text or [ids], '
        '"output_len": M (optional)} per line (default random)',
    )
    g.add_argument("--num-prompts", type=_positive_int, default=100, help="requests (default 100)")
    g.add_argument("--input-len", type=int, default=256, help="prompt tokens (default 256)")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens (default 64)")
    g.add_argument(
        "--prefix-len", type=int, default=256, help="shared-prefix: shared tokens (default 256)"
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=1000,
        help="random token ids are drawn from [10, VOCAB_SIZE) (default 1000: safe for "
        "tokenmill's demo tokenizers; ids 0-4 are their special tokens)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default 0)")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument(
        "--max-concurrency",
        type=_positive_int,
        default=None,
        help="requests in flight at most (default: no limit)",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals; inf sends all at once (default inf)",
    )
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")


def _add_request_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("request")
    g.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions (default completions)",
    )
    g.add_argument(
        "--logprobs",
        type=int,
        default=0,
        help="K > 0: completions `logprobs: K`, chat `logprobs: true, top_logprobs: K`; "
        "-1: the sampled token's logprob only; 0: off (default 0)",
    )
    g.add_argument(
        "--prompt-logprobs",
        action="store_true",
        help="completions only: `echo: true` with logprobs, so the prompt is scored too",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send `ignore_eos: true` (vLLM, SGLang, tokenmill) so outputs are full length",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="(default 0: greedy)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server: throughput, TTFT, TPOT, ITL",
        description=DESCRIPTION,
    )
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root (default http://127.0.0.1:8000)",
    )
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    _add_workload_args(p)
    _add_load_args(p)
    _add_request_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    g.add_argument("--disable-progress", action="store_true", help="no progress bar on stderr")


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags together, or None."""
    if args.endpoint == "chat" and args.prompt_logprobs:
        return "--prompt-logprobs: chat has no prompt logprobs; use --endpoint completions"
    if args.logprobs < -1:
        return f"--logprobs {args.logprobs}: use -1, 0 or a top-K count"
    if args.input_len < 1 or args.output_len < 0 or args.prefix_len < 0:
        return "--input-len must be >= 1, --output-len and --prefix-len >= 0"
    return None


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.cli.bench.client import BenchOptions, fetch_model_id, run_requests
    from tokenmill.cli.bench.datasets import load_dataset
    from tokenmill.cli.bench.metrics import compute_metrics, format_table

    requests = load_dataset(
        args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        as_text=args.endpoint == "chat",
        vocab_size=args.vocab_size,
        seed=args.seed,
    )
    if args.endpoint == "chat" and not all(isinstance(r.prompt, str) for r in requests):
        raise ValueError(f"{args.dataset}: chat needs text prompts, not token ids")
    model = args.model or await fetch_model_id(args.base_url)
    opts = BenchOptions(
        base_url=args.base_url,
        model=model,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        timeout=args.timeout,
    )
    logger.info("bench: %s requests to %s (model %s)", len(requests), args.base_url, model)
    results, duration = await run_requests(
        requests,
        opts,
        args.endpoint,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        show_progress=not args.disable_progress,
    )
    metrics = compute_metrics(results, duration)
    print(format_table(metrics))
    return {"config": {**_config(args), "model": model}, **metrics.to_dict()}


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as JSON values: paths as text, inf as "inf" (strict JSON has no Infinity)."""
    config = {}
    for key, value in vars(args).items():
        if key == "command" or callable(value):
            continue
        if isinstance(value, Path) or (isinstance(value, float) and not math.isfinite(value)):
            value = str(value)
        config[key] = value
    return config


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem is not None:
        print(f"tokenmill bench: {problem}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(_main(args))
    except (OSError, RuntimeError, ValueError) as e:
        print(f"tokenmill bench: {e}", file=sys.stderr)
        return 1
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        logger.info("wrote %s", args.json)
    return 0 if report["completed"] > 0 else 1
