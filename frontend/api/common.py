"""Request parsing shared by the HTTP APIs (main process): errors, limits, request building.

Bodies are decoded by msgspec into typed Structs, so that every wrong type or out-of-range
value becomes an OpenAI error object naming its param; the endpoint modules
(`openai_requests`, `native_requests`; sampling values through
`sampling`) then turn them into `GenerateRequest`s, one per prompt and choice,
through `build_choices`.
"""

from __future__ import annotations

import re
import secrets
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np
from msgspec import Meta

from tokenmill.frontend.api.chat_template import ChatTemplate
from tokenmill.frontend.api.lora_names import LoraNames
from tokenmill.frontend.api.rerank_prompt import RerankPrompt
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.protocol.arrays import pack
from tokenmill.protocol.requests import (
    Constraint,
    DetokenizeParams,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
)

# NOTE: choices per prompt (`n`) and choices per HTTP request (prompts x n) are capped so
# that no single request can fill the engine's queue; a larger batch is a 400, not a stall.
MAX_N = 16
MAX_CHOICES = 256
MAX_STOP_OPENAI = 4  # OpenAI's own limit on `stop`
MAX_STOP_NATIVE = 32
MAX_TOKEN_IDS_LOGPROB = 256  # native `token_ids_logprob`
MAX_TOP_LOGPROBS = 20
SEED_BITS = 63

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]  # -1 and 0 = off
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
NonNegative = Annotated[int, Meta(ge=0)]
NumChoices = Annotated[int, Meta(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]


class ApiError(Exception):
    """An error the client caused (or is told about): becomes OpenAI's error object."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class RequestContext:
    """What validation needs to know about the served model."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    served_model_name: str
    max_model_len: int
    max_logprobs: int
    max_score_items: int = 4096  # --max-score-items
    rerank: RerankPrompt | None = None  # --rerank-template and --rerank-labels
    grammar: Any = None  # constraints.GrammarValidator; None: no constraints (no tokenizer)
    tool_call_parser: str = "auto"  # --tool-call-parser
    logprobs_mode: str = "raw"  # --logprobs-mode: a request's without `logprobs_mode`
    reasoning_parser: str = ""  # --reasoning-parser; "": answers are not split
    routed_experts: bool = False  # --enable-return-routed-experts
    adapters: LoraNames | None = None  # --enable-lora: the adapters a request may name


@dataclass(frozen=True)
class Choice:
    """One GenerateRequest and what its response needs: its index and its prompt."""

    index: int
    request: GenerateRequest
    prompt_index: int
    prompt_ids: list[int]
    prompt_text: str | None  # completions `echo` / text_offset; None when not needed


@dataclass(frozen=True)
class ParsedRequest:
    api: str  # "chat" | "completion" | "generate" | "score"
    response_id: str
    model: str
    choices: list[Choice]
    stream: bool = False
    include_usage: bool = False
    echo: bool = False  # completions: the prompt text comes first
    logprobs: bool = False  # chat/completions: choices carry logprobs
    batched: bool = False  # native: the response is a list (batch of prompts or n > 1)
    text_in_logprobs: bool = True  # native `return_text_in_logprobs`
    tool_parser: str | None = None  # chat with tools: the format its output is read in
    named_tool: bool = False  # tool_choice named a function: the call ends with "stop"
    # --reasoning-parser: whether the prompt left the model thinking; None: not split
    thinking: bool | None = None
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids

    @property
    def wants_logprobs(self) -> bool:
        lp = self.choices[0].request.logprobs
        return lp.return_logprob or lp.num_top > 0 or lp.prompt_start >= 0 or bool(lp.token_ids)


@dataclass(frozen=True)
class PromptOptions:
    """Per-request settings shared by all of its prompts' choices."""

    n: int
    max_tokens: int | None
    min_max_tokens: int  # smallest allowed max_tokens (0 only when scoring a prompt)
    max_tokens_param: str
    prompt_param: str
    seed: int | None
    sampling: dict[str, Any]  # SamplingParams fields other than max_tokens and seed
    logprobs: LogprobParams
    detokenize: DetokenizeParams
    min_tokens_param: str = "min_tokens"
    constraint: Constraint | None = None
    speculative: bool = True  # False: this request never drafts (speculative decoding)
    routed_experts_start: int = -1  # return the experts of positions from here; -1: no


T = TypeVar("T")
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_FIELD = re.compile(r"field `([^`]+)`")


def decode_body(body: bytes, type_: type[T]) -> T:
    """The JSON body as `type_`, or an ApiError naming the offending param."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        text = str(e)
        path = _PATH.search(text)
        field = _FIELD.search(text)
        param = path.group(1) if path else field.group(1) if field else None
        if path and field and text.startswith("Object contains unknown field"):
            param = f"{path.group(1)}.{field.group(1)}"  # NOTE: the field, not its parent
        message = _PATH.sub("", text)
        if text.startswith("Object contains unknown field"):
            message = f"{message}: this server does not support it"
        raise ApiError(f"{message} (param `{param}`)" if param else message, param) from e
    except msgspec.DecodeError as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from e
    except RecursionError:
        raise ApiError("the request body nests arrays or objects too deeply") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(model: str | None, ctx: RequestContext) -> str:
    """The model a request names: the served model (also where it names none) or, with
    --enable-lora, a loaded adapter; else a 404."""
    if model is None or model == ctx.served_model_name:
        return ctx.served_model_name
    if ctx.adapters is not None and model in ctx.adapters:
        return model
    adapters = "" if ctx.adapters is None else "".join(f", `{a}`" for a in ctx.adapters.paths)
    raise ApiError(
        f"The model `{model}` does not exist; this server serves `{ctx.served_model_name}`"
        f"{adapters}.",
        "model",
        status=404,
        code="model_not_found",
    )


def lora_of(model: str, ctx: RequestContext) -> str:
    """The adapter a checked model name runs (check_model's answer), "" for the base."""
    return "" if model == ctx.served_model_name else model


def is_token_ids(value: Any) -> bool:
    """A list of ints (JSON booleans are not token ids)."""
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def check_token_ids(ids: list[int], ctx: RequestContext, param: str) -> None:
    vocab = ctx.tokenizer.vocab_size
    for i in ids:
        if not 0 <= i < vocab:
            raise ApiError(f"token id {i} is out of the vocabulary range [0, {vocab})", param)


def check_unsupported(values: dict[str, Any]) -> None:
    """Features we do not implement: a 400 when asked for, never silently ignored."""
    for param, value in values.items():
        if value:
            raise ApiError(f"`{param}` is not supported by this server", param)


def stop_strings(stop: str | list[str] | None, limit: int, param: str = "stop") -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > limit:
        raise ApiError(f"at most {limit} stop sequences are allowed", param)
    if any(s == "" for s in stops):
        raise ApiError("stop sequences must not be empty", param)
    return stops


def resolve_max_tokens(prompt_len: int, opts: PromptOptions, ctx: RequestContext) -> int:
    limit = ctx.max_model_len
    if prompt_len + opts.min_max_tokens > limit:
        raise ApiError(
            f"This model's maximum context length is {limit} tokens; the prompt has "
            f"{prompt_len} tokens, which leaves no room for output. Please shorten the prompt.",
            opts.prompt_param,
        )
    if opts.max_tokens is None:
        return limit - prompt_len
    if prompt_len + opts.max_tokens > limit:
        raise ApiError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + opts.max_tokens} tokens ({prompt_len} in the prompt, "
            f"{opts.max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            opts.max_tokens_param,
        )
    if opts.max_tokens < opts.min_max_tokens:
        raise ApiError(f"max_tokens must be at least {opts.min_max_tokens}", opts.max_tokens_param)
    return opts.max_tokens


def logprobs_processed(mode: str | None, ctx: RequestContext) -> bool:
    """Whether a request's sampled logprobs describe the distribution sampled from: its
    `logprobs_mode`, else the server's --logprobs-mode."""
    mode = mode or ctx.logprobs_mode
    if mode not in ("raw", "processed"):
        raise ApiError(f"logprobs_mode {mode!r}: use raw or processed", "logprobs_mode")
    return mode == "processed"


def routed_experts_start(asked: bool | None, start: int | None, ctx: RequestContext) -> int:
    """A request's `return_routed_experts` (and SGLang's `routed_experts_start_len`) -> the
    first position whose experts come back; -1: not asked (the start is then ignored, as
    SGLang ignores it)."""
    if not asked:
        return -1
    if not ctx.routed_experts:
        raise ApiError(
            "this server returns no routed experts: start it with "
            "--enable-return-routed-experts (a mixture-of-experts model)",
            "return_routed_experts",
        )
    return start or 0


def draw_seed(seed: int | None) -> int:
    return secrets.randbits(SEED_BITS) if seed is None else seed


def build_choices(
    base_id: str,
    prompts: list[list[int]],
    prompt_texts: list[str | None],
    opts: PromptOptions,
    ctx: RequestContext,
    lora: str | list[str] = "",
) -> list[Choice]:
    """One GenerateRequest per prompt and choice; choice j of a prompt samples with seed + j,
    so a prompt in a batch gets what it would get alone with the same seed. `lora`: the
    adapter every prompt runs with, or each prompt's ("": the base model)."""
    loras = [lora] * len(prompts) if isinstance(lora, str) else lora
    if len(prompts) * opts.n > MAX_CHOICES:
        raise ApiError(
            f"{len(prompts)} prompts x n={opts.n} is more than {MAX_CHOICES} choices", "n"
        )
    seed = draw_seed(opts.seed)
    choices: list[Choice] = []
    for p, (ids, text) in enumerate(zip(prompts, prompt_texts, strict=True)):
        if not ids:
            raise ApiError("the prompt is empty", opts.prompt_param)
        max_tokens = resolve_max_tokens(len(ids), opts, ctx)
        if opts.sampling.get("min_tokens", 0) > max_tokens:
            raise ApiError(
                f"min_tokens ({opts.sampling['min_tokens']}) must not exceed max_tokens "
                f"({max_tokens})",
                opts.min_tokens_param,
            )
        if opts.routed_experts_start > len(ids):
            raise ApiError(
                f"routed_experts_start_len {opts.routed_experts_start} is past the prompt's "
                f"{len(ids)} tokens",
                "routed_experts_start_len",
            )
        input_ids = pack(np.asarray(ids, dtype=np.int32))
        for j in range(opts.n):
            index = len(choices)
            sampling = SamplingParams(
                max_tokens=max_tokens,
                seed=(seed + j) & (2**SEED_BITS - 1),
                **opts.sampling,
            )
            request = GenerateRequest(
                req_id=f"{base_id}-{index}",
                input_ids=input_ids,
                sampling=sampling,
                logprobs=opts.logprobs,
                detokenize=opts.detokenize,
                constraint=opts.constraint,
                speculative=opts.speculative,
                routed_experts_start=opts.routed_experts_start,
                lora_name=loras[p],
            )
            choices.append(Choice(index, request, p, ids, text))
    return choices
