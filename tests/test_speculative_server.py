"""Speculative decoding through the real server: n-gram drafts at TP=1, a draft model at
TP=2. Each request is sent twice at once, as it is and with `speculative_decoding: false`
(the request-level opt-out), so the two share batches: the same tokens, text and logprob
bits (JSON floats are the float32 values' shortest reprs: equal text, equal bits).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_process import start_server
from test_server_e2e import wait_idle

from tokenmill.cli.make_model.draft import layer_truncated

LOOP = [11] * 30  # NOTE: the tiny llama's greedy output repeats after this: n-gram drafts hit


def _generate(ids: list[int], **sampling: object) -> dict:
    return {
        "input_ids": ids,
        "return_logprob": True,
        "logprob_start_len": 3,
        "top_logprobs_num": 3,
        "token_ids_logprob": [5, 6],
        "sampling_params": {"max_new_tokens": 40, **sampling},
    }


GENERATE = [
    _generate(LOOP, temperature=0),
    _generate(LOOP, temperature=0.9, seed=4),
    _generate(list(range(90, 140)), temperature=0.7, seed=1, frequency_penalty=0.4),
    _generate([5, 6, 7, 8] * 8, temperature=0, repetition_penalty=1.2, min_new_tokens=20),
]


def _opted_out(body: dict) -> dict:
    return {**body, "sampling_params": {**body["sampling_params"], "speculative_decoding": False}}


def _both_at_once(call, bodies: list[dict], opt_out) -> list[tuple[object, object]]:
    with ThreadPoolExecutor(2 * len(bodies)) as pool:
        ours = [pool.submit(call, body) for body in bodies]
        plain = [pool.submit(call, opt_out(body)) for body in bodies]
        return [(a.result(), b.result()) for a, b in zip(ours, plain, strict=True)]


def _check_native(server) -> None:
    def call(body: dict) -> dict:
        status, answer = server.post("/generate", body)
        assert status == 200, answer
        return answer

    for spec, plain in _both_at_once(call, GENERATE, _opted_out):
        assert spec["output_ids"] == plain["output_ids"]
        assert spec["text"] == plain["text"]
        assert json.dumps(spec["meta_info"]["output_token_logprobs"]) == json.dumps(
            plain["meta_info"]["output_token_logprobs"]
        )
        for key in ("input_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
            assert spec["meta_info"][key] == plain["meta_info"][key], key


def _check_openai(server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    completion = {
        "model": server.model,
        "prompt": LOOP,
        "max_tokens": 30,
        "n": 2,
        "temperature": 0.8,
        "seed": 9,
        "logprobs": 3,
        "stop": ["zz"],
    }

    def call(body: dict) -> dict:
        return client.completions.create(**body).model_dump()

    def opt_out(body: dict) -> dict:
        return {**body, "extra_body": {"speculative_decoding": False}}

    for spec, plain in _both_at_once(call, [completion], opt_out):
        assert isinstance(spec, dict) and isinstance(plain, dict)
        for a, b in zip(spec["choices"], plain["choices"], strict=True):
            assert (a["text"], a["finish_reason"]) == (b["text"], b["finish_reason"])
            assert a["logprobs"] == b["logprobs"]
    chat = {
        "model": server.model,
        "messages": [{"role": "user", "content": "again and again and again"}],
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
    }

    def stream(body: dict) -> tuple[str, list, str | None]:
        """The chunks' text, logprob entries and finish reason, joined (a step that keeps
        drafts sends several tokens in one chunk)."""
        text, entries, finish = "", [], None
        for chunk in client.chat.completions.create(**body):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.logprobs and choice.logprobs.content:
                    entries += [e.model_dump() for e in choice.logprobs.content]
                finish = choice.finish_reason or finish
        return text, entries, finish

    for spec, plain in _both_at_once(stream, [chat], opt_out):
        assert spec == plain


def _check_stop_string(server) -> None:
    """A stop string inside a step's kept drafts: the text, tokens and logprobs end where
    plain decoding ends them."""
    body = _generate(LOOP, temperature=0)
    _, plain = server.post("/generate", _opted_out(body))
    text = plain["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    with_stop = {**body, "sampling_params": {**body["sampling_params"], "stop": [stop]}}
    for spec, plain in _both_at_once(lambda b: server.post("/generate", b)[1], [with_stop],
                                     _opted_out):  # fmt: skip
        assert isinstance(spec, dict) and isinstance(plain, dict)
        assert spec["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
        assert spec["text"] == plain["text"] and len(spec["text"]) < len(text)
        assert (
            spec["meta_info"]["output_token_logprobs"]
            == (plain["meta_info"]["output_token_logprobs"])
        )


@pytest.fixture(scope="module")
def draft(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """The tiny llama's first layer of two: agrees with it at some positions."""
    model = tiny_checkpoint("llama")
    return layer_truncated(model, tmp_path_factory.mktemp("draft") / "llama-1-layer", 1)


@pytest.mark.parametrize(
    "layout", ["ngram-tp1", "draft-model-tp2"], ids=["ngram-tp1", "draft-model-tp2"]
)
def test_speculation_through_the_server(tiny_checkpoint, draft, tmp_path, layout: str) -> None:
    if layout == "ngram-tp1":
        spec, tp = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}, 1
    else:
        spec, tp = {"model": str(draft), "num_speculative_tokens": 3}, 2
    server = start_server(
        tiny_checkpoint("llama"),
        tmp_path / "log",
        "--speculative-config",
        json.dumps(spec),
        "--tensor-parallel-size",
        str(tp),
        "--kv-cache-tokens",
        "8192",
        "--max-model-len",
        "1024",
    )
    try:
        _check_native(server)
        _check_openai(server)
        _check_stop_string(server)
        metrics = wait_idle(server)
        assert metrics["tokenmill_kv_slots_used"] == 0
        drafted = metrics["tokenmill_spec_decode_num_draft_tokens_total"]
        accepted = metrics["tokenmill_spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted < drafted
        assert metrics['tokenmill_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    finally:
        assert server.stop() == 0
