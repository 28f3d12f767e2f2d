"""Renders chat messages with the checkpoint's Jinja chat template (main process).

The template runs in an immutable sandbox with the same settings and helpers as
transformers' `apply_chat_template`, so the prompt text matches what the model was trained
on. The template emits bos itself: encode its output with add_special_tokens=False.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or failed on their shape)."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; `render` returns the prompt text for a list of messages."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        # NOTE: a broken template fails here, at startup, not on the first request.
        self._template = env.from_string(source)
        self.source = source
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """tools: OpenAI's tool objects, for a template that shows them (transformers'
        apply_chat_template(tools=...)); not passed at all when None. variables: more of
        the template's variables (a request's chat_template_kwargs), as transformers takes
        them; they may override add_generation_prompt, not messages or tools."""
        extra: dict[str, Any] = {"add_generation_prompt": True, **(variables or {})}
        if tools is not None:
            extra["tools"] = tools
        try:
            return self._template.render(
                messages=messages,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
                **extra,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (TypeError, ValueError, LookupError, AttributeError, RecursionError) as e:
            raise ChatTemplateError(f"chat template cannot render these messages: {e}") from e


def template_source(flag: str, checkpoint_template: str | None) -> str | None:
    """--chat-template (a file, or the template itself) or else the checkpoint's."""
    if not flag:
        return checkpoint_template
    if "{{" in flag or "{%" in flag:
        return flag
    path = Path(flag)
    if not path.is_file():
        raise ValueError(f"--chat-template {flag!r}: no such file (nor a Jinja template)")
    return path.read_text(encoding="utf-8")
