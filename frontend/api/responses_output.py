"""Response objects and stream events of OpenAI's Responses API (main process).

The answer is cut into output items, in this order: a `reasoning` item (with
--reasoning-parser, where the model thought), a `message` with one `output_text` part (where
there is text, or no call, or logprobs were asked for: they ride on it, every generated
token's, as chat's `logprobs.content`), then one `function_call` item per call. Streamed,
the same items come as OpenAI's events (`response.created`, `.in_progress`,
`.output_item.added`, `.content_part.added`, `.output_text.delta` ... `.done`,
`.function_call_arguments.delta` / `.done`, then `.completed` or `.incomplete`); a whole
response is the same machinery run to its end, so both give the same items.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from tokenmill.frontend.api.openai_requests import ChatMessage
from tokenmill.frontend.api.openai_responses import ChoiceState, Responder, chat_logprobs
from tokenmill.frontend.api.reasoning import ReasoningStream
from tokenmill.frontend.api.responses_requests import ResponsesJob
from tokenmill.frontend.api.tools import ToolStream
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.protocol.outputs import DetokenizedOutput, PositionLogprobs

# (the finished response object, the conversation it continues: for previous_response_id)
OnDone = Callable[[dict[str, Any], list[ChatMessage]], None]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesResponder(Responder):
    done_marker = None  # NOTE: OpenAI ends a Responses stream with its last event, no [DONE]

    def __init__(self, job: ResponsesJob, tokenizer: Tokenizer, on_done: OnDone) -> None:
        super().__init__(job.parsed, tokenizer)
        self.job = job
        self.stream = bool(job.parsed.stream)
        self.on_done = on_done
        thinking = job.parsed.thinking
        self.reasoning = ReasoningStream(thinking) if thinking is not None else None
        parser = job.parsed.tool_parser
        self.tools = ToolStream(parser) if parser else None
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output items, finished ones final
        self.open: dict[str, int] = {}  # "reasoning" / "message": its index in `items`
        self.calls: list[dict[str, Any]] = []
        self.pending: list[PositionLogprobs] = []
        self.final: dict[str, Any] | None = None

    def encode(self, event: Any) -> bytes:
        return b"event: " + event["type"].encode() + b"\n" + super().encode(event)

    def add(self, index: int, out: DetokenizedOutput) -> list[Any]:
        state = self.states[index]
        first = state.num_outputs == 0
        state.update(out, keep=False)
        events = self.chunks(state, out, first)
        return events if self.stream else []

    def chunks(self, state: ChoiceState, out: DetokenizedOutput, first: bool) -> list[Any]:
        events: list[Any] = []
        if first:
            events += [
                self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress")),
            ]
        final = out.finish_reason is not None
        thought, text = self.reasoning.feed(out.text, final) if self.reasoning else ("", out.text)
        if thought:
            events += self._reasoning_delta(thought)
        if self.tools:
            text, deltas = self.tools.feed(text, final)
            self._collect_calls(deltas)
        if self.job.logprobs:
            self.pending += out.logprobs
        thought_over = self.reasoning is None or self.reasoning.done
        if text or (self.pending and thought_over):
            events += self._text_delta(text)
        if final:
            events += self._finish(state)
        return events

    def response(self) -> Any:
        return self.final

    # --- items --------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, **fields, "sequence_number": self.sequence - 1}

    def _open(self, kind: str, item: dict[str, Any], part: dict[str, Any]) -> list[Any]:
        self.open[kind] = len(self.items)
        self.items.append(item)
        index = self.open[kind]
        return [
            self._event("response.output_item.added", output_index=index, item={**item}),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part={**part},
            ),
        ]

    def _reasoning_delta(self, thought: str) -> list[Any]:
        events = []
        if "reasoning" not in self.open:
            item: dict[str, Any] = {
                "id": _id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
            }
            events += self._open("reasoning", item, {"type": "reasoning_text", "text": ""})
            item["text"] = ""
        index = self.open["reasoning"]
        item = self.items[index]
        item["text"] += thought
        events.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                delta=thought,
            )
        )
        return events

    def _close_reasoning(self) -> list[Any]:
        index = self.open.pop("reasoning", None)
        if index is None:
            return []
        item = self.items[index]
        text = item.pop("text")
        part = {"type": "reasoning_text", "text": text}
        item.update(content=[part], encrypted_content=None, status="completed")
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.reasoning_text.done", **ids, text=text),
            self._event("response.content_part.done", **ids, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _text_delta(self, text: str) -> list[Any]:
        events = self._close_reasoning()
        if "message" not in self.open:
            item: dict[str, Any] = {
                "id": _id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._open("message", item, part)
            item["text"], item["logprobs"] = "", []
        index = self.open["message"]
        item = self.items[index]
        logprobs = chat_logprobs(self.pending)["content"] if self.job.logprobs else []
        self.pending = []
        item["text"] += text
        item["logprobs"] += logprobs
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )
        return events

    def _close_message(self, status: str) -> list[Any]:
        index = self.open.pop("message")
        item = self.items[index]
        text, logprobs = item.pop("text"), item.pop("logprobs")
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        item.update(content=[part], status=status)
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **ids, text=text, logprobs=logprobs),
            self._event("response.content_part.done", **ids, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _collect_calls(self, deltas: list[dict[str, Any]]) -> None:
        """ToolStream's chat deltas (a head with the name, then the arguments) as calls."""
        for delta in deltas:
            fn = delta["function"]
            if "name" in fn:
                self.calls.append({"name": fn["name"], "arguments": ""})
            self.calls[delta["index"]]["arguments"] += fn.get("arguments", "")

    def _call_events(self, call: dict[str, Any]) -> list[Any]:
        index = len(self.items)
        item = {
            "id": _id("fc"),
            "type": "function_call",
            "call_id": _id("call"),
            "name": call["name"],
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(item)
        ids = {"item_id": item["id"], "output_index": index}
        added = self._event("response.output_item.added", output_index=index, item={**item})
        item.update(arguments=call["arguments"], status="completed")
        return [
            added,
            self._event("response.function_call_arguments.delta", **ids, delta=call["arguments"]),
            self._event(
                "response.function_call_arguments.done",
                **ids,
                arguments=call["arguments"],
                name=call["name"],
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _finish(self, state: ChoiceState) -> list[Any]:
        cut = state.finish_reason == "length"
        events = self._close_reasoning()
        if "message" in self.open:
            if self.pending:  # NOTE: the last tokens' logprobs (the end token's, a call's)
                events += self._text_delta("")
        elif not self.calls or self.job.logprobs:
            events += self._text_delta("")
        if "message" in self.open:
            events += self._close_message("incomplete" if cut else "completed")
        for call in self.calls:
            events += self._call_events(call)
        status = "incomplete" if cut else "completed"
        self.final = self._response(status, state)
        self.on_done(self.final, self._conversation())
        events.append(self._event(f"response.{status}", response=self.final))
        return events

    def _conversation(self) -> list[ChatMessage]:
        """The stored context of this response: its input and its answer."""
        content, reasoning, calls = "", None, []
        for item in self.items:
            if item["type"] == "message":
                content = item["content"][0]["text"]
            elif item["type"] == "reasoning":
                reasoning = item["content"][0]["text"]
            else:
                fn = {"name": item["name"], "arguments": item["arguments"]}
                calls.append({"id": item["call_id"], "type": "function", "function": fn})
        answer = ChatMessage(
            role="assistant",
            content=content or (None if calls else ""),
            tool_calls=calls or None,
            reasoning_content=reasoning,
        )
        return [*self.job.conversation, answer]

    def _response(self, status: str, state: ChoiceState | None = None) -> dict[str, Any]:
        body, parsed = self.job.body, self.job.parsed
        text = {"format": (body.text.format if body.text else None) or {"type": "text"}}
        out = {
            "id": parsed.response_id,
            "object": "response",
            "created_at": self.job.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": parsed.model,
            "output": self.items if state is not None else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None},
            "store": body.store is not False,
            "temperature": body.temperature,
            "text": text,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_logprobs": body.top_logprobs or 0,
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": None if state is None else _usage(state),
            "user": body.user,
            "metadata": body.metadata or {},
            "weight_version": self.weight_version(),
        }
        return out


def _usage(state: ChoiceState) -> dict[str, Any]:
    prompt = state.num_prompt_tokens or len(state.choice.prompt_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": state.num_cached_tokens},
        "output_tokens": state.num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + state.num_output_tokens,
    }
