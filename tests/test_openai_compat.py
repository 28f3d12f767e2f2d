"""What unmodified OpenAI clients send, through the real server with the openai SDK: the
SDK's own assistant message sent back, OpenAI's standard fields (taken and ignored, or a
400 where they would change the output), chat_template_kwargs, /tokenize and /detokenize,
the reasoning split, and /metrics under vLLM's names."""

from __future__ import annotations

import json

import openai
import pytest
from test_tool_calls import ASK, TOOLS

from tokenmill.frontend.api.openai_requests import (
    IGNORED_CHAT_FIELDS,
    IGNORED_COMPLETION_FIELDS,
)
from tokenmill.frontend.api.reasoning import ReasoningStream, split_reasoning

GREEDY = {"max_tokens": 6, "temperature": 0.0}
HELLO = [{"role": "user", "content": "Hello there"}]

# A value for each ignored field, as applications and agent frameworks set them
IGNORED_VALUES: dict[str, object] = {
    "metadata": {"app": "probe", "run": "7"},
    "store": True,
    "user": "user-1234",
    "safety_identifier": "sid-99",
    "service_tier": "auto",
    "prompt_cache_key": "conversation-42",
    "prompt_cache_retention": "24h",
    "verbosity": "low",
    "prediction": {"type": "content", "content": "Hello"},
}


def _text(out: object) -> str | None:
    return out.choices[0].message.content  # type: ignore[attr-defined]


def test_every_ignored_field_has_a_probe_value() -> None:
    fields = {f for f in IGNORED_CHAT_FIELDS if "." not in f}
    assert fields == set(IGNORED_VALUES)
    assert set(IGNORED_COMPLETION_FIELDS) <= set(IGNORED_CHAT_FIELDS)


@pytest.mark.parametrize("field", sorted(IGNORED_VALUES))
def test_an_ignored_field_changes_nothing(server, client, field: str) -> None:
    base = client.chat.completions.create(model=server.model, messages=HELLO, **GREEDY)
    out = client.chat.completions.create(
        model=server.model, messages=HELLO, extra_body={field: IGNORED_VALUES[field]}, **GREEDY
    )
    assert _text(out) == _text(base)
    assert out.usage.completion_tokens == base.usage.completion_tokens


def test_ignored_fields_all_at_once_chat_streamed_and_completions(server, client) -> None:
    fields = {
        **IGNORED_VALUES,
        "reasoning_effort": "low",
        "modalities": ["text"],
        "parallel_tool_calls": True,
    }
    base = client.chat.completions.create(model=server.model, messages=HELLO, **GREEDY)
    chunks = client.chat.completions.create(
        model=server.model,
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
        extra_body=fields,
        **GREEDY,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == _text(base)
    plain = client.completions.create(model=server.model, prompt="Hello", **GREEDY)
    out = client.completions.create(
        model=server.model,
        prompt="Hello",
        user="user-1",
        stream=True,
        stream_options={"include_obfuscation": True},
        **GREEDY,
    )
    assert "".join(c.choices[0].text for c in out if c.choices) == plain.choices[0].text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"stream": True, "stream_options": {"continuous": True}}, "stream_options.continuous"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        (
            {"messages": [*HELLO, {"role": "assistant", "content": "x", "audio": {"id": "a1"}}]},
            "messages[1].audio",
        ),
        (
            {
                "messages": [
                    *HELLO,
                    {"role": "assistant", "content": None, "function_call": {"name": "f"}},
                ]
            },
            "messages[1].function_call",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),
    ],
)
def test_what_would_change_the_output_is_a_400(server, fields: dict, param: str) -> None:
    body = {"model": server.model, "messages": HELLO, "max_tokens": 2, **fields}
    status, out = server.post("/v1/chat/completions", body)
    assert status == 400, out
    assert out["error"]["param"] == param, out
    assert out["error"]["type"] == "invalid_request_error"


def test_the_sdk_message_goes_back_as_it_came(qwen2_server, qwen2_client) -> None:
    """The function-calling loop of OpenAI's guides: the returned message object appended
    as it is (refusal, annotations, audio and function_call with it), then the result."""
    model = qwen2_server.model
    for dump in (False, True):
        messages: list = list(ASK)
        first = qwen2_client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=60
        )
        message = first.choices[0].message
        assert message.tool_calls and message.refusal is None
        messages.append(message.model_dump() if dump else message)
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
        second = qwen2_client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=4
        )
        assert second.usage.prompt_tokens > first.usage.prompt_tokens
        echoed = {**message.model_dump(), "refusal": "I cannot", "annotations": [], "content": None}
        body = {"model": model, "messages": [*ASK, echoed], "max_tokens": 2}
        status, out = qwen2_server.post("/v1/chat/completions", body)
        assert status == 200, out


def test_chat_template_kwargs_reach_the_template(server, client) -> None:
    with_prompt = client.chat.completions.create(model=server.model, messages=HELLO, **GREEDY)
    without = client.chat.completions.create(
        model=server.model,
        messages=HELLO,
        extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        **GREEDY,
    )
    ids = server.post("/tokenize", {"messages": HELLO})[1]["tokens"]
    bare = server.post("/tokenize", {"messages": HELLO, "add_generation_prompt": False})[1]
    assert with_prompt.usage.prompt_tokens == len(ids)
    assert without.usage.prompt_tokens == bare["count"] < len(ids)


def test_tokenize_gives_the_ids_the_server_runs(server, client, tiny_checkpoint) -> None:
    from tokenmill.frontend.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_checkpoint("llama"))
    status, out = server.post("/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200, out
    assert out["tokens"] == tokenizer.encode("Hello world")
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 1024
    assert out["token_strs"] == [tokenizer.token_piece(i) for i in out["tokens"]]
    bare = server.post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False})[1]
    assert bare["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    assert bare["token_strs"] is None
    chat = client.chat.completions.create(
        model=server.model, messages=HELLO, extra_body={"return_token_ids": True}, **GREEDY
    )
    ids = server.post("/tokenize", {"model": server.model, "messages": HELLO})[1]["tokens"]
    assert ids == chat.model_extra["prompt_token_ids"]
    status, text = server.post("/detokenize", {"tokens": ids})
    assert status == 200 and text["prompt"] == tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": HELLO}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_tokenize_requests_are_400s(server, path: str, body: dict, param: str) -> None:
    status, out = server.post(path, body)
    assert status in (400, 404), out
    assert out["error"]["param"] == param, out


def test_metrics_under_vllms_names_read_the_same_values(server) -> None:
    values = server.metrics()
    label = f'{{model_name="{server.model}"}}'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert values[f"vllm:{name}{label}"] == values[f"tokenmill_{name}"], name


# --- reasoning ---------------------------------------------------------------------------

THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{ '<think>' + message.reasoning_content + '</think>' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}"
)


@pytest.mark.parametrize(
    ("text", "thinking", "expected"),
    [
        ("ab</think>cd", True, ("ab", "cd")),
        ("abcd", True, ("abcd", "")),  # NOTE: cut short while thinking
        ("ab</think>cd", False, (None, "ab</think>cd")),
        ("\n<think>ab</think>cd", False, ("ab", "cd")),
        ("cd", False, (None, "cd")),
        ("<thin", False, (None, "<thin")),
    ],
)
def test_reasoning_splits_streamed_as_whole(text: str, thinking: bool, expected: tuple) -> None:
    assert split_reasoning(text, thinking) == expected
    for cut in range(len(text) + 1):
        stream = ReasoningStream(thinking)
        parts = [stream.feed(text[:cut], False), stream.feed(text[cut:], True)]
        reasoning = "".join(p[0] for p in parts)
        assert (reasoning if stream.thinking else None, "".join(p[1] for p in parts)) == expected


@pytest.fixture(scope="module")
def reasoning_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    from conftest import _session_server

    template = tmp_path_factory.mktemp("think") / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    args = ("--reasoning-parser", "qwen3", "--chat-template", str(template))
    yield from _session_server(tiny_checkpoint("qwen2"), tmp_path_factory, "think", *args)


def test_reasoning_is_split_from_the_content(reasoning_server) -> None:
    """The answer forced by a regex; the template's prompt opens the thought unless
    enable_thinking is false (then the whole answer is content)."""
    client = openai.OpenAI(base_url=reasoning_server.base_url + "/v1", api_key="x")
    forced = {"regex": "ab</think>cd", "max_tokens": 40}
    out = client.chat.completions.create(
        model=reasoning_server.model, messages=HELLO, extra_body=forced
    )
    message = out.choices[0].message
    assert message.content == "cd" and message.model_extra["reasoning_content"] == "ab"
    assert message.model_extra["reasoning"] == "ab"
    stream = client.chat.completions.create(
        model=reasoning_server.model, messages=HELLO, extra_body=forced, stream=True
    )
    reasoning, content = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == ("ab", "cd")
    off = client.chat.completions.create(
        model=reasoning_server.model,
        messages=HELLO,
        extra_body={**forced, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.choices[0].message.content == "ab</think>cd"
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    # the earlier turn's reasoning goes back into the template
    again = [*HELLO, {**message.model_dump(), "content": "cd"}, *HELLO]
    status, body = reasoning_server.post(
        "/tokenize", {"messages": again, "return_token_strs": False}
    )
    assert status == 200, body
    text = reasoning_server.post("/detokenize", {"tokens": body["tokens"]})[1]["prompt"]
    assert "<think>ab</think>cd" in text, json.dumps(text)


def test_responses_return_the_reasoning_as_an_item(reasoning_server) -> None:
    """The prompt opens the thought and a 6-token answer never closes it: all reasoning,
    then an empty message, whole and streamed, as chat splits it."""
    client = openai.OpenAI(base_url=reasoning_server.base_url + "/v1", api_key="x")
    model = reasoning_server.model
    chat = client.chat.completions.create(model=model, messages=HELLO, **GREEDY)
    thought = chat.choices[0].message.model_extra["reasoning_content"]
    kwargs = {"model": model, "input": "Hello there", "max_output_tokens": 6, "temperature": 0}
    out = client.responses.create(**kwargs)
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == thought and out.output_text == ""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.done")
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thought
