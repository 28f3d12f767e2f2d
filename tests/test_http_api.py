"""The HTTP API over a fake engine: a real aiohttp server on a loopback port, driven by the
real `openai` client and by raw HTTP. The fake "generates" by cycling through the prompt ids
(offset by the seed) with made-up logprobs, so every response can be predicted.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.frontend.api.chat_template import ChatTemplate, ChatTemplateError
from tokenmill.frontend.app.routes import bound_port, build_app, start_http
from tokenmill.frontend.engine.client import EngineDeadError, EngineStats
from tokenmill.frontend.server_config import (
    HttpArgs,
    ModelArgs,
    SchedulerArgs,
    ScoringArgs,
    ServerConfig,
)
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.protocol.arrays import unpack
from tokenmill.protocol.outputs import DetokenizedOutput, PositionLogprobs, TokenEntry
from tokenmill.protocol.requests import GenerateRequest

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256


class FakeEngine:
    """An EngineClient that echoes prompt ids; records requests, aborts and early closes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.stats = EngineStats(kv_slots_total=1000, kv_slots_free=900)
        self.draining = False
        self.tokenizer = tokenizer
        self.requests: dict[str, GenerateRequest] = {}
        self.outputs: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.closed: list[str] = []
        self.delay = 0.0
        self.fail_with: str | None = None  # finish every request with "error" and this detail
        self.fail_reason = "error"  # or how the engine turns a request away
        self.fail_after = 0  # tokens sent before the failure
        self.dead = False

    def entry(self, token_id: int, logprob: float | None) -> TokenEntry:
        text = self.tokenizer.token_text(token_id)
        special = token_id < 5
        return TokenEntry(token_id, text, None if special else text.encode(), logprob)

    def position(self, token_id: int, logprob: float, request: GenerateRequest) -> PositionLogprobs:
        lp = request.logprobs
        top = [self.entry((token_id + j) % 300, -0.5 * (j + 1)) for j in range(lp.num_top)]
        ids_lps = [-1.0 - j for j in range(len(lp.token_ids))]
        return PositionLogprobs(self.entry(token_id, logprob), top, ids_lps)

    def prompt_logprobs(self, request: GenerateRequest) -> list[PositionLogprobs]:
        ids = unpack(request.input_ids).tolist()
        start = request.logprobs.prompt_start
        if start < 0:
            return []
        return [
            PositionLogprobs(self.entry(ids[0], None))
            if i == 0
            else self.position(ids[i], -1.0 - 0.01 * i, request)
            for i in range(start, len(ids))
        ]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[DetokenizedOutput]:
        if self.dead:
            raise EngineDeadError("dead")
        self.requests[request.req_id] = request
        self.outputs[request.req_id] = []
        finished = False
        try:
            async for out in self._run(request):
                finished = out.finish_reason is not None
                yield out
        finally:
            if not finished:
                self.closed.append(request.req_id)

    async def _run(self, request: GenerateRequest) -> AsyncIterator[DetokenizedOutput]:
        ids = unpack(request.input_ids).tolist()
        s, lp = request.sampling, request.logprobs
        common = {"num_prompt_tokens": len(ids), "num_cached_tokens": 2}
        prompt_lps = self.prompt_logprobs(request)
        if self.fail_with is not None:
            for k in range(self.fail_after):
                yield DetokenizedOutput(request.req_id, "x", [ids[0]], num_output_tokens=k + 1)
            yield DetokenizedOutput(
                request.req_id,
                "",
                [],
                finish_reason=self.fail_reason,
                finish_detail=self.fail_with,
                **common,
            )
            return
        if s.max_tokens == 0:
            yield DetokenizedOutput(request.req_id, "", [], [], prompt_lps, "length", **common)
            return
        text = ""
        for k in range(s.max_tokens):
            await asyncio.sleep(self.delay)
            token_id = ids[(k + s.seed) % len(ids)]
            self.outputs[request.req_id].append(token_id)
            skip = request.detokenize.skip_special_tokens
            delta = self.tokenizer.decode([token_id], skip_special_tokens=skip)
            text += delta
            finish, detail = None, None
            if token_id in s.stop_token_ids and not s.ignore_eos:
                finish, detail = "stop", str(token_id)
            elif k + 1 == s.max_tokens:
                finish = "length"
            logprobs = []
            if lp.return_logprob or lp.token_ids:
                logprobs = [self.position(token_id, -0.25 * (k % 4 + 1), request)]
            yield DetokenizedOutput(
                request.req_id, delta, [token_id], logprobs, prompt_lps if k == 0 else [],
                finish, detail, num_output_tokens=k + 1, **common,
            )  # fmt: skip
            if finish is not None:
                return

    async def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)


class Server:
    """build_app + start_http on 127.0.0.1:0, in a thread with its own event loop."""

    def __init__(self, model_dir: Path, http: HttpArgs | None = None) -> None:
        self.tokenizer = Tokenizer(model_dir)
        self.engine = FakeEngine(self.tokenizer)
        config = ServerConfig(
            model=ModelArgs(model=str(model_dir), served_model_name=MODEL),
            scheduler=SchedulerArgs(max_logprobs=5),
            scoring=ScoringArgs(rerank_labels="y,n", max_score_items=8),
            http=http or HttpArgs(),
        )
        self.app = build_app(config, self.engine, self.tokenizer, max_model_len=MAX_MODEL_LEN)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10), "server did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = self.loop.run_until_complete(start_http(self.app, "127.0.0.1", 0))
        self.port = bound_port(self.runner)
        ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        future = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
        future.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        status, _, answer = self.request_with_headers(method, path, body)
        return status, answer

    def request_with_headers(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, Any]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                status, raw, got = resp.status, resp.read(), resp.headers
        except urllib.error.HTTPError as e:
            status, raw, got = e.code, e.read(), e.headers
        kind = got["Content-Type"] or ""
        return status, got, json.loads(raw) if "json" in kind else raw.decode()

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        return self.request("POST", path, body)

    def sse(self, path: str, body: dict[str, Any]) -> list[Any]:
        status, text = self.post(path, body)
        assert status == 200, text
        events = [line[len("data: ") :] for line in text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def fake_server(tiny_checkpoint) -> Server:
    s = Server(tiny_checkpoint("llama"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fake_client(fake_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(autouse=True)
def reset_engine(fake_server: Server):
    fake_server.engine.delay, fake_server.engine.fail_with, fake_server.engine.dead = (
        0.0,
        None,
        False,
    )
    fake_server.engine.stats.alive = True
    yield


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "def main(): return"},
]


def chat_ids(fake_server: Server, messages: list[dict[str, Any]]) -> list[int]:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    text = "<|begin_of_text|>" + text + "<|im_start|>assistant\n"
    return fake_server.tokenizer.encode(text, add_special_tokens=False)


def test_chat_with_logprobs(fake_server: Server, fake_client: openai.OpenAI) -> None:
    r = fake_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=3, seed=7
    )
    choice = r.choices[0]
    req = fake_server.engine.requests[r.id + "-0"]
    assert unpack(req.input_ids).tolist() == chat_ids(fake_server, MESSAGES)
    assert req.sampling.seed == 7 and req.logprobs.num_top == 3 and req.logprobs.return_logprob
    out_ids = fake_server.engine.outputs[r.id + "-0"]
    assert choice.message.content == fake_server.tokenizer.decode(out_ids)
    assert choice.finish_reason == "length"
    content = choice.logprobs.content
    assert [c.token for c in content] == [fake_server.tokenizer.token_text(i) for i in out_ids]
    assert [c.logprob for c in content] == [-0.25 * (k % 4 + 1) for k in range(6)]
    for c, token_id in zip(content, out_ids, strict=True):
        assert len(c.top_logprobs) == 3
        assert c.top_logprobs[1].logprob == -1.0
        assert c.bytes == (None if token_id < 5 else list(c.token.encode()))
    assert r.usage.prompt_tokens == len(chat_ids(fake_server, MESSAGES))
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.usage.prompt_tokens_details.cached_tokens == 2


def test_chat_stream_matches_whole(fake_client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "n": 3, "seed": 11}
    whole = fake_client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    stream = fake_client.chat.completions.create(
        **kwargs, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True}
    )
    texts, logprobs, finish = ["", "", ""], [[], [], []], [None] * 3
    chunks = list(stream)
    for chunk in chunks[:-1]:
        assert chunk.usage is None and chunk.object == "chat.completion.chunk"
        (c,) = chunk.choices
        texts[c.index] += c.delta.content or ""
        if c.logprobs is not None:
            logprobs[c.index] += c.logprobs.content
        finish[c.index] = c.finish_reason or finish[c.index]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    for c in whole.choices:
        assert texts[c.index] == c.message.content and finish[c.index] == c.finish_reason
        assert logprobs[c.index] == c.logprobs.content
    assert len({c.message.content for c in whole.choices}) > 1, "choices should differ by seed"


def test_chat_content_parts_and_default_max_tokens(
    fake_server: Server, fake_client: openai.OpenAI
) -> None:
    parts = [{"type": "text", "text": "def main"}, {"type": "text", "text": "(): return"}]
    r = fake_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}]
    )
    req = fake_server.engine.requests[r.id + "-0"]
    ids = chat_ids(fake_server, [{"role": "user", "content": "def main(): return"}])
    assert unpack(req.input_ids).tolist() == ids
    assert req.sampling.max_tokens == MAX_MODEL_LEN - len(ids)
    assert 0 <= req.sampling.seed < 2**63
    assert r.choices[0].logprobs is None


def test_completion_echo_scores_prompt(fake_server: Server, fake_client: openai.OpenAI) -> None:
    prompt = "import os\nimport sys"
    r = fake_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    (choice,) = r.choices
    ids = fake_server.tokenizer.encode(prompt)
    assert choice.text == prompt
    lp = choice.logprobs
    assert lp.tokens == [fake_server.tokenizer.token_text(i) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([-1.0 - 0.01 * i for i in range(1, len(ids))])
    assert all(len(t) in (2, 3) for t in lp.top_logprobs[1:])
    # Offsets index the returned text: the bos token (no bytes) adds nothing to it.
    text_lens = [0 if i < 5 else len(t) for i, t in zip(ids, lp.tokens, strict=True)]
    assert lp.text_offset == list(np.cumsum([0] + text_lens[:-1]))
    for offset, token, i in zip(lp.text_offset, lp.tokens, ids, strict=True):
        assert i < 5 or choice.text[offset : offset + len(token)] == token
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)


def test_completion_batch_and_n(fake_server: Server, fake_client: openai.OpenAI) -> None:
    ids = fake_server.tokenizer.encode("for x in y:")
    r = fake_client.completions.create(
        model=MODEL, prompt=[ids, ids[1:]], n=2, max_tokens=3, temperature=0.5, seed=5
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    seeds = [fake_server.engine.requests[f"{r.id}-{i}"].sampling.seed for i in range(4)]
    assert seeds == [5, 6, 5, 6]
    assert r.usage.prompt_tokens == 2 * len(ids) - 1 and r.usage.completion_tokens == 12
    out = fake_server.engine.outputs[f"{r.id}-1"]
    assert r.choices[1].text == fake_server.tokenizer.decode(out)


def test_completion_stream_logprobs(fake_client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "class A(B):", "max_tokens": 6, "logprobs": 1, "seed": 3}
    whole = fake_client.completions.create(**kwargs, echo=True).choices[0]
    chunks = list(fake_client.completions.create(**kwargs, echo=True, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    tokens, offsets, lps = [], [], []
    for c in chunks:
        tokens += c.choices[0].logprobs.tokens
        offsets += c.choices[0].logprobs.text_offset
        lps += c.choices[0].logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert offsets == whole.logprobs.text_offset and lps == whole.logprobs.token_logprobs
    assert chunks[-1].choices[0].finish_reason == "length"
    plain = fake_client.completions.create(**kwargs).choices[0]
    assert plain.logprobs.text_offset[0] == len("class A(B):")
    assert whole.text == "class A(B):" + plain.text


def test_generate_native(fake_server: Server) -> None:
    body = {
        "text": "while True:",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "seed": 1},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "token_ids_logprob": [7, 9],
        "return_text_in_logprobs": True,
    }
    status, r = fake_server.post("/generate", body)
    assert status == 200, r
    ids = fake_server.tokenizer.encode("while True:")
    meta = r["meta_info"]
    out_ids = fake_server.engine.outputs[meta["id"]]
    assert r["output_ids"] == out_ids and r["text"] == fake_server.tokenizer.decode(out_ids)
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 4
    assert meta["input_token_logprobs"][0] == [
        None,
        ids[0],
        fake_server.tokenizer.token_text(ids[0]),
    ]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2
    assert [e[1] for e in meta["output_token_logprobs"]] == out_ids
    assert meta["output_token_ids_logprobs"][0] == [
        [-1.0, 7, fake_server.tokenizer.token_text(7)],
        [-2.0, 9, fake_server.tokenizer.token_text(9)],
    ]
    chunks = fake_server.sse("/generate", {**body, "stream": True})
    assert chunks[-1]["output_ids"] == out_ids
    assert chunks[-1]["meta_info"]["output_top_logprobs"] == meta["output_top_logprobs"]


def test_generate_batch_and_stop_token(fake_server: Server) -> None:
    ids = fake_server.tokenizer.encode("if a:")
    body = {
        "input_ids": [ids, ids],
        "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [ids[2]], "seed": 0},
        "return_logprob": True,
    }
    status, r = fake_server.post("/generate", body)
    assert status == 200 and len(r) == 2
    assert r[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
    assert r[0]["output_ids"] == ids[:3]
    assert r[0]["meta_info"]["input_token_logprobs"] == []  # logprob_start_len -1
    assert r[0]["meta_info"]["output_token_logprobs"][0][2] is None  # no text asked for


def test_models_health_metrics(fake_server: Server) -> None:
    status, r = fake_server.request("GET", "/v1/models")
    assert status == 200 and r["object"] == "list" and r["data"][0]["id"] == MODEL
    assert fake_server.request("GET", "/health") == (200, {"status": "ok"})
    status, text = fake_server.request("GET", "/metrics")
    assert status == 200
    samples = {
        s.name + str(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples["tokenmill_requests_started_total[]"] >= 0
    assert samples["tokenmill_kv_slots_used[]"] == 100
    assert samples["tokenmill_kv_cache_usage_perc[]"] == 0.1  # vLLM's name, a fraction
    assert "tokenmill_time_to_first_token_seconds_bucket[('le', '+Inf')]" in samples
    assert samples["tokenmill_engine_alive[]"] == 1
    fake_server.engine.stats.alive = False
    assert fake_server.request("GET", "/health")[0] == 503


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


def _cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", **kw}


CHAT, CMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
SCORE, GSCORE, RERANK = "/v1/score", "/generative_scoring", "/v1/rerank"
INVALID = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, b"", 400, None),
    (CHAT, _chat(temperature=2.5), 400, "temperature"),
    (CHAT, _chat(temperature="hot"), 400, "temperature"),
    (CHAT, _chat(top_p=0), 400, "top_p"),
    (CHAT, _chat(top_p=1.5), 400, "top_p"),
    (CHAT, _chat(n=0), 400, "n"),
    (CHAT, _chat(n=17), 400, "n"),
    (CHAT, _chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, _chat(max_tokens="5"), 400, "max_tokens"),
    (CHAT, _chat(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    (CHAT, _chat(top_logprobs=21, logprobs=True), 400, "top_logprobs"),
    (CHAT, _chat(top_logprobs=3), 400, "top_logprobs"),
    (CHAT, _chat(top_logprobs=6, logprobs=True), 400, "top_logprobs"),  # > max_logprobs 5
    (CHAT, _chat(logprobs=1), 400, "logprobs"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    (CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content[0].type"),
    (CHAT, _chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (CHAT, _chat(stop=7), 400, "stop"),
    (CHAT, _chat(seed=2**64), 400, "seed"),
    (CHAT, _chat(stream="yes"), 400, "stream"),
    (CHAT, _chat(frequency_penalty=2.5), 400, "frequency_penalty"),
    (CHAT, _chat(tools=[{"type": "function"}]), 400, "tools[0].function"),
    (CHAT, _chat(tools=[], tool_choice="required"), 400, "tool_choice"),
    (CHAT, _chat(model="gpt-4"), 404, "model"),
    (CHAT, _chat(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    (CMPL, _cmpl(prompt=""), 400, "prompt"),
    (CMPL, _cmpl(prompt=[]), 400, "prompt"),
    (CMPL, _cmpl(prompt=[1, "a"]), 400, "prompt"),
    (CMPL, _cmpl(prompt=[[1, 2], [10**7]]), 400, "prompt"),
    (CMPL, _cmpl(prompt=[-1]), 400, "prompt"),
    (CMPL, _cmpl(prompt={"a": 1}), 400, "prompt"),
    (CMPL, {"model": MODEL}, 400, "prompt"),
    (CMPL, _cmpl(max_tokens=0), 400, "max_tokens"),
    (CMPL, _cmpl(max_tokens=-1), 400, "max_tokens"),
    (CMPL, _cmpl(prompt=[5] * (MAX_MODEL_LEN + 1), echo=True, max_tokens=0), 400, "prompt"),
    (CMPL, _cmpl(logprobs=6), 400, "logprobs"),
    (CMPL, _cmpl(logprobs=21), 400, "logprobs"),
    (CMPL, _cmpl(logprobs=True), 400, "logprobs"),
    (CMPL, _cmpl(echo=1), 400, "echo"),
    (CMPL, _cmpl(prompt=["a"] * 20, n=16), 400, "n"),
    (CMPL, _cmpl(model="other"), 404, "model"),
    (CMPL, _cmpl(suffix="x"), 400, "suffix"),
    (GEN, {"sampling_params": {}}, 400, "text"),
    (GEN, {"text": "a", "input_ids": [1]}, 400, "text"),
    (GEN, {"input_ids": [1, 99999]}, 400, "input_ids"),
    (GEN, {"input_ids": []}, 400, "input_ids"),
    (GEN, {"text": "a", "sampling_params": {"temperature": -1}}, 400,
     "sampling_params.temperature"),
    (GEN, {"text": "a", "sampling_params": {"max_new_tokens": 10**6}}, 400,
     "sampling_params.max_new_tokens"),
    (GEN, {"text": "a", "return_logprob": True, "logprob_start_len": 50}, 400,
     "logprob_start_len"),
    (GEN, {"text": "a", "logprob_start_len": -2}, 400, "logprob_start_len"),
    (GEN, {"text": "a", "token_ids_logprob": [10**6]}, 400, "token_ids_logprob"),
    (GEN, {"text": "a", "top_logprobs_num": 50}, 400, "top_logprobs_num"),
    (SCORE, {"query": "a", "label_token_ids": [5]}, 400, "items"),
    (SCORE, {"query": "a", "items": [], "label_token_ids": [5]}, 400, "items"),
    (SCORE, {"query": "a", "items": ["b"] * 9, "label_token_ids": [5]}, 400, "items"),
    (SCORE, {"query": "a", "items": ["b", [7]], "label_token_ids": [5]}, 400, "items"),
    (SCORE, {"query": "a", "items": [[7, 10**6]], "label_token_ids": [5]}, 400, "items[0]"),
    (SCORE, {"query": "a", "items": [[5] * MAX_MODEL_LEN], "label_token_ids": [5]}, 400,
     "items"),
    (SCORE, {"query": "a", "items": ["b"]}, 400, "label_token_ids"),
    (SCORE, {"query": "a", "items": ["b"], "label_token_ids": []}, 400, "label_token_ids"),
    (SCORE, {"query": "a", "items": ["b"], "label_token_ids": [10**6]}, 400, "label_token_ids"),
    (SCORE, {"query": "a", "items": ["b"], "label_token_ids": [-1]}, 400, "label_token_ids[0]"),
    (SCORE, {"items": ["b"], "label_token_ids": [5]}, 400, "query"),
    (SCORE, {"query": [7, 10**7], "items": ["b"], "label_token_ids": [5]}, 400, "query"),
    (SCORE, {"query": {"a": 1}, "items": ["b"], "label_token_ids": [5]}, 400, "query"),
    (SCORE, {"query": "a", "items": ["b"], "label_token_ids": [5], "model": "x"}, 404, "model"),
    (GSCORE, {"query": "a", "items": ["b"], "label_token_ids": [5], "apply_softmax": "no"},
     400, "apply_softmax"),
    (GSCORE, {"query": "a", "items": "b", "label_token_ids": [5], "item_first": 1}, 400,
     "item_first"),
    (RERANK, {"query": "a"}, 400, "documents"),
    (RERANK, {"query": "a", "documents": []}, 400, "documents"),
    (RERANK, {"query": "a", "documents": ["b"] * 9}, 400, "documents"),
    (RERANK, {"query": "a", "documents": ["b"], "top_n": -1}, 400, "top_n"),
    (RERANK, {"query": 5, "documents": ["b"]}, 400, "query"),
    (RERANK, {"query": "a", "documents": ["b" * 2000]}, 400, "documents"),
    # pathological JSON and fields tokenmill does not implement: a 400, never ignored
    (CMPL, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    (GEN, b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    (CMPL, b'{"prompt": "\xff\xfe"}', 400, None),
    (CHAT, _chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (CMPL, _cmpl(stream_options={"include_usage": True}, stream=False), 400, "stream_options"),
    (CHAT, _chat(tool_choice={"type": "function", "function": {"name": "f"}}), 400,
     "tool_choice"),
    (CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    (CHAT, _chat(functions=[{"name": "f"}]), 400, "functions"),
    (CHAT, _chat(function_call="auto"), 400, "function_call"),
    (CHAT, _chat(response_format={"type": "xml"}), 400, "response_format.type"),
    (CHAT, _chat(guided_json={"type": "object"}), 400, "guided_json"),
    (CHAT, _chat(messages=[{"role": "user", "content": "hi", "tool_calls": []}]), 400,
     "messages[0].tool_calls"),
    (CMPL, _cmpl(use_beam_search=True), 400, "use_beam_search"),
    (CMPL, _cmpl(stream_options={"include_usage": True, "x": 1}, stream=True), 400,
     "stream_options.x"),
    (GEN, {"text": "a", "image_data": "x"}, 400, "image_data"),
    (GEN, {"text": "a", "sampling_params": {"beam_width": 2}}, 400,
     "sampling_params.beam_width"),
    (GEN, {"text": "a", "model": "other"}, 404, "model"),
    (SCORE, {"query": "a", "items": ["b"], "label_token_ids": [5], "normalize": True}, 400,
     "normalize"),
    (RERANK, {"query": "a", "documents": ["b"], "max_chunks_per_doc": 2}, 400,
     "max_chunks_per_doc"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param"), INVALID)
def test_invalid_requests(
    fake_server: Server, path: str, body: Any, status: int, param: Any
) -> None:
    before = len(fake_server.engine.requests)
    got, r = fake_server.post(path, body)
    assert got == status, r
    error = r["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"
    assert len(fake_server.engine.requests) == before, "an invalid request reached the engine"
    ok, _ = fake_server.post(CMPL, _cmpl(max_tokens=1))
    assert ok == 200


def test_unknown_route_and_method(fake_server: Server) -> None:
    status, r = fake_server.request("GET", "/v1/nothing")
    assert status == 404 and r["error"]["type"] == "invalid_request_error"
    status, r = fake_server.request("GET", "/v1/completions")
    assert status == 405 and "error" in r


def test_engine_errors(fake_server: Server, fake_client: openai.OpenAI) -> None:
    """Before the first token a failure has its status, streamed or not; after it, a stream
    ends with an error event."""
    fake_server.engine.fail_with = "worker 1 died"
    for stream in (False, True):
        status, r = fake_server.post(CMPL, _cmpl(max_tokens=2, stream=stream))
        assert status == 500 and "worker 1 died" in r["error"]["message"]
    fake_server.engine.fail_after = 2
    events = fake_server.sse(CMPL, _cmpl(max_tokens=5, stream=True))
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", "x"]
    assert "worker 1 died" in events[-1]["error"]["message"]
    fake_server.engine.fail_with, fake_server.engine.fail_after = None, 0
    fake_server.engine.dead = True
    status, r = fake_server.post(CHAT, _chat(max_tokens=2))
    assert status == 503 and r["error"]["code"] == "engine_dead"
    with pytest.raises(openai.InternalServerError):
        fake_client.completions.create(model=MODEL, prompt="x", max_tokens=2)


@pytest.mark.parametrize(
    ("reason", "status", "code"),
    [("rejected", 429, "queue_full"), ("queue_timeout", 503, "queue_timeout")],
)
def test_a_request_the_engine_turns_away(
    fake_server: Server, reason: str, status: int, code: str
) -> None:
    engine = fake_server.engine
    engine.fail_with, engine.fail_reason = "8192 requests wait already", reason
    try:
        for stream in (False, True):
            got, headers, r = fake_server.request_with_headers(
                "POST", CHAT, _chat(max_tokens=2, stream=stream)
            )
            assert got == status and r["error"]["code"] == code, r
            assert "overloaded" in r["error"]["message"]
            assert headers.get("Retry-After") == ("1" if status == 429 else None)
    finally:
        engine.fail_with, engine.fail_reason = None, "error"
    assert fake_server.post(CMPL, _cmpl(max_tokens=1))[0] == 200


@pytest.mark.parametrize("n", [1, 2])  # one choice streams straight from the engine
def test_client_disconnect_aborts(fake_server: Server, fake_client: openai.OpenAI, n: int) -> None:
    fake_server.engine.delay = 0.02
    stream = fake_client.completions.create(
        model=MODEL, prompt="x = 1", max_tokens=200, n=n, stream=True
    )
    first = next(iter(stream))
    stream.close()
    ids = {f"{first.id}-{i}" for i in range(n)}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not ids <= set(fake_server.engine.aborted):
        time.sleep(0.02)
    assert ids <= set(fake_server.engine.aborted)
    assert ids <= set(fake_server.engine.closed)
    assert all(len(fake_server.engine.outputs[i]) < 200 for i in ids)


def test_disconnect_non_streaming_aborts(fake_server: Server) -> None:
    fake_server.engine.delay = 0.02
    before = set(fake_server.engine.requests)
    req = urllib.request.Request(
        fake_server.url + CMPL, data=json.dumps(_cmpl(max_tokens=200)).encode(), method="POST"
    )
    req.add_header("Content-Type", "application/json")
    with pytest.raises(OSError):
        urllib.request.urlopen(req, timeout=0.3)
    deadline = time.monotonic() + 5
    new: set[str] = set()
    while time.monotonic() < deadline and not (new and new <= set(fake_server.engine.aborted)):
        new = set(fake_server.engine.requests) - before
        time.sleep(0.02)
    assert new and new <= set(fake_server.engine.aborted)


def test_generate_scores_prompt(fake_server: Server) -> None:
    body = {"input_ids": [0, 40, 41, 42], "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 1}  # fmt: skip
    status, r = fake_server.post(GEN, body)
    assert status == 200 and r["output_ids"] == [] and r["text"] == ""
    meta = r["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == [40, 41, 42]
    assert meta["input_token_logprobs"][0][2] is None  # return_text_in_logprobs not set
    assert meta["output_token_logprobs"] == [] and meta["completion_tokens"] == 0


def test_chat_template_and_tokenizer(tiny_checkpoint) -> None:
    tokenizer = Tokenizer(tiny_checkpoint("llama"))
    assert tokenizer.eos_token_ids == (tokenizer.encode("<|end_of_text|>", False)[0],)
    assert tokenizer.bos_token == "<|begin_of_text|>" and tokenizer.vocab_size > 256
    assert tokenizer.encode("a")[0] == tokenizer.encode("<|begin_of_text|>", False)[0]
    template = ChatTemplate(tokenizer.chat_template or "", "<s>", "</s>")
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}"
                          "{% endif %}{{ messages[0].content }}", None, None)  # fmt: skip
    with pytest.raises(ChatTemplateError, match="user first"):
        strict.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[0].content.upper() + 1 }}", None, None).render(
            [{"role": "user", "content": "x"}]
        )


def test_a_long_body_is_parsed_off_the_event_loop(fake_server: Server) -> None:
    """Bodies over PARSE_INLINE_BYTES are tokenized in a thread; the answers are the same."""
    from tokenmill.frontend.app.routes import PARSE_INLINE_BYTES

    text = "word " * (PARSE_INLINE_BYTES // 4)
    status, r = fake_server.post(CMPL, _cmpl(prompt=text))
    assert status == 400 and r["error"]["param"] == "prompt"
    status, _ = fake_server.post(CMPL, _cmpl(prompt="short", max_tokens=1, user="x" * 70_000))
    assert status == 200


def _softmax(values: list[float]) -> list[float]:
    weights = np.exp(np.asarray(values) - max(values))
    return list(weights / weights.sum())


def test_scoring_shapes_and_what_the_engine_is_asked(fake_server: Server) -> None:
    """The fake engine answers -1, -2, ... for the labels in order: each endpoint's numbers
    follow from that, and each item is a greedy one-token request sharing the query."""
    tok = fake_server.tokenizer
    query, items = "the query", ["one", "two three"]
    body = {"model": MODEL, "query": query, "items": items, "label_token_ids": [7, 9]}
    status, answer = fake_server.post(SCORE, body)
    assert status == 200, answer
    assert answer["object"] == "scoring" and answer["model"] == MODEL
    np.testing.assert_allclose(answer["scores"], [np.exp([-1.0, -2.0])] * 2, rtol=1e-12)
    query_ids = tok.encode(query)
    prompts = [query_ids + tok.encode(i, add_special_tokens=False) for i in items]
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts))
    sent = list(fake_server.engine.requests.values())[-2:]
    assert [unpack(r.input_ids).tolist() for r in sent] == prompts
    for r in sent:
        assert r.sampling.max_tokens == 1 and r.sampling.temperature == 0.0
        assert r.logprobs.token_ids == (7, 9) and r.shared_prefix_len == len(query_ids)

    # item_first: the item leads (with the special tokens), nothing is shared
    status, answer = fake_server.post(SCORE, {**body, "item_first": True, "apply_softmax": True})
    assert status == 200, answer
    np.testing.assert_allclose(answer["scores"], [_softmax([-1.0, -2.0])] * 2, rtol=1e-12)
    sent = list(fake_server.engine.requests.values())[-2:]
    assert unpack(sent[0].input_ids).tolist() == tok.encode("one") + tok.encode(
        query, add_special_tokens=False
    )
    assert all(r.shared_prefix_len == 0 for r in sent)

    # vLLM's shape, softmax over the distinct labels by default (7 is given twice)
    status, answer = fake_server.post(GSCORE, {**body, "label_token_ids": [7, 7, 9]})
    assert status == 200, answer
    assert answer["object"] == "list" and answer["id"].startswith("score-")
    assert [d["index"] for d in answer["data"]] == [0, 1]
    assert all(d["object"] == "score" for d in answer["data"])
    expected = _softmax([-1.0, -3.0])[0]
    np.testing.assert_allclose([d["score"] for d in answer["data"]], [expected] * 2, rtol=1e-12)


def test_rerank_shape_top_n_and_documents(fake_server: Server) -> None:
    docs = ["alpha", "beta", "gamma"]
    status, answer = fake_server.post(RERANK, {"query": "q", "documents": docs, "top_n": 2})
    assert status == 200, answer
    assert [r["index"] for r in answer["results"]] == [0, 1]  # equal scores: input order
    assert [r["document"]["text"] for r in answer["results"]] == ["alpha", "beta"]
    expected = _softmax([-1.0, -2.0])[0]
    np.testing.assert_allclose([r["relevance_score"] for r in answer["results"]], expected)
    assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] > 0
    sent = list(fake_server.engine.requests.values())[-3:]
    tok = fake_server.tokenizer
    assert all(r.logprobs.token_ids == (tok.encode("y", False)[0], tok.encode("n", False)[0])
               for r in sent)  # fmt: skip
    heads = {tuple(unpack(r.input_ids)[: r.shared_prefix_len]) for r in sent}
    assert len(heads) == 1 and sent[0].shared_prefix_len > 0
    status, answer = fake_server.post(
        "/rerank", {"query": "q", "documents": docs, "return_documents": False}
    )
    assert status == 200 and len(answer["results"]) == 3
    assert all("document" not in r for r in answer["results"])


@pytest.mark.parametrize("protect_metrics", [False, True])
def test_api_key(tiny_checkpoint, protect_metrics: bool) -> None:
    server = Server(
        tiny_checkpoint("llama"),
        HttpArgs(api_key="s3cret", api_key_protect_metrics=protect_metrics),
    )
    try:
        good = {"Authorization": "Bearer s3cret"}
        for headers in ({}, {"Authorization": "Bearer s3cre"}, {"Authorization": "s3cret"}):
            for method, path, body in (
                ("POST", CMPL, _cmpl(max_tokens=1)),
                ("POST", GEN, {"text": "a"}),
                ("POST", SCORE, {"query": "a", "items": ["b"], "label_token_ids": [5]}),
                ("GET", "/v1/models", None),
            ):
                status, got, r = server.request_with_headers(method, path, body, headers)
                assert status == 401 and r["error"]["code"] == "invalid_api_key", (path, r)
                assert got["WWW-Authenticate"] == "Bearer"
        assert server.request_with_headers("POST", CMPL, _cmpl(max_tokens=1), good)[0] == 200
        assert server.request("GET", "/health")[0] == 200
        metrics = server.request("GET", "/metrics")[0]
        assert metrics == (401 if protect_metrics else 200)
        assert server.request_with_headers("GET", "/metrics", None, good)[0] == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="a", max_tokens=1).choices
        wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL, prompt="a", max_tokens=1)
    finally:
        server.stop()


def test_draining_refuses_new_requests_and_turns_health_red(fake_server: Server) -> None:
    fake_server.engine.draining = True
    try:
        assert fake_server.request("GET", "/health")[0] == 503
        status, r = fake_server.post(CHAT, _chat(max_tokens=1))
        assert status == 503 and r["error"]["code"] == "shutting_down"
    finally:
        fake_server.engine.draining = False
    assert fake_server.request("GET", "/health")[0] == 200
