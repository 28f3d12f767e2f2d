"""/openapi.json describes every route the app serves, and real requests and responses of the
real server fit it."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from test_http_api import Server

from tokenmill.frontend.app.openapi import openapi_document

DOC = openapi_document()


def validator(schema: dict[str, Any]) -> Draft202012Validator:
    return Draft202012Validator({**schema, "components": DOC["components"]})


def request_schema(path: str) -> Draft202012Validator:
    body = DOC["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return validator(body)


def response_schema(path: str, status: str = "200") -> Draft202012Validator:
    (operation,) = DOC["paths"][path].values()
    return validator(operation["responses"][status]["content"]["application/json"]["schema"])


def test_every_route_is_described(tiny_checkpoint) -> None:
    fake_server = Server(tiny_checkpoint("llama"))
    try:
        check_every_route_is_described(fake_server)
    finally:
        fake_server.stop()


def check_every_route_is_described(fake_server: Server) -> None:
    served = {
        (r.resource.canonical, r.method.lower())  # type: ignore[union-attr]
        for r in fake_server.app.router.routes()
        if r.method != "HEAD"
    }
    described = {(path, method) for path, ops in DOC["paths"].items() for method in ops}
    assert served == described | {("/openapi.json", "get")}
    status, served_doc = fake_server.request("GET", "/openapi.json")
    assert status == 200 and served_doc == json.loads(json.dumps(DOC))
    assert DOC["openapi"] == "3.1.0"


def test_the_request_schemas_are_the_validating_types() -> None:
    """What the schema forbids, the server refuses (and the other way round), on a few."""
    chat = request_schema("/v1/chat/completions")
    assert chat.is_valid({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3})
    assert not chat.is_valid({"messages": [], "top_logprobs": 3})  # min_length 1
    assert not chat.is_valid({"messages": [{"role": "user"}], "temperature": 2.5})
    assert not chat.is_valid({"messages": [{"role": "user"}], "guided_json": {}})  # unknown
    generate = request_schema("/generate")
    assert not generate.is_valid({"text": "a", "sampling_params": {"beam_width": 2}})


BODIES = [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 3, "logprobs": 2, "echo": True}),
    ("/v1/completions", {"prompt": [[5, 6], [7, 8]], "max_tokens": 2, "n": 2}),
    ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2}),
    ("/generate", {"text": "hello", "return_logprob": True, "top_logprobs_num": 2,
                   "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 2}}),
    ("/generate", {"input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 1}}),
    ("/v1/score", {"query": "a b", "items": ["c", "d"], "label_token_ids": [5, 6]}),
    ("/generative_scoring", {"query": [5, 6], "items": [[7]], "label_token_ids": [5]}),
    ("/v1/rerank", {"query": "a", "documents": ["b", "c"], "top_n": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 3,
                       "include": ["message.output_text.logprobs"], "top_logprobs": 2}),
    ("/tokenize", {"prompt": "hello", "return_token_strs": True}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/detokenize", {"tokens": [5, 6, 7]}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body"), BODIES, ids=[p for p, _ in BODIES])
def test_real_requests_and_responses_fit_the_document(server, path: str, body: dict) -> None:
    body = {**body, "model": server.model}
    request_schema(path).validate(body)
    status, answer = server.post(path, body)
    assert status == 200, answer
    response_schema(path).validate(answer)


def test_real_errors_and_other_routes_fit_the_document(server) -> None:
    status, error = server.post("/v1/chat/completions", {"messages": [], "model": server.model})
    assert status == 400
    response_schema("/v1/chat/completions", "400").validate(error)
    status, error = server.post("/v1/completions", {"prompt": "a", "model": "other"})
    assert status == 404
    response_schema("/v1/completions", "404").validate(error)
    for path in ("/v1/models", "/health"):
        status, text = server.get(path)
        assert status == 200
        response_schema(path).validate(json.loads(text))
    stored = server.post("/v1/responses", {"input": "hi", "max_output_tokens": 2})[1]
    status, text = server.get(f"/v1/responses/{stored['id']}")
    assert status == 200
    validator(
        DOC["paths"]["/v1/responses/{response_id}"]["get"]["responses"]["200"]["content"][
            "application/json"
        ]["schema"]
    ).validate(json.loads(text))


def test_streamed_completion_chunks_fit_the_document(server) -> None:
    body = {"prompt": "hello", "max_tokens": 3, "logprobs": 1, "stream": True}
    body |= {"model": server.model, "stream_options": {"include_usage": True}}
    request_schema("/v1/completions").validate(body)
    req = urllib.request.Request(
        server.base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [e[len("data: ") :] for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunk = response_schema("/v1/completions")
    for event in events[:-1]:
        chunk.validate(json.loads(event))
