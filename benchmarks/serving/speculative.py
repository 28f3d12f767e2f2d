"""Speculative decoding's speed: tokenmill with and without it, on a workload whose output
repeats its input and on one where it does not, at one user and at several; vLLM CPU with
its own n-gram speculation beside it (--vllm).

Workloads (the same requests on every server):
- repeat: greedy chat requests that hand SmolLM2 a piece of Python (functions of the standard
  library, 40-70 lines) to rewrite with a change or to copy: most of the output is the input.
- random: 256 random prompt tokens, 128 out (ignore_eos), as `vllm bench serve`'s random
  dataset, sampled at temperature 1 with a seed per request: the output does not repeat
  (greedy, a small model falls into a loop on such prompts, which n-grams predict: SmolLM2
  kept 0.99 of its drafts there), so drafts rarely match.
tokenmill's servers are up together and measured one at a time, interleaved round by round
(vLLM's one after the other). Figures, medians of the rounds: output tok/s (all tokens over
the wall time), median TPOT ((latency - TTFT) / (tokens - 1), as vLLM's client), and the
share of drafted tokens kept. tokenmill's outputs with speculation are checked equal to its
outputs without.

    python benchmarks/serving/speculative.py [--model DIR] [--k 4] [--draft-layers 8] [--vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from server import cpu_name, read_metrics, settled_metrics, start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.peers.launch import start_vllm, stop  # noqa: E402
from tokenmill.tp_worker.device import cpu_has_native_bf16  # noqa: E402


def _sources() -> list[str]:
    """Functions of the standard library (the same text on every machine of a Python
    version), 40-70 lines each."""
    import argparse as a
    import difflib
    import json.decoder as jd
    import shlex
    import string
    import textwrap as tw

    picked = [
        tw.TextWrapper._wrap_chunks,
        shlex.shlex.read_token,
        difflib.SequenceMatcher.find_longest_match,
        jd.JSONObject,
        string.Template.substitute,
        a.ArgumentParser._parse_optional,
        difflib.get_close_matches,
        tw.dedent,
    ]
    return [textwrap.dedent(inspect.getsource(f)) for f in picked]


ASKS = (
    "Rewrite this Python function exactly as it is, but rename every variable called `i` to "
    "`index` if there is one. Answer with the code only.",
    "Copy this Python code exactly, character for character, in a code block.",
)


def repeat_bodies(n: int, max_tokens: int) -> list[dict[str, Any]]:
    sources = _sources()
    return [
        {
            "messages": [
                {
                    "role": "user",
                    "content": f"{ASKS[i % 2]}\n\n```python\n{sources[i % len(sources)]}```",
                }
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        for i in range(n)
    ]


def random_bodies(n: int, vocab: int, prompt_len: int, max_tokens: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    return [
        {
            "prompt": rng.integers(100, vocab - 100, prompt_len).tolist(),
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": i,
            "ignore_eos": True,
        }
        for i in range(n)
    ]


@dataclass
class Timed:
    text: str
    tokens: int
    ttft: float
    latency: float


async def one(session: Any, url: str, body: dict[str, Any]) -> Timed:
    """One streamed request: its text, output tokens (usage), TTFT and latency."""
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    # NOTE: a body's own model wins (an adapter's name: benchmarks/serving/lora.py)
    body = {"model": "m", **body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, text, tokens = 0.0, "", 0
    async with session.post(url + path, json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content") if chat else choice.get("text")
                if piece:
                    first = first or time.perf_counter()
                    text += piece
    end = time.perf_counter()
    return Timed(text, tokens, (first or end) - started, end - started)


async def run(url: str, bodies: list[dict[str, Any]], users: int) -> tuple[float, list[Timed]]:
    """All bodies, at most `users` at once: (wall seconds, each request's figures)."""
    import aiohttp

    gate = asyncio.Semaphore(users)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def gated(body: dict[str, Any]) -> Timed:
            async with gate:
                return await one(session, url, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(gated(b) for b in bodies))
        return time.perf_counter() - started, list(results)


@dataclass
class Figures:
    tok_s: float
    tpot_ms: float
    drafted: float
    kept: float
    texts: list[str]


def measure(url: str, bodies: list[dict[str, Any]], users: int, drafts: Callable) -> Figures:
    """One round of `bodies` at `users` at once."""
    before = drafts(url)
    seconds, timed = asyncio.run(run(url, bodies, users))
    after = drafts(url)
    tpots = [(t.latency - t.ttft) / (t.tokens - 1) for t in timed if t.tokens > 1]
    return Figures(
        tok_s=sum(t.tokens for t in timed) / seconds,
        tpot_ms=1e3 * statistics.median(tpots),
        drafted=after[0] - before[0],
        kept=after[1] - before[1],
        texts=[t.text for t in timed],
    )


def rounds(servers: dict[str, tuple[str, Callable]], args: argparse.Namespace) -> dict:
    """Every workload at every user count, on each server in turn, `args.rounds` times:
    servers that are up together are measured one at a time, interleaved, so that a slow
    spell of this shared machine falls on all of them."""
    results: dict[str, dict[tuple[str, int], list[Figures]]] = {name: {} for name in servers}
    for url, _ in servers.values():
        asyncio.run(run(url, next(iter(args.workloads.values()))[:2], 2))  # NOTE: warm-up
    for _ in range(args.rounds):
        for workload, bodies in args.workloads.items():
            for users in args.users:
                part = bodies[: 8 if users == 1 else 2 * users]
                for name, (url, drafts) in servers.items():
                    figures = measure(url, part, users, drafts)
                    results[name].setdefault((workload, users), []).append(figures)
    return results


def tokenmill_drafts(url: str) -> tuple[float, float]:
    m = settled_metrics(url)
    return (
        m.get("tokenmill_spec_decode_num_draft_tokens_total", 0.0),
        m.get("tokenmill_spec_decode_num_accepted_tokens_total", 0.0),
    )


def vllm_drafts(url: str) -> tuple[float, float]:
    m = read_metrics(url)

    def total(name: str) -> float:
        return sum(v for k, v in m.items() if k.startswith(name + "{") or k == name)

    return total("vllm:spec_decode_num_draft_tokens_total"), total(
        "vllm:spec_decode_num_accepted_tokens_total"
    )


def tokenmill_servers(model: Path, args: argparse.Namespace, specs: dict[str, str], logs: Path):
    """Each of `specs` (name -> --speculative-config, "" for none) as a server, all up at once."""
    procs, servers = [], {}
    try:
        for i, (name, spec) in enumerate(specs.items()):
            extra = ["--speculative-config", spec] if spec else []
            common = ["--served-model-name", "m", "--dtype", args.dtype, "--max-model-len", "2048"]
            proc, url = start_server(model, [*common, *extra], logs / f"tokenmill{i}.log")
            procs.append(proc)
            servers[name] = (url, tokenmill_drafts)
        return rounds(servers, args)
    finally:
        for proc in procs:
            stop_server(proc)


def vllm_servers(model: Path, args: argparse.Namespace, specs: dict[str, str], logs: Path):
    """vLLM one server at a time (an idle vLLM CPU keeps its OpenMP threads spinning)."""
    results = {}
    for i, (name, spec) in enumerate(specs.items()):
        extra = ["--speculative-config", spec] if spec else []
        peer = start_vllm(model, args.dtype, logs / f"vllm{i}.log", extra)
        try:
            results.update(rounds({name: (peer.url, vllm_drafts)}, args))
        finally:
            stop(peer)
    return results


def median(figures: list[Figures], field: str) -> float:
    return statistics.median(getattr(f, field) for f in figures)


def print_table(results: dict[str, dict[tuple[str, int], list[Figures]]]) -> None:
    print(f"\n{'server':<34}{'workload':<9}{'users':>6}{'out tok/s':>11}{'TPOT ms':>9}{'kept':>7}")
    for server, table in results.items():
        for (name, users), figures in table.items():
            drafted = sum(f.drafted for f in figures)
            kept = f"{sum(f.kept for f in figures) / drafted:.2f}" if drafted else "-"
            tok_s, tpot = median(figures, "tok_s"), median(figures, "tpot_ms")
            print(f"{server:<34}{name:<9}{users:>6}{tok_s:>11.1f}{tpot:>9.1f}{kept:>7}")
    print("\nout tok/s with speculation / without, medians of the rounds (targets: repeat at one")
    print("user >= 1.8, random >= 0.97):")
    for engine in ("tokenmill", "vLLM"):
        plain = results.get(f"{engine} plain")
        for server, table in results.items():
            if plain is None or not server.startswith(engine) or server.endswith("plain"):
                continue
            ratios = ", ".join(
                f"{name} x{users} {median(f, 'tok_s') / median(plain[name, users], 'tok_s'):.2f}"
                for (name, users), f in table.items()
            )
            print(f"  {server}: {ratios}")


def check_same_outputs(results: dict[str, dict[tuple[str, int], list[Figures]]]) -> None:
    plain = results["tokenmill plain"]
    for server, table in results.items():
        if server.startswith("tokenmill") and server != "tokenmill plain":
            same = all(
                a.texts == b.texts
                for key, figures in table.items()
                for a, b in zip(figures, plain[key], strict=True)
            )
            print(f"{server}: the same text as without speculation on every request: {same}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default: SmolLM2)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (4)")
    p.add_argument("--draft-layers", type=int, default=0, help="also a draft model: the "
                   "target's first N layers (no trained draft is at hand); 0: none")  # fmt: skip
    p.add_argument("--users", default="1,8", help="concurrent users, comma list (1,8)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per server (2)")
    p.add_argument("--workloads", default="repeat,random", help="comma list (repeat,random)")
    p.add_argument("--max-tokens", type=int, default=256, help="repeat workload's max (256)")
    p.add_argument("--dtype", default="", help="default: what tokenmill's auto picks here")
    p.add_argument("--vllm", action="store_true", help="vLLM CPU too, with and without ngram")
    p.add_argument("--vllm-only", action="store_true", help="vLLM CPU alone (its figures)")
    return p.parse_args()


def main() -> int:
    from tokenmill.cli.make_model.draft import layer_truncated
    from tokenmill.tp_worker.model.config import load_model_config

    args = parse_args()
    args.dtype = args.dtype or ("bfloat16" if cpu_has_native_bf16() else "float32")
    args.users = [int(u) for u in args.users.split(",")]
    if args.model is None:
        from tokenmill.cli.default_model import resolve_model

        args.model = resolve_model(None).directory
    vocab = load_model_config(str(args.model)).vocab_size
    n = max(2 * max(args.users), 8)
    every = {
        "repeat": repeat_bodies(n, args.max_tokens),
        "random": random_bodies(n, vocab, 256, 128),
    }
    args.workloads = {name: every[name] for name in args.workloads.split(",")}
    ngram = json.dumps(
        {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
    )  # fmt: skip
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        if not args.vllm_only:
            specs = {"tokenmill plain": "", f"tokenmill ngram k={args.k}": ngram}
            if args.draft_layers:
                draft = layer_truncated(args.model, logs / "draft", args.draft_layers)
                name = f"tokenmill draft {args.draft_layers} layers k={args.k}"
                specs[name] = json.dumps({"model": str(draft), "num_speculative_tokens": args.k})
            results.update(tokenmill_servers(args.model, args, specs, logs))
        if args.vllm or args.vllm_only:
            specs = {"vLLM plain": "", f"vLLM ngram k={args.k}": ngram}
            results.update(vllm_servers(args.model, args, specs, logs))
    print_table(results)
    if "tokenmill plain" in results:
        check_same_outputs(results)
    print(f"\nmodel {args.model}, dtype {args.dtype}, {os.cpu_count()} CPUs: {cpu_name()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
