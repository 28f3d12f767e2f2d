"""Scoring throughput: items per second through /v1/score against the same scores obtained as
concurrent /v1/completions requests, and against vLLM CPU's /generative_scoring.

The workload is a reranker's: one request of --items items of --item-len tokens after a
shared --query-len-token query (token ids, a fresh random query each round so that every
round prefills its query once), two label tokens. Each round is timed from the first byte
sent to the last received. The completions way sends one request per item at once
(`max_tokens: 1`, `logprobs: 5`, the prompt as query + item ids), as a client without a
scoring endpoint would.

    python benchmarks/serving/scoring.py [--preset medium | --model DIR] [--dtype bfloat16]
        [--rounds 3] [--vllm] [--peer-url URL] [--tm-extra "FLAGS"]

--vllm starts vLLM CPU (benchmarks/peers/install_vllm_cpu.sh installs it) on the same
checkpoint after tokenmill has stopped, as benchmarks/peers/side_by_side.py starts it, and
measures its /generative_scoring and completions the same way; --peer-url measures an
already running server's /generative_scoring instead. Nothing else should run on the
machine meanwhile.

Last, with the servers stopped, the request's arithmetic at this machine's peak rates
(benchmarks/kernels/cpu_peak.py: the products and q.k at the VDPBF16PS rate, p.V at the
float32 one, as tokenmill's AVX-512 bfloat16 kernels run them; on AMX tiles all three at the
TDPBF16PS rate, p.V twice, as attention_amx.cpp's two-part weights do): the items/s no
kernel could beat here, and the share of it each server reached.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from server import layer_multiply_adds, start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.checkpoints import add_model_args, resolve_model  # noqa: E402
from benchmarks.kernels import cpu_peak  # noqa: E402
from benchmarks.peers.launch import start_vllm, stop  # noqa: E402
from tokenmill.tp_worker.cpu.ops import amx_enabled  # noqa: E402
from tokenmill.tp_worker.model.config import ModelConfig, load_model_config  # noqa: E402

LABELS = [100, 200]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "medium")
    p.add_argument("--dtype", default="bfloat16", help="both servers' --dtype (bfloat16)")
    p.add_argument("--query-len", type=int, default=1024, help="query tokens (1024)")
    p.add_argument("--items", type=int, default=256, help="items per request (256)")
    p.add_argument("--item-len", type=int, default=32, help="tokens per item (32)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per way (3)")
    p.add_argument("--vllm", action="store_true", help="also start and measure vLLM CPU")
    p.add_argument(
        "--tm-extra", default="", help='more `tokenmill serve` flags, e.g. "--decode-steps 4"'
    )
    p.add_argument("--peer-url", help="measure this running server's /generative_scoring")
    return p.parse_args()


class Workload:
    """A fresh query per round; the items stay the same."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        self.rng = random.Random(0)
        self.args, self.vocab = args, vocab
        self.items = [self._ids(args.item_len) for _ in range(args.items)]

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(300, self.vocab - 300) for _ in range(n)]

    def query(self) -> list[int]:
        return self._ids(self.args.query_len)


async def score_once(session: aiohttp.ClientSession, url: str, path: str, body: dict) -> dict:
    async with session.post(url + path, json=body) as r:
        answer = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{path}: {r.status} {answer}")
        return answer


async def score_round(
    url: str, path: str, query: list[int], items: list[list[int]], **extra: object
) -> tuple[float, dict]:
    body = {"model": "m", "query": query, "items": items, "label_token_ids": LABELS, **extra}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        answer = await score_once(session, url, path, body)
        return time.perf_counter() - started, answer


async def completions_round(url: str, query: list[int], items: list[list[int]]) -> float:
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(item: list[int]) -> dict:
            body = {"model": "m", "prompt": query + item, "max_tokens": 1, "logprobs": 5,
                    "temperature": 0}  # fmt: skip
            return await score_once(session, url, "/v1/completions", body)

        started = time.perf_counter()
        await asyncio.gather(*(one(item) for item in items))
        return time.perf_counter() - started


def measure(url: str, path: str, work: Workload, rounds: int) -> dict[str, list[float]]:
    """items/s of `rounds` scoring and completions rounds (after one warm-up of each)."""
    n = len(work.items)
    asyncio.run(score_round(url, path, work.query(), work.items))
    asyncio.run(completions_round(url, work.query(), work.items))
    figures: dict[str, list[float]] = {path: [], "/v1/completions": []}
    for _ in range(rounds):
        seconds, _ = asyncio.run(score_round(url, path, work.query(), work.items))
        figures[path].append(n / seconds)
        seconds = asyncio.run(completions_round(url, work.query(), work.items))
        figures["/v1/completions"].append(n / seconds)
    return figures


def report(name: str, figures: dict[str, list[float]]) -> dict[str, float]:
    means = {}
    for path, values in figures.items():
        means[path] = sum(values) / len(values)
        rounds = ", ".join(f"{v:.1f}" for v in values)
        print(f"{name:<10}{path:<22}{means[path]:9.1f} items/s   (rounds: {rounds})", flush=True)
    return means


def check_prompts(work: Workload) -> tuple[list[int], list[list[int]]]:
    """A fixed short query and 8 items, for comparing values across servers."""
    return work.items[-1], work.items[:8]


def first_label_probabilities(url: str, path: str, work: Workload) -> list[float]:
    """P(first label) of the check prompts, through `path`, unnormalised."""
    query, items = check_prompts(work)
    _, answer = asyncio.run(score_round(url, path, query, items, apply_softmax=False))
    if "scores" in answer:
        return [row[0] for row in answer["scores"]]
    return [d["score"] for d in answer["data"]]


def transformers_logprobs(model: Path, work: Workload, dtype: str) -> list[float]:
    """log P(first label) of the check prompts by transformers in `dtype`."""
    import torch

    from tokenmill.cli.gguf_checkpoint import transformers_model

    lm = transformers_model(Path(model), getattr(torch, dtype))
    query, items = check_prompts(work)
    values = []
    with torch.no_grad():
        for item in items:
            logits = lm.eval()(torch.tensor([query + item])).logits[0, -1].float()
            values.append(float(torch.log_softmax(logits, -1)[LABELS[0]]))
    return values


def distances(
    model: Path, work: Workload, args: argparse.Namespace, **servers: list[float]
) -> None:
    """How far each server's log P(first label) is from transformers in float32."""
    exact = transformers_logprobs(model, work, "float32")
    theirs = {f"transformers {args.dtype}": transformers_logprobs(model, work, args.dtype)}
    theirs.update({k: [math.log(p) for p in v] for k, v in servers.items()})
    parts = []
    for name, values in theirs.items():
        errors = [abs(a - b) for a, b in zip(values, exact, strict=True)]
        parts.append(f"{name} {sum(errors) / len(errors):.3f} ({max(errors):.3f})")
    print("log P(first label) on 8 check prompts, mean (largest) distance from transformers "
          "float32: " + ", ".join(parts), flush=True)  # fmt: skip


def request_arithmetic(config: ModelConfig, args: argparse.Namespace) -> tuple[float, float]:
    """The least arithmetic one request needs, in FLOP: the products' (every layer for the
    query's and the items' tokens, except that past its keys and values the last layer and
    the lm_head need each item's last token only) and q.k's (p.V's is the same): each item
    token sees the query and its item's tokens up to itself, each query token the query's
    tokens up to itself."""
    layers = config.num_layers
    kv, q_kv, rest = (2 * n for n in layer_multiply_adds(config))
    layer = q_kv + rest
    item_tokens = args.items * args.item_len
    tokens = args.query_len + item_tokens
    products = tokens * ((layers - 1) * layer + kv)
    products += args.items * (layer - kv + 2 * config.hidden_size * config.vocab_size)
    item_keys = args.query_len + (args.item_len + 1) / 2  # what an item token sees, on average
    query_keys = (args.query_len + 1) / 2
    per_key = 2 * config.num_heads * config.head_dim
    seen = (layers - 1) * (item_tokens * item_keys + args.query_len * query_keys)
    seen += args.items * (args.query_len + args.item_len)  # the last layer: items' last tokens
    return products, seen * per_key


def print_bound(model: Path, args: argparse.Namespace, **servers: float) -> None:
    """The request's arithmetic at this machine's peak rates (cpu_peak.py), and how close
    each server's items/s come to it: tokenmill's AVX-512 kernels run the products and q.k in
    bfloat16 pairs (VDPBF16PS) and p.V in float32 multiply-adds, float32 all three so; on AMX
    tiles all three are tile products, p.V twice (its weights' two bfloat16 parts)."""
    try:
        peaks = cpu_peak.measure(rounds=3)
    except SystemExit as why:  # cpu_peak.cpp needs AVX-512
        print(f"no arithmetic bound here: {str(why).splitlines()[0]}", flush=True)
        return
    bf16, f32 = peaks["VDPBF16PS (bfloat16)"], peaks["VFMADD231PS (float32)"]
    tiles = peaks["TDPBF16PS (AMX tiles)"]
    assert f32 is not None
    products, qk = request_arithmetic(load_model_config(model), args)
    if args.dtype == "bfloat16" and amx_enabled() and tiles is not None:
        pairs, seconds = tiles, (products + 3 * qk) / (tiles * 1e9)
    else:
        pairs = bf16 if args.dtype == "bfloat16" and bf16 is not None else f32
        seconds = (products + qk) / (pairs * 1e9) + qk / (f32 * 1e9)
    bound = args.items / seconds
    shares = ", ".join(f"{name} {rate / bound:.0%}" for name, rate in servers.items())
    print(f"arithmetic bound: {products / 1e12:.3f} TFLOP of products and {qk / 1e9:.1f} GFLOP "
          f"each of q.k and p.V at {pairs:.0f} / {f32:.0f} GFLOP/s (cpu_peak.py here) take "
          f"{seconds:.2f} s a request = {bound:.1f} items/s (the softmax not counted); "
          f"reached: {shares}", flush=True)  # fmt: skip
    if "peer" in servers:
        print(f"1.5x the peer would be {1.5 * servers['peer'] / bound:.0%} of the bound",
              flush=True)  # fmt: skip


def main() -> int:
    args = parse_args()
    model = resolve_model(args)
    work = Workload(args, load_model_config(model).vocab_size)
    logs = Path(tempfile.mkdtemp(prefix="tokenmill-scoring-"))
    print(f"{args.items} items x {args.item_len} tokens after a {args.query_len}-token query; "
          f"{model} ({args.dtype}); logs in {logs}", flush=True)  # fmt: skip
    proc, url = start_server(
        model,
        ["--dtype", args.dtype, "--served-model-name", "m", "--max-model-len", "2048"]
        + shlex.split(args.tm_extra),
        logs / "tokenmill.log",
    )
    try:
        ours = report("tokenmill", measure(url, "/v1/score", work, args.rounds))
        our_values = first_label_probabilities(url, "/v1/score", work)
    finally:
        stop_server(proc)
    print(f"tokenmill /v1/score vs its own completions: "
          f"{ours['/v1/score'] / ours['/v1/completions']:.2f}x", flush=True)  # fmt: skip
    peer_url, peer = args.peer_url, None
    if args.vllm and peer_url is None:
        peer = start_vllm(model, args.dtype, logs / "vllm.log")
        peer_url = peer.url
    if peer_url is None:
        distances(model, work, args, tokenmill=our_values)
        print_bound(model, args, tokenmill=ours["/v1/score"])
        return 0
    try:
        theirs = report("peer", measure(peer_url, "/generative_scoring", work, args.rounds))
        their_values = first_label_probabilities(peer_url, "/generative_scoring", work)
    finally:
        if peer is not None:
            stop(peer)
    print(f"tokenmill /v1/score vs peer /generative_scoring: "
          f"{ours['/v1/score'] / theirs['/generative_scoring']:.2f}x; completions: "
          f"{ours['/v1/completions'] / theirs['/v1/completions']:.2f}x", flush=True)  # fmt: skip
    distances(model, work, args, tokenmill=our_values, peer=their_values)
    print_bound(model, args, tokenmill=ours["/v1/score"], peer=theirs["/generative_scoring"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
