"""`tokenmill bench` client logic against a fake OpenAI-compatible server (no model, no engine).

The fake streams SSE chunks with known delays, and fails on demand: the prompt names the
scenario. It runs in a thread with its own event loop, so the client's asyncio.run and the
command's main() are tested as users call them. Timings are asserted as lower bounds and
orderings, which hold on a loaded machine.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from tokenmill.cli.bench.client import (
    BenchOptions,
    RequestResult,
    chat_body,
    completions_body,
    run_requests,
)
from tokenmill.cli.bench.datasets import BenchRequest, load_dataset
from tokenmill.cli.bench.metrics import compute_metrics, tpot
from tokenmill.cli.main import main as cli_main

FIRST_DELAY = 0.2  # seconds before the first content chunk ("slow" scenario)
GAP = 0.1  # seconds between content chunks ("slow" scenario)


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(chat: bool, text: str) -> dict:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"choices": [choice]}


class FakeServer:
    """Streams max_tokens one-word chunks; the prompt (or message) picks the scenario."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        scenario = prompt if isinstance(prompt, str) else "ok"
        if scenario == "http500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return await self._stream(request, body, chat, prompt, scenario)

    async def _stream(self, request, body, chat, prompt, scenario) -> web.StreamResponse:
        if scenario == "slow":
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if chat:  # a role-only chunk first: no content, must not count as the first token
            await response.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        num_tokens = body["max_tokens"]
        for i in range(num_tokens):
            delay = {"slow": FIRST_DELAY if i == 0 else GAP, "timeout": 5.0}.get(scenario, 0.005)
            await asyncio.sleep(delay)
            await response.write(_sse(_chunk(chat, f" w{i}")))
            if scenario == "broken" and i == 1:
                request.transport.close()
                return response
            if scenario == "error-event" and i == 1:
                await response.write(_sse({"error": {"message": "engine died"}}))
                return response
        if scenario == "slow":  # before the end: the client may start the next one after it
            self.in_flight -= 1
        if scenario != "no-usage":
            prompt_len = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            usage = {"prompt_tokens": prompt_len, "completion_tokens": num_tokens}
            await response.write(_sse({"choices": [], "usage": usage}))
        if scenario != "no-done":
            await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, FakeServer]]:
    """(base URL, FakeServer) on a free loopback port, served from a background thread."""
    server = FakeServer()
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/completions", server.generate)
    app.router.add_post("/v1/chat/completions", server.generate)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", server
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _run(url: str, prompts: list, output_len: int = 4, endpoint: str = "completions", **kw):
    opts = BenchOptions(base_url=url, model="fake-model", timeout=kw.pop("timeout", 30.0))
    requests = [BenchRequest(p, 3, output_len) for p in prompts]
    return asyncio.run(run_requests(requests, opts, endpoint, **kw))


def test_failures_are_counted_not_raised(fake) -> None:
    url, _ = fake
    prompts = ["ok"] * 4 + ["http500", "broken", "error-event", "no-done", "timeout"]
    results, duration = _run(url, prompts, timeout=1.0)
    assert [r.success for r in results] == [True] * 4 + [False] * 5
    errors = [r.error for r in results[4:]]
    assert errors[0].startswith("HTTP 500") and "boom" in errors[0]
    assert errors[1]  # aiohttp's payload error, whatever its words
    assert errors[2] == "error event: engine died"
    assert "[DONE]" in errors[3]
    assert errors[4] == "timeout after 1 s"
    metrics = compute_metrics(results, duration)
    assert (metrics.completed, metrics.failed) == (4, 5)
    assert sum(metrics.errors.values()) == 5
    assert metrics.total_output_tokens == 16  # failed requests' tokens do not count


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_times(fake, endpoint: str) -> None:
    url, _ = fake
    (result,), _ = _run(url, ["slow"], output_len=4, endpoint=endpoint)
    assert result.success, result.error
    assert result.num_chunks == 4 and result.output_len == 4 and result.prompt_len == 1
    assert len(result.itl) == 3
    # Only lower bounds from the server's sleeps hold however loaded the machine (a stalled
    # client may read two chunks at once); 10 ms of slack for timer granularity. A chat
    # stream's role-only chunk comes at once: the TTFT bound shows it is not counted.
    assert result.ttft >= FIRST_DELAY - 0.01
    assert all(gap >= 0 for gap in result.itl)
    last_chunk = result.ttft + sum(result.itl)
    assert FIRST_DELAY + 3 * GAP - 0.01 <= last_chunk <= result.latency
    assert tpot(result) == pytest.approx((result.latency - result.ttft) / 3)


def test_output_len_falls_back_to_chunks(fake) -> None:
    url, _ = fake
    (result,), _ = _run(url, ["no-usage"], output_len=5)
    assert result.success and result.output_len == 5 and result.prompt_len == 3


def test_max_concurrency_is_respected(fake) -> None:
    url, server = fake
    server.max_in_flight = 0
    results, _ = _run(url, ["slow"] * 6, output_len=2, max_concurrency=2)
    assert all(r.success for r in results)
    assert server.max_in_flight == 2


def test_percentiles_match_numpy() -> None:
    rng = np.random.default_rng(0)
    results = []
    for _ in range(50):
        itl = rng.uniform(0.01, 0.05, size=9).tolist()
        ttft = float(rng.uniform(0.1, 1.0))
        results.append(RequestResult(True, "", 7, 10, ttft, itl, ttft + sum(itl), 10))
    results.append(RequestResult(error="x"))
    m = compute_metrics(results, duration_s=4.0)
    ttfts = np.array([r.ttft for r in results[:-1]]) * 1000
    itls = np.array([g for r in results[:-1] for g in r.itl]) * 1000
    tpots = np.array([(r.latency - r.ttft) / 9 for r in results[:-1]]) * 1000
    for stats, data in ((m.ttft_ms, ttfts), (m.itl_ms, itls), (m.tpot_ms, tpots)):
        assert stats.mean == pytest.approx(data.mean())
        assert stats.median == pytest.approx(np.median(data))
        assert stats.p99 == pytest.approx(np.percentile(data, 99))
    assert (m.completed, m.failed, m.errors) == (50, 1, {"x": 1})
    assert m.request_throughput == pytest.approx(12.5)
    assert m.input_throughput == pytest.approx(50 * 7 / 4)
    assert m.output_throughput == pytest.approx(50 * 10 / 4)


def test_request_bodies() -> None:
    req = BenchRequest([11, 12], 2, 8)
    opts = BenchOptions(base_url="x", model="m", logprobs=5, prompt_logprobs=True, ignore_eos=True)
    body = completions_body(req, opts)
    assert body["prompt"] == [11, 12] and body["max_tokens"] == 8
    assert (body["logprobs"], body["echo"], body["ignore_eos"]) == (5, True, True)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    off = completions_body(req, BenchOptions(base_url="x", model="m"))
    assert "logprobs" not in off and "echo" not in off and "ignore_eos" not in off
    chat = chat_body(BenchRequest("hi", 1, 8), BenchOptions(base_url="x", model="m", logprobs=5))
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 5)
    sampled = chat_body(BenchRequest("hi", 1, 8), BenchOptions("x", "m", logprobs=-1))
    assert sampled["logprobs"] is True and "top_logprobs" not in sampled
    assert completions_body(req, BenchOptions("x", "m", logprobs=-1))["logprobs"] == 0


def test_random_prompts_have_exact_length(fake) -> None:
    requests = load_dataset("random", num_prompts=5, input_len=37, output_len=3, seed=1)
    assert all(len(r.prompt) == 37 == r.prompt_len for r in requests)
    assert all(10 <= t < 1000 for r in requests for t in r.prompt)
    again = load_dataset("random", num_prompts=5, input_len=37, output_len=3, seed=1)
    assert [r.prompt for r in again] == [r.prompt for r in requests]
    url, server = fake
    results, _ = asyncio.run(
        run_requests(requests, BenchOptions(base_url=url, model="fake-model"), "completions")
    )
    assert [r.prompt_len for r in results] == [37] * 5  # as the server counted them
    assert server.bodies[-1]["prompt"] in [r.prompt for r in requests]


def test_shared_prefix_dataset() -> None:
    requests = load_dataset(
        "shared-prefix", num_prompts=4, input_len=5, output_len=2, prefix_len=20, seed=0
    )
    prefix = requests[0].prompt[:20]
    assert all(r.prompt[:20] == prefix and len(r.prompt) == 25 == r.prompt_len for r in requests)
    assert len({tuple(r.prompt[20:]) for r in requests}) == 4
    chat = load_dataset(
        "shared-prefix", num_prompts=2, input_len=5, output_len=2, prefix_len=20, as_text=True
    )
    words = [r.prompt.split() for r in chat]
    assert words[0][:20] == words[1][:20] and all(len(w) == 25 for w in words)


def test_jsonl_dataset(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "a b c"}, {"prompt": [11, 12], "output_len": 9}, {"prompt": "d"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    requests = load_dataset(str(path), num_prompts=2, input_len=1, output_len=4)
    assert requests == [BenchRequest("a b c", 3, 4), BenchRequest([11, 12], 2, 9)]
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        load_dataset(str(path), num_prompts=2, input_len=1, output_len=4)


def test_command_writes_json(fake, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url, server = fake
    out = tmp_path / "result.json"
    argv = ["bench", "--base-url", url, "--num-prompts", "6", "--input-len", "16"]
    argv += ["--output-len", "3", "--max-concurrency", "3", "--request-rate", "200"]
    argv += ["--logprobs", "5", "--ignore-eos", "--json", str(out), "--disable-progress"]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"]) == (6, 0)
    assert report["total_input_tokens"] == 6 * 16 and report["total_output_tokens"] == 18
    assert report["config"]["model"] == "fake-model"  # from /v1/models
    assert set(report["ttft_ms"]) == {"mean", "median", "p99"}
    assert server.bodies[-1]["logprobs"] == 5 and server.bodies[-1]["ignore_eos"] is True
    assert "Successful requests:" in capsys.readouterr().out


def test_command_rejects_chat_prompt_logprobs(capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["bench", "--endpoint", "chat", "--prompt-logprobs"]) == 2
    assert "--prompt-logprobs" in capsys.readouterr().err
