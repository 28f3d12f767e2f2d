"""GET /openapi.json (main process): an OpenAPI 3.1 description of every route.

Request bodies are the very msgspec types the server decodes and validates with, so their
schema cannot drift from what is accepted. The server builds its responses as plain
dicts; their shapes are declared here as types, and tests/test_openapi.py holds real
responses against them, so that a change to either is caught.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenmill.frontend import VERSION
from tokenmill.frontend.api.native_requests import GenerateBody
from tokenmill.frontend.api.openai_requests import ChatCompletionBody, CompletionBody
from tokenmill.frontend.api.responses_requests import ResponsesBody
from tokenmill.frontend.api.scoring import RerankBody, ScoreBody
from tokenmill.frontend.api.tokenize import DetokenizeBody, TokenizeBody
from tokenmill.frontend.app.control_routes import CONTROL_ROUTES, ControlResponse
from tokenmill.frontend.app.lora_routes import LORA_ROUTES

# --- response shapes -------------------------------------------------------------------


class Shape(msgspec.Struct, forbid_unknown_fields=True):
    """A response shape: a field the server sends but the shape lacks fails the tests."""


class ErrorObject(Shape):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Shape):
    error: ErrorObject


class PromptTokensDetails(Shape):
    cached_tokens: int


class Usage(Shape):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None = None  # none in rerank
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Shape):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None  # with return_token_ids (streamed: the new ones)
    prompt_token_ids: list[int] | None = None  # with return_token_ids (streamed: once)


class CompletionResponse(Shape):
    """Also each streamed chunk (`text_completion` events, `usage` on the last if asked)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[CompletionChoice]
    usage: Usage | None = None
    weight_version: str | None = None  # the weights that produced it


class TopLogprob(Shape):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Shape):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Shape):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatMessageOut(Shape):
    role: str
    content: str | None
    refusal: None = None
    tool_calls: list[dict[str, Any]] | None = None  # with tools
    reasoning_content: str | None = None  # with --reasoning-parser
    reasoning: str | None = None  # the same, under vLLM's name


class ChatChoice(Shape):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(Shape):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChoice]
    usage: Usage
    weight_version: str | None = None  # the weights that produced it
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class GenerateResponse(Shape):
    """One per prompt (a list for a batch); `meta_info` as SGLang's: id, finish_reason,
    token counts, and [logprob, token id, text or null] triples when asked."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]


class ScoreResponse(Shape):
    scores: list[list[float]]
    model: str
    usage: Usage
    object: str


class ScoreData(Shape):
    index: int
    object: str
    score: float


class GenerativeScoringResponse(Shape):
    id: str
    object: str
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankDocument(Shape):
    text: str


class RerankResult(Shape):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(Shape):
    id: str
    model: str
    usage: Usage
    results: list[RerankResult]


class ModelCard(Shape):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model (--enable-lora)


class ModelList(Shape):
    object: str
    data: list[ModelCard]


class Health(Shape):
    status: str


class TokenizeResponse(Shape):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(Shape):
    prompt: str


class OutputText(Shape):
    type: str  # "output_text"
    text: str
    annotations: list[Any]
    logprobs: list[ChatTokenLogprob]


class ReasoningText(Shape):
    type: str  # "reasoning_text"
    text: str


class MessageItem(Shape, tag_field="type", tag="message"):
    id: str
    status: str
    role: str
    content: list[OutputText]


class ReasoningItem(Shape, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    encrypted_content: None
    status: str


class FunctionCallItem(Shape, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ResponsesUsage(Shape):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(Shape):
    """Also in each streamed event's `response` (events: `event: <type>` and `data: {"type",
    ..., "sequence_number"}` in OpenAI's order; no [DONE])."""

    id: str
    object: str
    created_at: int
    status: str
    background: bool
    error: None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: None
    model: str
    output: list[MessageItem | ReasoningItem | FunctionCallItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, str | None]
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_logprobs: int
    top_p: float | None
    truncation: str
    usage: ResponsesUsage | None
    user: str | None
    metadata: dict[str, str]
    weight_version: str | None = None


class Deleted(Shape):
    id: str
    object: str
    deleted: bool


# --- the routes ------------------------------------------------------------------------

# (path, method, summary, request type or None, 200 response type, streams)
Route = tuple[str, str, str, type | None, Any, bool]
ROUTES: list[Route] = [
    ("/v1/chat/completions", "post", "Chat completion (OpenAI)", ChatCompletionBody,
     ChatCompletionResponse, True),
    ("/v1/completions", "post", "Text completion (OpenAI)", CompletionBody, CompletionResponse,
     True),
    ("/v1/responses", "post", "A response (OpenAI's Responses API)", ResponsesBody,
     ResponseObject, True),
    ("/v1/responses/{response_id}", "get", "A stored response (without its logprobs)", None,
     ResponseObject, False),
    ("/v1/responses/{response_id}", "delete", "Forget a stored response", None, Deleted, False),
    ("/generate", "post", "Generation (SGLang's native API)", GenerateBody,
     GenerateResponse | list[GenerateResponse], True),
    ("/v1/score", "post", "Label probabilities per item (SGLang)", ScoreBody, ScoreResponse,
     False),
    ("/generative_scoring", "post", "First label's probability per item (vLLM)", ScoreBody,
     GenerativeScoringResponse, False),
    ("/v1/rerank", "post", "Rerank documents (Cohere, Jina, vLLM)", RerankBody, RerankResponse,
     False),
    ("/rerank", "post", "Rerank documents (alias of /v1/rerank)", RerankBody, RerankResponse,
     False),
    ("/tokenize", "post", "A text or a conversation as the token ids served (vLLM)",
     TokenizeBody, TokenizeResponse, False),
    ("/detokenize", "post", "Token ids as text (vLLM)", DetokenizeBody, DetokenizeResponse,
     False),
    ("/v1/models", "get", "The served model (and its LoRA adapters)", None, ModelList, False),
    ("/health", "get", "200 while the engine steps; 503 when it does not or on drain", None,
     Health, False),
]  # fmt: skip
ERRORS = {
    "400": "Invalid request (the error names the param)",
    "401": "Missing or wrong API key (with --api-key)",
    "404": "Unknown model",
    "429": "The queue is full (Retry-After)",
    "500": "The engine failed the request",
    "503": "Engine dead, draining, or queue timeout",
}


def openapi_document(rl_control: bool = False, lora: bool = False) -> dict[str, Any]:
    """The routes served; with `rl_control` (--enable-rl-control), the control routes too;
    with `lora` (--enable-lora), the LoRA routes."""
    routes = list(ROUTES)
    if lora:
        routes += [
            (path, method, summary, body, str, False)
            for path, (method, summary, body) in LORA_ROUTES.items()
        ]
    if rl_control:
        routes += [
            (path, method, summary, body, ControlResponse, False)
            for path, (method, summary, body) in CONTROL_ROUTES.items()
        ]
    types: list[Any] = [ErrorResponse]
    for _, _, _, body, response, _ in routes:
        types += [t for t in (body, response) if t is not None]
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    error_ref, refs = schemas[0], iter(schemas[1:])
    paths: dict[str, Any] = {}
    for path, method, summary, body, _, streams in routes:
        operation: dict[str, Any] = {"summary": summary}
        if body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": next(refs)}},
            }
        content: dict[str, Any] = {"application/json": {"schema": next(refs)}}
        if streams:
            content["text/event-stream"] = {
                "schema": {"type": "string"},
                "description": "with `stream: true`: `data: <chunk JSON>` events, then "
                "`data: [DONE]` (/v1/responses: OpenAI's typed events, no [DONE])",
            }
        responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
        for status, text in ERRORS.items():
            json_error = {"application/json": {"schema": error_ref}}
            responses[status] = {"description": text, "content": json_error}
        operation["responses"] = responses
        if path != "/health":
            operation["security"] = [{"bearer": []}, {}]  # NOTE: needed with --api-key only
        paths.setdefault(path, {})[method] = operation
    paths["/metrics"] = {
        "get": {
            "summary": "Prometheus metrics",
            "responses": {"200": {"description": "OK", "content": {"text/plain": {}}}},
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokenmill", "version": VERSION},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
