"""/tokenize and /detokenize (main process), in vLLM's shapes: a text or a chat
conversation to the token ids the server would run, and token ids back to text."""

from __future__ import annotations

from typing import Any

import msgspec

from tokenmill.frontend.api import tools as tool_calls
from tokenmill.frontend.api.common import (
    ApiError,
    NonNegative,
    RequestContext,
    check_model,
    check_token_ids,
    decode_body,
)
from tokenmill.frontend.api.openai_requests import (
    ChatMessage,
    chat_messages,
    render_chat,
    template_variables,
)


class TokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None  # a text, or else:
    messages: list[ChatMessage] | None = None  # a conversation, through the chat template
    # default: true for a prompt, false for messages (the template writes its own)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    return_token_strs: bool | None = None


class DetokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[NonNegative]


def _conversation_text(body: TokenizeBody, ctx: RequestContext) -> str:
    messages = chat_messages(body.messages or [])
    if not messages:
        raise ApiError("messages must not be empty", "messages")
    variables = template_variables(body.chat_template_kwargs, None)
    if body.add_generation_prompt is not None:
        variables["add_generation_prompt"] = body.add_generation_prompt
    tools = None
    if body.tools:
        tools = [fn.spec for fn in tool_calls.parse_tools(body.tools)]
    return render_chat(ctx, messages, tools, variables)


def tokenize(raw: bytes, ctx: RequestContext) -> dict[str, Any]:
    body = decode_body(raw, TokenizeBody)
    check_model(body.model, ctx)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError("give either `prompt` or `messages`", "prompt")
    if body.prompt is not None:
        special = body.add_special_tokens is not False
        ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=special)
    else:
        text = _conversation_text(body, ctx)
        ids = ctx.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    pieces = [ctx.tokenizer.token_piece(i) for i in ids] if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": ctx.max_model_len,
        "tokens": ids,
        "token_strs": pieces,
    }


def detokenize(raw: bytes, ctx: RequestContext) -> dict[str, Any]:
    body = decode_body(raw, DetokenizeBody)
    check_model(body.model, ctx)
    check_token_ids(body.tokens, ctx, "tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)}
