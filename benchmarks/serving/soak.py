"""A bounded soak: mixed traffic against one server for a few minutes, then its state.

--concurrency clients loop until --duration ends, each picking at random: a streamed
completion with top-5 logprobs, a stream it abandons after a few chunks, an invalid
request, a chat request with n=2, a scoring request, a /generate with prompt logprobs.
Printed: the requests by kind and HTTP status, the 5xx count (target 0), KV slots in use
once idle (target 0), and the resident memory of every server process at the start (after
a warm-up) and at the end.

    python benchmarks/serving/soak.py [--duration 180] [--preset small|medium | --model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
from server import read_metrics, settled_metrics, start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.checkpoints import add_model_args, resolve_model  # noqa: E402

INVALID = [
    {"prompt": "x", "max_tokens": -1},
    {"prompt": "x", "temperature": "hot"},
    {"prompt": [1, "a"]},
    {"prompt": "x", "logprobs": 99},
    {"prompt": "x", "unknown_field": 1},
    {"prompt": "x", "stream_options": {"include_usage": True}},
    {"model": "not-this-one", "prompt": "x"},
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "small")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="more `tokenmill serve` flags, quoted")
    return p.parse_args()


def rss_mib(pid: int) -> dict[str, float]:
    """Resident MiB of `pid` and of every process below it, by command."""
    found: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(entry.name) == pid or _descends(int(stat[1]), pid):
            rss = int(stat[21]) * 4096 / 2**20
            name = next((c.decode() for c in cmd if c.startswith(b"tokenmill.")), "frontend")
            found[f"{name}[{entry.name}]"] = rss
    return found


def _descends(ppid: int, root: int) -> bool:
    while ppid > 1:
        if ppid == root:
            return True
        try:
            ppid = int(Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random) -> tuple[str, int]:
    kind = rng.choices(
        ["stream", "abandon", "invalid", "chat", "score", "prompt_logprobs"],
        weights=[40, 15, 15, 15, 10, 5],
    )[0]
    vocabulary = ["alpha", "beta", "gamma", "delta"]
    words = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(3, 60)))
    if kind in ("stream", "abandon"):
        body = {"prompt": words, "max_tokens": rng.randint(1, 64), "logprobs": 5, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as r:
            chunks = 0
            async for _ in r.content:
                chunks += 1
                if kind == "abandon" and chunks >= 3:
                    break  # NOTE: leaving the block closes the connection: the client is gone
            return kind, r.status
    if kind == "invalid":
        path, body = "/v1/completions", rng.choice(INVALID)
    elif kind == "chat":
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": words}], "n": 2, "max_tokens": 16}
    elif kind == "score":
        path = "/v1/score"
        items = [words[: rng.randint(1, 40)] for _ in range(rng.randint(1, 8))]
        body = {"query": words, "items": items, "label_token_ids": [5, 6]}
    else:
        path = "/generate"
        body = {"text": words, "return_logprob": True, "logprob_start_len": 0,
                "top_logprobs_num": 5, "sampling_params": {"max_new_tokens": 8}}  # fmt: skip
    async with session.post(url + path, json=body) as r:
        await r.read()
        return kind, r.status


async def soak(url: str, args: argparse.Namespace) -> Counter[tuple[str, int]]:
    counts: Counter[tuple[str, int]] = Counter()
    deadline = time.monotonic() + args.duration
    timeout = aiohttp.ClientTimeout(total=300)

    async def client(n: int) -> None:
        rng = random.Random(args.seed * 1000 + n)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < deadline:
                counts[await one(session, url, rng)] += 1

    await asyncio.gather(*(client(n) for n in range(args.concurrency)))
    return counts


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(url)
        busy = metrics["tokenmill_num_requests_running"] + metrics["tokenmill_num_requests_waiting"]
        if (busy == 0 and metrics["tokenmill_kv_slots_used"] == 0) or time.monotonic() > deadline:
            return settled_metrics(url)
        time.sleep(0.2)


def main() -> int:
    args = parse_args()
    model = resolve_model(args)
    log = Path(tempfile.mkdtemp(prefix="tokenmill-soak-")) / "server.log"
    print(f"serving {model} (log: {log}) ...", flush=True)
    server_args = ["--max-running-requests", "32", *args.server_args.split()]
    proc, url = start_server(model, server_args, log)
    try:
        warm = argparse.Namespace(**{**vars(args), "duration": 5.0})
        asyncio.run(soak(url, warm))
        start_metrics = wait_idle(url)
        start = rss_mib(proc.pid)
        started = time.monotonic()
        counts = asyncio.run(soak(url, args))
        elapsed = time.monotonic() - started
        end_metrics = wait_idle(url)
        end = rss_mib(proc.pid)
    finally:
        code = stop_server(proc)
    total = sum(counts.values())
    print(f"\n{total} requests in {elapsed:.0f} s, {args.concurrency} clients")
    for (kind, status), n in sorted(counts.items()):
        print(f"  {kind:<16} HTTP {status}: {n}")
    print(f"5xx: {sum(n for (_, status), n in counts.items() if status >= 500)}")
    print(f"KV slots in use once idle: {end_metrics['tokenmill_kv_slots_used']:.0f}")
    cached = (m["tokenmill_prefix_cache_tokens"] for m in (start_metrics, end_metrics))
    print("tokens the prefix cache holds, start -> end: {:.0f} -> {:.0f}".format(*cached))
    print("resident MiB, start -> end:")
    for name in sorted(start):
        print(f"  {name:<40} {start[name]:8.1f} -> {end.get(name, float('nan')):8.1f}")
    print(f"server exit status on SIGTERM: {code}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
