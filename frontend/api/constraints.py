"""Output constraints as the APIs ask for them, checked and turned into one llguidance
grammar per request (main process).

The request shapes are the peers': OpenAI's `response_format`, vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`), SGLang's `json_schema` / `regex` /
`ebnf` (in /generate's sampling_params and as extra fields of the OpenAI routes), and the
tool calls of tools.py. A grammar is validated here, with the served vocabulary and the
controller's limits (controller/grammar.py's, imported for that alone: both processes must
judge a grammar alike), so that a bad one costs a 400 and never reaches the engine.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from tokenmill.controller.grammar import mask_width, parser_limits
from tokenmill.frontend.api.common import ApiError
from tokenmill.protocol.requests import Constraint

logger = logging.getLogger(__name__)

# NOTE: the cap on what a grammar costs to compile. llguidance builds its lexer lazily, so
# validating a grammar costs about its size (Lark with 5,000 alternatives, 54 KB: 0.05 s;
# 20,000, 229 KB: 0.4 s, which the controller's loop would pay again once per new grammar).
MAX_GRAMMAR_BYTES = 64 * 1024  # a schema, regex, grammar or choice list's text at most
MAX_CHOICES = 1024

# NOTE: no whitespace the caller did not ask for: a model free to add whitespace anywhere can
# fill max_tokens with it (vLLM's `disable_any_whitespace` answers the same problem); the
# separators are json.dumps' own, the JSON most models saw.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FLEXIBLE_JSON = {"whitespace_flexible": True}


class GrammarValidator:
    """llguidance's tokenizer for the served vocabulary, built in a thread at start (about
    0.5-1 s), and the checks every constraint passes before it is sent."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._model_dir = Path(model_dir)
        self._vocab_size = vocab_size
        self._eos_ids = eos_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._failure = ""
        self._limits = parser_limits()
        self._thread = threading.Thread(target=self._build, name="grammar-tokenizer", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            text = (self._model_dir / "tokenizer.json").read_text(encoding="utf-8")
            self._tokenizer = llguidance.LLTokenizer(
                text, n_vocab=mask_width(text, self._vocab_size), eos_token=list(self._eos_ids)
            )
        except (OSError, ValueError) as e:
            self._failure = f"{type(e).__name__}: {e}"
            logger.error("grammar constraints are off: %s", self._failure)

    def check(self, kind: str, grammar: str, param: str) -> Constraint:
        """The constraint, or a 400 naming `param` and what llguidance could not take."""
        self._thread.join()
        if self._tokenizer is None:
            raise ApiError(f"this server cannot run constraints ({self._failure})", param)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer, limits=self._limits)
        if error:
            raise ApiError(f"unsupported or invalid {kind}: {_first_lines(error)}", param)
        return Constraint(kind=kind, grammar=grammar)


def _first_lines(error: str, limit: int = 600) -> str:
    text = error.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _check_size(text: str, param: str) -> None:
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise ApiError(f"the constraint is larger than {MAX_GRAMMAR_BYTES} bytes", param)


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema given as an object or as its JSON text, as text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ApiError(f"the JSON schema is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict | bool):
        raise ApiError("a JSON schema must be an object", param)
    text = json.dumps(schema)
    _check_size(text, param)
    return text


def json_schema_grammar(schema: Any, param: str, flexible: bool = False) -> str:
    options = FLEXIBLE_JSON if flexible else COMPACT_JSON
    text = _schema_text(schema, param)
    return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)  # type: ignore[arg-type]


def regex_grammar(regex: Any, param: str) -> str:
    """NOTE: \\d and \\w are ASCII ([0-9], [0-9a-zA-Z_]) as in JSON schema, JavaScript and
    the peers' xgrammar, not Rust's Unicode classes (a phone number's \\d is 0-9)."""
    if not isinstance(regex, str) or not regex:
        raise ApiError("a regex must be a non-empty string", param)
    _check_size(regex, param)
    pattern = llguidance.regex_to_lark(regex, "dw")
    return llguidance.LLMatcher.grammar_from_lark(f"start: /{pattern}/")


def choice_grammar(choices: Any, param: str) -> str:
    """Exactly one of the strings (vLLM's `choice`)."""
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ApiError("`choice` must be a non-empty list of non-empty strings", param)
    if len(choices) > MAX_CHOICES:
        raise ApiError(f"`choice` takes at most {MAX_CHOICES} strings", param)
    # NOTE: JSON string escapes are Lark's: any text is one literal.
    lark = "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    _check_size(lark, param)
    return llguidance.LLMatcher.grammar_from_lark(lark)


def lark_grammar(grammar: Any, param: str) -> str:
    """A Lark grammar (llguidance's dialect) or a GBNF / xgrammar EBNF one (`root ::= ...`)."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise ApiError("a grammar must be a non-empty string", param)
    _check_size(grammar, param)
    try:
        lark = any_to_lark(grammar)
    # NOTE: the converter raises a plain Exception for an undefined rule
    except (GbnfToLarkError, Exception) as e:  # noqa: B014
        raise ApiError(f"the EBNF grammar does not parse: {e}", param) from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Asked:
    """The constraints one request asks for, each with the param that asked; more than one
    is a 400 naming them all."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, str]] = []  # (param, kind, grammar)

    def add(self, param: str, kind: str, grammar: str) -> None:
        self.items.append((param, kind, grammar))

    def resolve(self, validator: GrammarValidator | None) -> Constraint | None:
        if not self.items:
            return None
        if len(self.items) > 1:
            names = ", ".join(f"`{p}`" for p, _, _ in self.items)
            raise ApiError(
                f"one constraint per request; this one asks for {names}", self.items[1][0]
            )
        param, kind, grammar = self.items[0]
        if validator is None:
            raise ApiError("this server runs no grammar constraints", param)
        return validator.check(kind, grammar, param)


def add_response_format(asked: Asked, response_format: dict[str, Any] | None) -> None:
    """OpenAI's response_format: text (nothing), json_object, json_schema."""
    if not response_format:
        return
    kind = response_format.get("type")
    if kind in (None, "text"):
        return
    if kind == "json_object":
        asked.add("response_format", "json_object", json_schema_grammar({"type": "object"}, ""))
        return
    if kind != "json_schema":
        raise ApiError(
            f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
            "response_format.type",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec and "name" not in spec:
        raise ApiError(
            "response_format json_schema needs {'name', 'schema'}", "response_format.json_schema"
        )
    param = "response_format.json_schema.schema"
    schema = spec.get("schema", {"type": "object"})
    asked.add("response_format", "json_schema", json_schema_grammar(schema, param))


STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OPTIONS = (
    "disable_any_whitespace",
    "disable_fallback",
    "disable_additional_properties",
    "whitespace_pattern",
    "backend",
)


def add_structured_outputs(asked: Asked, so: dict[str, Any] | None) -> None:
    """vLLM's structured_outputs object: one of json / regex / choice / grammar /
    json_object; disable_any_whitespace (default here: true) widens JSON whitespace."""
    if so is None:
        return
    if not isinstance(so, dict):
        raise ApiError("`structured_outputs` must be an object", "structured_outputs")
    unknown = sorted(set(so) - set(STRUCTURED_KEYS) - set(STRUCTURED_OPTIONS) - {"structural_tag"})
    if unknown or so.get("structural_tag") is not None:
        name = unknown[0] if unknown else "structural_tag"
        raise ApiError(
            f"`structured_outputs.{name}` is not supported", f"structured_outputs.{name}"
        )
    flexible = so.get("disable_any_whitespace") is False
    for key in STRUCTURED_KEYS:
        value = so.get(key)
        if value is None or value is False:
            continue
        param = f"structured_outputs.{key}"
        if key == "json":
            asked.add(param, "json_schema", json_schema_grammar(value, param, flexible))
        elif key == "json_object":
            asked.add(
                param, "json_object", json_schema_grammar({"type": "object"}, param, flexible)
            )
        elif key == "regex":
            asked.add(param, "regex", regex_grammar(value, param))
        elif key == "choice":
            asked.add(param, "choice", choice_grammar(value, param))
        else:
            asked.add(param, "grammar", lark_grammar(value, param))


def add_sglang_fields(asked: Asked, prefix: str, json_schema: Any, regex: Any, ebnf: Any) -> None:
    """SGLang's json_schema (a JSON text), regex and ebnf fields."""
    if json_schema is not None:
        param = f"{prefix}json_schema"
        asked.add(param, "json_schema", json_schema_grammar(json_schema, param))
    if regex is not None:
        asked.add(f"{prefix}regex", "regex", regex_grammar(regex, f"{prefix}regex"))
    if ebnf is not None:
        asked.add(f"{prefix}ebnf", "grammar", lark_grammar(ebnf, f"{prefix}ebnf"))
