"""Response shapes of the OpenAI APIs, built from the engine's outputs (main process).

The detokenizer has already made the text deltas and the logprob entries (token string,
bytes, value); this module only wraps them: chat.completion(.chunk) and text_completion,
streamed as server-sent events or whole. One `Responder` per HTTP request keeps a
`ChoiceState` per choice; `add` returns the chunks to stream, `response` the whole body.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenmill.frontend.api.common import Choice, ParsedRequest
from tokenmill.frontend.api.reasoning import ReasoningStream, split_reasoning
from tokenmill.frontend.api.tools import PARSERS, ToolStream
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.protocol.outputs import DetokenizedOutput, PositionLogprobs, TokenEntry

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class TextOffsets:
    """Character offsets of tokens in the text they make, from their exact bytes: a special
    token adds no text, and a character split over tokens counts once it is complete."""

    def __init__(self, base: int = 0) -> None:
        self.offset = base
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")

    def add(self, token_bytes: bytes | None) -> int:
        """The offset of a token, before its bytes are added."""
        offset = self.offset
        if token_bytes:
            self.offset += len(self._decoder.decode(token_bytes))
        return offset


@dataclass
class ChoiceState:
    """What one choice has produced so far (texts and logprobs only when kept)."""

    choice: Choice
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    finish_detail: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_outputs: int = 0
    routed_experts: str | None = None  # SGLang's base64 int32, with the last output
    offsets: TextOffsets = field(default_factory=lambda: TextOffsets())  # completions

    def update(self, out: DetokenizedOutput, keep: bool) -> None:
        self.num_outputs += 1
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        counted = self.num_output_tokens + len(out.token_ids)
        self.num_output_tokens = max(out.num_output_tokens, counted)
        self.num_cached_tokens = max(out.num_cached_tokens, self.num_cached_tokens)
        self.finish_reason = out.finish_reason
        self.finish_detail = out.finish_detail
        if out.prompt_logprobs:
            self.prompt_logprobs = list(out.prompt_logprobs)
        if out.routed_experts is not None:
            self.routed_experts = out.routed_experts
        if keep:
            self.texts.append(out.text)
            self.token_ids.extend(out.token_ids)
            self.logprobs.extend(out.logprobs)

    @property
    def text(self) -> str:
        return "".join(self.texts)


def usage(states: list[ChoiceState]) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per choice); cached tokens likewise, the
    fewest any of the prompt's choices found."""
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    for s in states:
        p = s.choice.prompt_index
        prompt[p] = s.num_prompt_tokens or len(s.choice.prompt_ids)
        cached[p] = min(cached.get(p, s.num_cached_tokens), s.num_cached_tokens)
    num_prompt = sum(prompt.values())
    num_output = sum(s.num_output_tokens for s in states)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


class Responder:
    """Base of the per-API response builders."""

    object_name = ""
    chunk_object_name = ""
    done_marker: bytes | None = SSE_DONE  # the stream's last bytes
    sglext_in_chunks = True  # a choice's routed experts in its last chunk's `sglext`

    def encode(self, chunk: Any) -> bytes:
        """One streamed chunk as a server-sent event."""
        return sse(chunk)

    def __init__(self, parsed: ParsedRequest, tokenizer: Tokenizer) -> None:
        self.parsed = parsed
        self.tokenizer = tokenizer
        self.states = [ChoiceState(c) for c in parsed.choices]
        self.created = int(time.time())
        self._keep = not parsed.stream
        # NOTE: the weights in force as the response is written (the HTTP layer sets it;
        # a weight update recomputes the requests it finds running with the new weights)
        self.weight_version: Callable[[], str] = lambda: "default"

    def add(self, index: int, out: DetokenizedOutput) -> list[Any]:
        """Records `out`; returns the chunks to stream now (none when not streaming)."""
        state = self.states[index]
        first = state.num_outputs == 0
        state.update(out, self._keep)
        if not self.parsed.stream:
            return []
        chunks = self.chunks(state, out, first)
        if chunks and out.routed_experts is not None and self.sglext_in_chunks:
            # NOTE: a choice's last chunk, which holds that choice alone
            chunks[-1]["sglext"] = {"routed_experts": out.routed_experts}
        return chunks

    def chunks(self, state: ChoiceState, out: DetokenizedOutput, first: bool) -> list[Any]:
        raise NotImplementedError

    def response(self) -> Any:
        raise NotImplementedError

    def final_chunks(self) -> list[Any]:
        """After every choice finished: the usage chunk, when asked for."""
        if not self.parsed.include_usage:
            return []
        return [{**self._envelope(self.chunk_object_name), "choices": [], "usage": self.usage()}]

    def usage(self) -> dict[str, Any]:
        return usage(self.states)

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.parsed.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.parsed.model,
            "system_fingerprint": None,
            "weight_version": self.weight_version(),
        }

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._envelope(self.chunk_object_name), "choices": [choice]}
        if self.parsed.include_usage:
            chunk["usage"] = None
        return chunk

    def sglext(self, states: list[ChoiceState]) -> dict[str, Any] | None:
        """SGLang's extension object where the request asked for routed experts: its
        `routed_experts` (base64, as /generate's meta_info has them) for one choice; a list
        of them, in choice order, for n > 1 (SGLang's field holds one)."""
        if self.parsed.choices[0].request.routed_experts_start < 0:
            return None
        routed = [s.routed_experts for s in states]
        if any(r is None for r in routed):
            return None
        return {"routed_experts": routed[0] if len(self.states) == 1 else routed}

    def _with_sglext(self, body: dict[str, Any], states: list[ChoiceState]) -> dict[str, Any]:
        ext = self.sglext(states)
        if ext is not None:
            body["sglext"] = ext
        return body


# --- chat ------------------------------------------------------------------------------


def _chat_entry(e: TokenEntry) -> dict[str, Any]:
    return {
        "token": e.token,
        "logprob": e.logprob,
        "bytes": list(e.bytes) if e.bytes is not None else None,
    }


def chat_logprobs(positions: list[PositionLogprobs]) -> dict[str, Any]:
    content = [
        {**_chat_entry(p.chosen), "top_logprobs": [_chat_entry(t) for t in p.top]}
        for p in positions
    ]
    return {"content": content, "refusal": None}


class ChatResponder(Responder):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, parsed: ParsedRequest, tokenizer: Tokenizer) -> None:
        super().__init__(parsed, tokenizer)
        self.parser = parsed.tool_parser
        self.tool_streams = [ToolStream(self.parser) for _ in self.states] if self.parser else []
        thinking = parsed.thinking
        self.reasoning_streams = (
            [ReasoningStream(thinking) for _ in self.states] if thinking is not None else []
        )

    def chunks(self, state: ChoiceState, out: DetokenizedOutput, first: bool) -> list[Any]:
        index = state.choice.index
        chunks = []
        if first:
            delta = {"role": "assistant", "content": ""}
            role = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            chunks.append(self._chunk(role))
        final = out.finish_reason is not None
        reasoning, text = "", out.text
        if self.reasoning_streams:
            reasoning, text = self.reasoning_streams[index].feed(text, final)
        calls, reason = [], out.finish_reason
        if self.tool_streams:
            stream = self.tool_streams[index]
            text, calls = stream.feed(text, final)
            reason = self._finish_reason(reason, stream.num_calls)
        # NOTE: text a tool call may begin is held back: a chunk then only carries logprobs
        held = self.tool_streams and not text and not reasoning and not self.parsed.logprobs
        if (text or reasoning or out.token_ids or final) and not (held and not final):
            lp = chat_logprobs(out.logprobs) if self.parsed.logprobs else None
            last = final and not calls
            choice = {
                "index": index,
                "delta": _delta(text, reasoning, final),
                "logprobs": lp,
                "finish_reason": reason if last else None,
            }
            if self.parsed.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            chunks.append(self._chunk(choice))
        if self.parsed.return_token_ids and first:
            chunks[0]["prompt_token_ids"] = state.choice.prompt_ids
        for i, call in enumerate(calls):
            last = final and i == len(calls) - 1
            choice = {
                "index": index,
                "delta": {"tool_calls": [call]},
                "logprobs": None,
                "finish_reason": reason if last else None,
            }
            chunks.append(self._chunk(choice))
        return chunks

    def _message(self, state: ChoiceState) -> tuple[dict[str, Any], str | None]:
        """The choice's message, its reasoning and tool calls parsed out, and its finish
        reason."""
        text: str | None = state.text
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self.parsed.thinking is not None:
            reasoning, text = split_reasoning(state.text, self.parsed.thinking)
            if reasoning is not None:
                message["content"] = text = text or None
                message["reasoning_content"] = message["reasoning"] = reasoning
        if self.parser is None or not text:
            return message, state.finish_reason
        content, calls = PARSERS[self.parser](text)
        if calls:
            message["content"] = content
            message["tool_calls"] = [c.as_openai() for c in calls]
        return message, self._finish_reason(state.finish_reason, len(calls))

    def _finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        """OpenAI's: a choice that ends by calling tools ends with "tool_calls", unless
        tool_choice named the function (then "stop", as OpenAI and vLLM answer)."""
        if num_calls and reason == "stop" and not self.parsed.named_tool:
            return "tool_calls"
        return reason

    def response(self) -> dict[str, Any]:
        choices = []
        for s in self.states:
            message, reason = self._message(s)
            choice = {
                "index": s.choice.index,
                "message": message,
                "logprobs": chat_logprobs(s.logprobs) if self.parsed.logprobs else None,
                "finish_reason": reason,
            }
            if self.parsed.return_token_ids:
                choice["token_ids"] = s.token_ids
            choices.append(choice)
        body = {**self._envelope(self.object_name), "choices": choices, "usage": self.usage()}
        if self.parsed.return_token_ids:
            body["prompt_token_ids"] = self.states[0].choice.prompt_ids
        return self._with_sglext(body, self.states)


def _delta(text: str, reasoning: str, final: bool) -> dict[str, Any]:
    """A chunk's delta: the reasoning under both names clients read (`reasoning_content`,
    DeepSeek's and SGLang's; `reasoning`, vLLM's now), then the content."""
    delta: dict[str, Any] = {}
    if reasoning:
        delta["reasoning_content"] = delta["reasoning"] = reasoning
    if text or not (final or reasoning):
        delta["content"] = text
    return delta


# --- completions ---------------------------------------------------------------------------


def _top_dict(p: PositionLogprobs) -> dict[str, float]:
    """OpenAI's legacy shape: token -> logprob, the chosen token always among them."""
    top = {t.token: t.logprob for t in p.top}
    top.setdefault(p.chosen.token, p.chosen.logprob)
    return top


Row = tuple[TokenEntry, float | None, dict[str, float] | None]


class CompletionResponder(Responder):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _rows(self, positions: list[PositionLogprobs]) -> list[Row]:
        """(entry, logprob, top dict) per position; position 0 of a prompt has neither."""
        return [
            (p.chosen, p.chosen.logprob, None if p.chosen.logprob is None else _top_dict(p))
            for p in positions
        ]

    def _logprobs(
        self, state: ChoiceState, positions: list[PositionLogprobs], echo: bool
    ) -> dict[str, Any] | None:
        """tokens/token_logprobs/top_logprobs/text_offset; offsets count characters, the
        prompt's from 0 and the completion's from the prompt text's length."""
        if not self.parsed.logprobs:
            return None
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        prompt_text = TextOffsets()
        sections = (
            (self._rows(state.prompt_logprobs) if echo else [], prompt_text),
            (self._rows(positions), state.offsets),
        )
        for rows, offsets in sections:
            for entry, lp, top in rows:
                out["tokens"].append(entry.token)
                out["token_logprobs"].append(lp)
                out["top_logprobs"].append(top)
                out["text_offset"].append(offsets.add(entry.bytes))
        return out

    def _start_offset(self, state: ChoiceState) -> None:
        state.offsets = TextOffsets(base=len(state.choice.prompt_text or ""))

    def chunks(self, state: ChoiceState, out: DetokenizedOutput, first: bool) -> list[Any]:
        if first:
            self._start_offset(state)
        echo = first and self.parsed.echo
        if not (out.text or out.token_ids or out.finish_reason is not None or echo):
            return []
        text = (state.choice.prompt_text or "") + out.text if echo else out.text
        choice = {
            "index": state.choice.index,
            "text": text,
            "logprobs": self._logprobs(state, out.logprobs, echo),
            "finish_reason": out.finish_reason,
        }
        if self.parsed.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
            if first:
                choice["prompt_token_ids"] = state.choice.prompt_ids
        return [self._chunk(choice)]

    def response(self) -> dict[str, Any]:
        choices = []
        for s in self.states:
            self._start_offset(s)
            prefix = (s.choice.prompt_text or "") if self.parsed.echo else ""
            choice = {
                "index": s.choice.index,
                "text": prefix + s.text,
                "logprobs": self._logprobs(s, s.logprobs, self.parsed.echo),
                "finish_reason": s.finish_reason,
            }
            if self.parsed.return_token_ids:
                choice["token_ids"] = s.token_ids
                choice["prompt_token_ids"] = s.choice.prompt_ids
            choices.append(choice)
        body = {**self._envelope(self.object_name), "choices": choices, "usage": self.usage()}
        return self._with_sglext(body, self.states)
