"""Request bodies of OpenAI's Responses API, POST /v1/responses (main process).

A Responses request is a chat request in other words: its `input` items (and the stored
conversation of `previous_response_id`) become chat messages, its function tools and
`text.format` the chat's tools and response_format, and it runs through the same checks,
template, tool grammar and logprobs as /v1/chat/completions (`chat_request`), so its tokens
and logprobs are chat's exactly. Errors name the Responses API's fields.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tokenmill.frontend.api.common import (
    ApiError,
    ParsedRequest,
    RequestContext,
    Seed,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
    check_unsupported,
    decode_body,
)
from tokenmill.frontend.api.openai_requests import ChatCompletionBody, ChatMessage, chat_request

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# NOTE: what `include` may name; those of tools not served here add nothing.
KNOWN_INCLUDES = frozenset(
    {
        LOGPROBS_INCLUDE,
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "message.input_image.image_url",
    }
)
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal", "summary_text"})


class TextOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # ignored


class ReasoningOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None  # given to the chat template as `reasoning_effort`
    summary: str | None = None  # ignored: the reasoning itself is returned
    generate_summary: str | None = None  # ignored


class ResponsesStreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # ignored


class ResponsesBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None  # default true: kept for previous_response_id while we live
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: TopLogprobs | None = None
    truncation: str | None = None  # "disabled" (OpenAI's default) only
    # ignored, as in chat (docs/api.md)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # what we cannot serve: a 400 when asked for
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    # vLLM's extensions, as in chat
    seed: Seed | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    logprobs_mode: str | None = None


@dataclass(frozen=True)
class ResponsesJob:
    """A parsed Responses request: the chat request it runs as, the body (echoed in the
    response object) and the conversation (the response's stored context)."""

    parsed: ParsedRequest
    body: ResponsesBody
    conversation: list[ChatMessage]  # without `instructions` (they do not carry over)
    logprobs: bool
    created_at: int


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError("content must be a string or a list of parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if kind else None
        if kind not in TEXT_PARTS or not isinstance(text, str):
            raise ApiError(
                f"content part type {kind!r} is not supported; only text parts are",
                f"{param}[{j}].type",
            )
        texts.append(text)
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    return _text(parts, f"{param}.content")


class _Conversation:
    """Input items folded into chat messages: calls join the assistant turn before them,
    a reasoning item the assistant turn after it."""

    def __init__(self) -> None:
        self.messages: list[ChatMessage] = []
        self.reasoning: str | None = None

    def add(self, item: Any, param: str) -> None:
        if not isinstance(item, dict):
            raise ApiError("an input item must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, param)
        elif kind == "function_call":
            self._call(item, param)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", param)
            content = _text(item.get("output", ""), f"{param}.output")
            self.messages.append(ChatMessage(role="tool", content=content, tool_call_id=call_id))
        elif kind == "reasoning":
            self.reasoning = _reasoning_text(item, param)
        elif kind == "item_reference":
            raise ApiError(
                "item references are not supported: send the item, or previous_response_id",
                f"{param}.type",
            )
        else:
            raise ApiError(f"input items of type {kind!r} are not supported", f"{param}.type")

    def _message(self, item: dict[str, Any], param: str) -> None:
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise ApiError("role must be user, system, developer or assistant", f"{param}.role")
        content = _text(item.get("content", ""), f"{param}.content")
        reasoning = self.reasoning if role == "assistant" else None
        self.reasoning = None
        self.messages.append(ChatMessage(role=role, content=content, reasoning_content=reasoning))

    def _call(self, item: dict[str, Any], param: str) -> None:
        call = {
            "id": _string(item, "call_id", param),
            "type": "function",
            "function": {
                "name": _string(item, "name", param),
                "arguments": _string(item, "arguments", param),
            },
        }
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant" and self.reasoning is None:
            last.tool_calls = [*(last.tool_calls or []), call]
            return
        self.messages.append(
            ChatMessage(
                role="assistant", content=None, tool_calls=[call], reasoning_content=self.reasoning
            )
        )
        self.reasoning = None


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(f"`{key}` must be a string", f"{param}.{key}")
    return value


def input_messages(value: str | list[dict[str, Any]]) -> list[ChatMessage]:
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    if not value:
        raise ApiError("input must not be empty", "input")
    conversation = _Conversation()
    for i, item in enumerate(value):
        conversation.add(item, f"input[{i}]")
    return conversation.messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in chat's shape; other tool types are not served."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ApiError(
                f"tools of type {tool.get('type')!r} are not served; only function tools are",
                f"tools[{i}].type",
            )
        fn = {k: v for k, v in tool.items() if k != "type"}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ApiError("tool_choice must be none, auto, required or a function", "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: TextOptions | None) -> dict[str, Any] | None:
    """text.format in chat's response_format shape."""
    fmt = text.format if text else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: v for k, v in fmt.items() if k in ("name", "schema", "strict", "description")}
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise ApiError("text.format.type must be text, json_schema or json_object", "text.format")


def _check(body: ResponsesBody) -> bool:
    """The fields chat has no word for; whether logprobs are asked for."""
    check_unsupported(
        {
            "background": body.background,
            "conversation": body.conversation,
            "prompt": body.prompt,
            "max_tool_calls": body.max_tool_calls is not None,
        }
    )
    if body.truncation not in (None, "disabled"):
        raise ApiError(
            "truncation 'auto' is not supported: a prompt over the context is a 400",
            "truncation",
        )
    for i, name in enumerate(body.include or ()):
        if name not in KNOWN_INCLUDES:
            raise ApiError(f"unknown include value {name!r}", f"include[{i}]")
    logprobs = LOGPROBS_INCLUDE in (body.include or ())
    if body.top_logprobs and not logprobs:
        raise ApiError(
            f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]", "top_logprobs"
        )  # fmt: skip
    return logprobs


# NOTE: chat's names for what the Responses API calls otherwise, for the errors' `param`
_PARAMS = (
    (re.compile(r"^messages(\[\d+\])?"), "input"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^max_tokens$"), "max_output_tokens"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
)


def _responses_param(param: str | None) -> str | None:
    for pattern, name in _PARAMS:
        if param is not None and pattern.match(param):
            return pattern.sub(name, param)
    return param


def parse_responses(
    raw: bytes, ctx: RequestContext, history: Callable[[str], list[ChatMessage]]
) -> ResponsesJob:
    """history(id): the stored conversation of previous_response_id (the caller keeps them)."""
    body = decode_body(raw, ResponsesBody)
    logprobs = _check(body)
    earlier = history(body.previous_response_id) if body.previous_response_id else []
    conversation = [*earlier, *input_messages(body.input)]
    messages = list(conversation)
    if body.instructions:
        messages.insert(0, ChatMessage(role="system", content=body.instructions))
    chat = ChatCompletionBody(
        model=body.model,
        messages=messages,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format(body.text),
        logprobs=logprobs,
        top_logprobs=body.top_logprobs,
        stream=body.stream,
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
        logprobs_mode=body.logprobs_mode,
    )
    try:
        parsed = chat_request(chat, ctx, f"resp_{uuid.uuid4().hex}")
    except ApiError as e:
        e.param = _responses_param(e.param)
        raise
    return ResponsesJob(parsed, body, conversation, logprobs, int(time.time()))
