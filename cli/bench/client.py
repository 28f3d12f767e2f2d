"""The HTTP side of `tokenmill bench` (client process): streamed requests and their timings.

One function per endpoint sends a request with `stream: true` and times the server-sent
events as they arrive; `run_requests` drives many of them with a concurrency cap and Poisson
arrivals. Any failure (HTTP error, broken stream, error event, timeout) becomes a failed
RequestResult with its error text: a benchmark run never dies of one bad request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from tokenmill.cli.bench.datasets import BenchRequest

logger = logging.getLogger(__name__)

ERROR_TEXT_MAX = 500


@dataclass(frozen=True)
class BenchOptions:
    """What every request of a run shares."""

    base_url: str
    """Server root, e.g. http://127.0.0.1:8000 (the /v1/... paths are added)."""
    model: str
    """The `model` field of every request."""
    logprobs: int = 0
    """0 = off; K > 0 = top K alternatives; -1 = the sampled token's logprob only."""
    prompt_logprobs: bool = False
    """Completions only: `echo: true` with logprobs, so the prompt is scored as well."""
    ignore_eos: bool = False
    """Send `ignore_eos: true` (vLLM, SGLang, tokenmill) so every output is output_len long."""
    temperature: float = 0.0
    """Sampling temperature."""
    timeout: float = 600.0
    """Seconds one request may take, streaming included."""


@dataclass
class RequestResult:
    """How one request went; times in seconds from the moment it was sent."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    """Prompt tokens: the server's usage when it reports one, else the dataset's count."""
    output_len: int = 0
    """Generated tokens: the server's usage, else the number of content chunks."""
    ttft: float = 0.0
    """Time to the first chunk that carries text or tokens."""
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive content chunks."""
    latency: float = 0.0
    """Time to the end of the stream."""
    num_chunks: int = 0
    """Content chunks received."""


def completions_body(req: BenchRequest, opts: BenchOptions) -> dict[str, Any]:
    """The /v1/completions request for `req`."""
    body: dict[str, Any] = {"model": opts.model, "prompt": req.prompt}
    body.update(_common_fields(req, opts))
    if opts.logprobs != 0 or opts.prompt_logprobs:
        body["logprobs"] = max(opts.logprobs, 0)
    if opts.prompt_logprobs:
        body["echo"] = True
    return body


def chat_body(req: BenchRequest, opts: BenchOptions) -> dict[str, Any]:
    """The /v1/chat/completions request for `req` (a text prompt, one user message)."""
    if not isinstance(req.prompt, str):
        raise ValueError("chat needs text prompts, not token ids")
    body: dict[str, Any] = {
        "model": opts.model,
        "messages": [{"role": "user", "content": req.prompt}],
    }
    body.update(_common_fields(req, opts))
    if opts.logprobs != 0:
        body["logprobs"] = True
    if opts.logprobs > 0:
        body["top_logprobs"] = opts.logprobs
    return body


def _common_fields(req: BenchRequest, opts: BenchOptions) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "max_tokens": req.output_len,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        fields["ignore_eos"] = True
    return fields


def _has_content(chunk: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries generated (or echoed) text or tokens."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
        logprobs = choice.get("logprobs") or {}
        if logprobs.get("tokens") or logprobs.get("content"):
            return True
    return False


class RequestFailed(Exception):
    """The server answered, but not with a complete stream (its message says how)."""


def _error_text(e: Exception) -> str:
    if isinstance(e, RequestFailed):
        text = str(e)
    else:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return text[:ERROR_TEXT_MAX]


async def _sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, payload) of each `data:` line of an event stream.

    NOTE: split by hand rather than with readline: aiohttp refuses lines over 128 KiB, and a
    chunk with top-20 logprobs of an echoed prompt is longer than that.
    """
    buffer = b""
    async for data in response.content.iter_any():
        now = time.perf_counter()
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            text = line.decode("utf-8").strip()
            if text.startswith("data:"):
                yield now, text[5:].strip()
    if buffer.strip().startswith(b"data:"):
        yield time.perf_counter(), buffer.decode("utf-8").strip()[5:].strip()


async def _read_stream(
    response: aiohttp.ClientResponse, result: RequestResult, start: float
) -> None:
    """Fill `result` from the event stream; raise RequestFailed on an error event."""
    last = start
    done = False
    async for now, payload in _sse_data(response):
        if payload == "[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise RequestFailed(f"error event: {message}")
        if _has_content(chunk):
            if result.num_chunks == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            result.num_chunks += 1
            last = now
        usage = chunk.get("usage")
        if usage:
            result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
            result.output_len = usage.get("completion_tokens", result.output_len)
    if not done:
        raise RequestFailed("the stream ended without data: [DONE]")


async def _post_streaming(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    req: BenchRequest,
    opts: BenchOptions,
) -> RequestResult:
    result = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    try:
        timeout = aiohttp.ClientTimeout(total=opts.timeout)
        async with session.post(url, json=body, timeout=timeout) as response:
            if response.status != 200:
                text = (await response.text(errors="replace"))[:ERROR_TEXT_MAX]
                raise RequestFailed(f"HTTP {response.status}: {text}")
            await _read_stream(response, result, start)
    except asyncio.TimeoutError:
        result.error = f"timeout after {opts.timeout:g} s"
    except Exception as e:  # NOTE: every failure is counted, none ends the run
        result.error = _error_text(e)
    result.latency = time.perf_counter() - start
    if result.error:
        return result
    if result.num_chunks == 0:  # nothing generated (e.g. an immediate end of sequence)
        result.ttft = result.latency
    if result.output_len == 0:
        result.output_len = result.num_chunks
    result.success = True
    return result


async def request_completions(
    session: aiohttp.ClientSession, req: BenchRequest, opts: BenchOptions
) -> RequestResult:
    """Send `req` to /v1/completions, streamed, and time it."""
    url = opts.base_url.rstrip("/") + "/v1/completions"
    return await _post_streaming(session, url, completions_body(req, opts), req, opts)


async def request_chat(
    session: aiohttp.ClientSession, req: BenchRequest, opts: BenchOptions
) -> RequestResult:
    """Send `req` to /v1/chat/completions, streamed, and time it."""
    url = opts.base_url.rstrip("/") + "/v1/chat/completions"
    try:
        body = chat_body(req, opts)
    except ValueError as e:
        return RequestResult(error=str(e), prompt_len=req.prompt_len)
    return await _post_streaming(session, url, body, req, opts)


RequestFn = Callable[[aiohttp.ClientSession, BenchRequest, BenchOptions], Awaitable[RequestResult]]
ENDPOINTS: dict[str, RequestFn] = {"completions": request_completions, "chat": request_chat}


async def fetch_model_id(base_url: str, timeout: float = 30.0) -> str:
    """The first model id that GET /v1/models lists; RuntimeError saying why when none."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(url) as response,
        ):
            if response.status != 200:
                raise RequestFailed(f"HTTP {response.status}")
            models = (await response.json())["data"]
            return models[0]["id"]
    except Exception as e:
        raise RuntimeError(f"GET {url}: {_error_text(e)} (pass --model NAME?)") from e


class _LineProgress:
    """A one-line progress counter on stderr, for when tqdm is not installed."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self._write()

    def _write(self) -> None:
        sys.stderr.write(f"\rrequests: {self.done}/{self.total}")
        sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        self.done += n
        self._write()

    def close(self) -> None:
        sys.stderr.write("\n")


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(total: int, enabled: bool) -> Any:
    """A progress bar with update() and close(): tqdm's when installed, else a line counter."""
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineProgress(total)
    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)


async def _arrivals(
    requests: list[BenchRequest], request_rate: float, seed: int
) -> AsyncIterator[BenchRequest]:
    """The requests, spaced by exponential gaps of mean 1/rate (a Poisson process)."""
    rng = np.random.default_rng(seed)
    for i, req in enumerate(requests):
        if i > 0 and math.isfinite(request_rate) and request_rate > 0:
            await asyncio.sleep(rng.exponential(1.0 / request_rate))
        yield req


async def run_requests(
    requests: list[BenchRequest],
    opts: BenchOptions,
    endpoint: str = "completions",
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    show_progress: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send all `requests`; return their results (in order) and the run's wall time."""
    send = ENDPOINTS[endpoint]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = make_progress(len(requests), show_progress)

    async def one(session: aiohttp.ClientSession, req: BenchRequest) -> RequestResult:
        if limit is None:
            result = await send(session, req, opts)
        else:
            async with limit:
                result = await send(session, req, opts)
        progress.update(1)
        return result

    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(one(session, req))
            async for req in _arrivals(requests, request_rate, seed)
        ]
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    progress.close()
    return results, duration
