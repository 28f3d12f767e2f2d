"""Tool calling (main process): the `tools` a chat request offers, checked; the grammar that
`tool_choice: required` or a named function puts around the model's own call format; and the
parsers that find the calls in what the model wrote, whole or while it streams.

Formats (`--tool-call-parser`):
- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call;
- llama3_json (Llama 3.1 / 3.2): `{"name": ..., "parameters": {...}}`, calls joined by "; ",
  optionally after `<|python_tag|>`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.frontend.api.common import ApiError
from tokenmill.frontend.api.constraints import COMPACT_JSON

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
MAX_TOOLS = 128
_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object
    spec: dict[str, Any]  # the tool as the chat template renders it


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def parse_tools(tools: list[Any]) -> list[Function]:
    """OpenAI's tools: [{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}]."""
    if not tools:
        raise ApiError("`tools` must not be empty", "tools")
    if len(tools) > MAX_TOOLS:
        raise ApiError(f"at most {MAX_TOOLS} tools are allowed", "tools")
    functions: dict[str, Function] = {}
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError("each tool must be {'type': 'function', 'function': {...}}", param)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError("the tool has no `function` object", f"{param}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ApiError(
                "a function name is 1-64 letters, digits, '_', '.' or '-'", f"{param}.function.name"
            )
        if name in functions:
            raise ApiError(f"two tools are named {name!r}", f"{param}.function.name")
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ApiError(
                "`parameters` must be a JSON schema (an object)", f"{param}.function.parameters"
            )
        functions[name] = Function(name, parameters, {"type": "function", "function": fn})
    return list(functions.values())


def chosen_functions(functions: list[Function], tool_choice: Any) -> tuple[str, list[Function]]:
    """("none" | "auto" | "required" | "named", the functions a forced call may use)."""
    if tool_choice is None:
        return "auto", functions
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, functions
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        named = [f for f in functions if f.name == name]
        if not named:
            raise ApiError(
                f"tool_choice names function {name!r}, which is not in `tools`",
                "tool_choice.function.name",
            )
        return "named", named
    raise ApiError(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def pick_parser(flag: str, template: str | None) -> str | None:
    """--tool-call-parser, or (auto) the format the chat template shows the model."""
    if flag != "auto":
        return flag
    if template is None:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


def _call_schema(fn: Function, arguments_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, arguments_key: fn.parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        "x-guidance": COMPACT_JSON,
    }


def call_grammar(
    parser: str, functions: list[Function], parallel: bool, literal: Callable[[str], str]
) -> str:
    """A Lark grammar (llguidance's, with %json) for one call (or, `parallel`, one or more)
    in the model's own format. literal(text) is the grammar's way to write a fixed text
    (a special token where the tokenizer has one)."""
    key, open_, close, sep = (
        ("arguments", "<tool_call>\n", "\n</tool_call>", "\n")
        if parser == "hermes"
        else ("parameters", "", "", "; ")
    )
    lines = [f"start: call ({literal(sep)} call)*" if parallel else "start: call"]
    names = [f"fn_{i}" for i in range(len(functions))]
    head = f"{literal(open_)} " if open_ else ""
    tail = f" {literal(close)}" if close else ""
    lines.append(f"call: {head}({' | '.join(names)}){tail}")
    for name, fn in zip(names, functions, strict=True):
        lines.append(f"{name}: %json {json.dumps(_call_schema(fn, key))}")
    return "\n".join(lines)


# --- parsing ------------------------------------------------------------------------------

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _call_from(obj: Any, keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in keys:
        if key in obj:
            args = obj[key]
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            return ToolCall(obj["name"], text)
    return None


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text around the calls, or None where there is none; the calls). A block that is
    not a call (an unfinished one, cut by max_tokens) stays in the text."""
    calls: list[ToolCall] = []
    parts: list[str] = []
    i = 0
    while (start := text.find(_HERMES_OPEN, i)) >= 0:
        parts.append(text[i:start])
        end = text.find(_HERMES_CLOSE, start)
        stop = len(text) if end < 0 else end + len(_HERMES_CLOSE)
        call = _hermes_call(text[start + len(_HERMES_OPEN) : len(text) if end < 0 else end])
        if call is None:
            parts.append(text[start:stop])
        else:
            calls.append(call)
        i = stop
    parts.append(text[i:])
    if not calls:
        return text, []
    content = "".join(parts).strip()
    return content or None, calls


def _hermes_call(body: str) -> ToolCall | None:
    try:
        return _call_from(json.loads(body), ("arguments", "parameters"))
    except ValueError:
        return None


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    body = body.removeprefix(_PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, i = [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except ValueError:
            return text, []
        call = _call_from(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return None, calls


PARSERS: dict[str, Callable[[str], tuple[str | None, list[ToolCall]]]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}


@dataclass
class ToolStream:
    """A streamed choice's text, split into content deltas and tool-call deltas. Text that
    may begin a call is held back until it is known: hermes streams content up to
    `<tool_call>` and each call once its block closes; llama3_json streams content unless the
    output starts as a call, which is then parsed whole at the end."""

    parser: str
    text: str = ""
    sent: int = 0  # characters of `text` already sent as content or calls
    num_calls: int = 0
    held: bool = False  # llama3_json: the output is a call

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool-call deltas to send now)."""
        self.text += delta
        if self.parser == "hermes":
            return self._hermes(final)
        return self._llama3(final)

    def _hermes(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content, deltas = "", list[dict[str, Any]]()
        while True:
            pending = self.text[self.sent :]
            start = pending.find(_HERMES_OPEN)
            if start < 0:
                keep = 0 if final else partial_suffix(pending, _HERMES_OPEN)
                if self.num_calls and not pending[: len(pending) - keep].strip():
                    return content, deltas  # NOTE: whitespace between calls
                content += pending[: len(pending) - keep]
                self.sent += len(pending) - keep
                return content, deltas
            if start:
                content += pending[:start] if not self.num_calls else pending[:start].strip()
                self.sent += start
                continue
            end = pending.find(_HERMES_CLOSE)
            if end < 0 and not final:
                return content, deltas
            block = pending if end < 0 else pending[: end + len(_HERMES_CLOSE)]
            _, calls = parse_hermes(block)
            self.sent += len(block)
            if not calls:
                content += block
                continue
            deltas += self._call_deltas(calls[0])

    def _llama3(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if not self.held and not self.sent:
            stripped = self.text.lstrip()
            if not stripped and not final:
                return "", []
            may_tag = bool(stripped) and _PYTHON_TAG.startswith(stripped) and not final
            self.held = stripped.startswith(("{", _PYTHON_TAG)) or may_tag
        if self.held and not final:
            return "", []
        if self.held:
            content, calls = parse_llama3_json(self.text)
            self.sent = len(self.text)
            if calls:
                return "", [d for c in calls for d in self._call_deltas(c)]
            return content or "", []
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta, []

    def _call_deltas(self, call: ToolCall) -> list[dict[str, Any]]:
        """OpenAI's order: id, type and name with empty arguments, then the argument text."""
        index = self.num_calls
        self.num_calls += 1
        head = ToolCall(call.name, "").as_openai(index)
        return [head, {"index": index, "function": {"arguments": call.arguments}}]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
