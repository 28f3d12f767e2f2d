"""Request bodies of the OpenAI APIs, /v1/chat/completions and /v1/completions (main process).

Each body is decoded into its Struct (types and ranges checked by msgspec), checked for what
the types cannot say (logprob options, prompt shapes, context length), and expanded into one
GenerateRequest per prompt and choice.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tokenmill.frontend.api import tools as tool_calls
from tokenmill.frontend.api.chat_template import ChatTemplateError
from tokenmill.frontend.api.common import (
    MAX_STOP_OPENAI,
    ApiError,
    NonNegative,
    NumChoices,
    ParsedRequest,
    Penalty,
    PromptOptions,
    RequestContext,
    Seed,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
    build_choices,
    check_model,
    check_token_ids,
    check_unsupported,
    decode_body,
    logprobs_processed,
    lora_of,
    new_id,
    routed_experts_start,
    stop_strings,
)
from tokenmill.frontend.api.constraints import (
    Asked,
    add_response_format,
    add_sglang_fields,
    add_structured_outputs,
    json_schema_grammar,
)
from tokenmill.frontend.api.reasoning import prompt_opens_thought
from tokenmill.frontend.api.sampling import (
    RepetitionPenalty,
    SamplingInput,
    sampling_fields,
)
from tokenmill.protocol.requests import Constraint, DetokenizeParams, LogprobParams

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # ignored: no padding is added to chunks


class _IgnoredFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's request fields that change nothing here, taken so that the clients and
    frameworks that set them work unchanged (docs/api.md lists them; tested one by one)."""

    metadata: dict[str, str] | None = None
    store: bool | None = None  # nothing is stored for later retrieval (chat, completions)
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no hint
    prompt_cache_retention: str | None = None


IGNORED_CHAT_FIELDS = (
    *_IgnoredFields.__struct_fields__,
    "verbosity",
    "prediction",
    "stream_options.include_obfuscation",
)
IGNORED_COMPLETION_FIELDS = ("user", "stream_options.include_obfuscation")


class _OpenAIFields(_IgnoredFields, kw_only=True, forbid_unknown_fields=True):
    """Fields chat and completions share (with vLLM's extensions top_k, min_p, ...)."""

    model: str | None = None
    n: NumChoices | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop_token_ids: list[NonNegative] | None = None
    ignore_eos: bool | None = None
    min_tokens: NonNegative | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[str, float] | None = None
    # Output constraints (constraints.py): OpenAI's, vLLM's and SGLang's shapes.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    json_schema: Any = None  # SGLang: a JSON schema's text
    regex: str | None = None  # SGLang
    ebnf: str | None = None  # SGLang: an EBNF (GBNF) grammar
    # False: no drafts for this request where the server speculates (--speculative-config);
    # its tokens and logprobs are the same either way
    speculative_decoding: bool | None = None
    # vLLM's: the prompt's and each choice's token ids in the response (streamed: the
    # prompt's with a choice's first chunk, each chunk's new ones)
    return_token_ids: bool | None = None
    # SGLang's (--enable-return-routed-experts): the response's sglext.routed_experts
    return_routed_experts: bool | None = None
    # raw (the model's own distribution) or processed (the one sampled from); default: the
    # server's --logprobs-mode
    logprobs_mode: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's "refusal" part


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # What the openai SDK keeps on an assistant message it returned, sent back as it is
    # (`messages.append(completion.choices[0].message)`): a refusal stands for missing
    # content; annotations change nothing; audio and function_call must be null.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    # An earlier turn's reasoning (the `reasoning_content` / `reasoning` of our answers),
    # rendered where the chat template shows it (Qwen3's does)
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionBody(_OpenAIFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # tool_choice required: one call or several
    # NOTE: OpenAI's deprecated function calling: asking for it is a 400, never ignored.
    functions: list[Any] | None = None
    function_call: Any = None
    # Variables for the chat template (vLLM's), e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None
    # Given to the chat template as `reasoning_effort` (gpt-oss's reads it); else no effect
    reasoning_effort: str | None = None
    verbosity: str | None = None  # ignored: no model here reads it
    prediction: dict[str, Any] | None = None  # ignored: a latency hint, the output is the same
    # Output we cannot produce: a 400 when asked for (text is the only modality served)
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None


class CompletionBody(_OpenAIFields, kw_only=True):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by `_prompts`
    max_tokens: NonNegative | None = None
    echo: bool | None = None
    logprobs: TopLogprobs | None = None
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1)] | None = None


def _options(
    body: _OpenAIFields,
    ctx: RequestContext,
    max_tokens: int | None,
    min_max_tokens: int,
    prompt_param: str,
    logprobs: LogprobParams,
    constraint: Constraint | None = None,
) -> PromptOptions:
    given = SamplingInput(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.logit_bias,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
    )
    sampling = sampling_fields(given, ctx)
    routed_start = routed_experts_start(body.return_routed_experts, 0, ctx)
    detokenize = DetokenizeParams(
        stop=stop_strings(body.stop, MAX_STOP_OPENAI),
        skip_special_tokens=body.skip_special_tokens is not False,
        include_stop_str=bool(body.include_stop_str_in_output),
        routed_experts=routed_start >= 0,
    )
    return PromptOptions(
        n=body.n or 1,
        max_tokens=max_tokens,
        min_max_tokens=min_max_tokens,
        max_tokens_param="max_tokens",
        prompt_param=prompt_param,
        seed=body.seed,
        sampling=sampling,
        logprobs=logprobs,
        detokenize=detokenize,
        constraint=constraint,
        speculative=body.speculative_decoding is not False,
        routed_experts_start=routed_start,
    )


def _constraints(body: _OpenAIFields) -> Asked:
    asked = Asked()
    add_response_format(asked, body.response_format)
    add_structured_outputs(asked, body.structured_outputs)
    add_sglang_fields(asked, "", body.json_schema, body.regex, body.ebnf)
    return asked


def _message_dict(i: int, message: ChatMessage) -> dict[str, Any]:
    if message.role not in ROLES:
        raise ApiError(
            f"unknown role {message.role!r}; use one of {sorted(ROLES)}", f"messages[{i}].role"
        )
    for name, value in (("audio", message.audio), ("function_call", message.function_call)):
        if value is not None:
            what = "audio is not served" if name == "audio" else "use tool_calls instead"
            raise ApiError(f"a message's {name} must be null: {what}", f"messages[{i}].{name}")
    content = _content_text(i, message)
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    reasoning = message.reasoning_content or message.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise ApiError("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
        out["tool_calls"] = [
            _past_call(call, f"messages[{i}].tool_calls[{j}]")
            for j, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _content_text(i: int, message: ChatMessage) -> str:
    content = message.content
    if content is None:
        if message.role != "assistant":
            raise ApiError("message content is missing", f"messages[{i}].content")
        return message.refusal or ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        text = part.refusal if part.type == "refusal" else part.text
        if part.type not in ("text", "refusal") or text is None:
            raise ApiError(
                f"content part type {part.type!r} is not supported; only text parts are",
                f"messages[{i}].content[{j}].type",
            )
        texts.append(text)
    # NOTE: parts are joined as they are, with nothing in between.
    return "".join(texts)


def _past_call(call: dict[str, Any], param: str) -> dict[str, Any]:
    """An assistant's call as templates read it: arguments as an object (they `tojson` it),
    whether the client sent it as OpenAI's JSON text or as an object."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError("a tool call needs function.name", f"{param}.function")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ApiError(
                "function.arguments is not JSON", f"{param}.function.arguments"
            ) from None
    return {**call, "type": "function", "function": {**fn, "arguments": args}}


def _tool_setup(
    body: ChatCompletionBody,
    ctx: RequestContext,
    asked: Asked,
    messages: list[dict[str, Any]],
    variables: dict[str, Any],
) -> tuple[str | None, list[dict[str, Any]] | None]:
    """What the request's tools mean: the parser of its output (None: not read for calls),
    the tools to render, and (tool_choice required or named) the call grammar added to
    `asked`."""
    check_unsupported({"functions": body.functions, "function_call": body.function_call})
    if not body.tools:  # NOTE: `tools: []` too (openai-agents sends it), as vLLM takes it
        if body.tool_choice not in (None, "none", "auto"):
            raise ApiError("`tool_choice` needs `tools`", "tool_choice")
        return None, None
    functions = tool_calls.parse_tools(body.tools)
    choice, chosen = tool_calls.chosen_functions(functions, body.tool_choice)
    for i, fn in enumerate(functions):
        param = f"tools[{i}].function.parameters"
        if ctx.grammar is not None:
            ctx.grammar.check(
                "tool parameters schema", json_schema_grammar(fn.parameters, param), param
            )
    rendered = [fn.spec for fn in functions]
    _check_template_shows_tools(ctx, messages, rendered, variables)
    if choice == "none":
        return None, rendered
    source = ctx.chat_template.source if ctx.chat_template else None
    parser = tool_calls.pick_parser(ctx.tool_call_parser, source)
    if parser is None:
        raise ApiError(
            "no tool-call format is known for this model's chat template; start the server "
            "with --tool-call-parser hermes or llama3_json",
            "tools",
        )
    if choice in ("required", "named"):
        # NOTE: a forced call leaves no text for response_format to shape: taken and ignored,
        # as OpenAI takes both (instructor's Responses mode sends both, the same schema)
        asked.items = [item for item in asked.items if item[0] != "response_format"]
        parallel = choice == "required" and body.parallel_tool_calls is not False
        grammar = tool_calls.call_grammar(parser, chosen, parallel, _literal(ctx))
        asked.add("tool_choice", "tool_call", grammar)
    return parser, rendered


def _check_template_shows_tools(
    ctx: RequestContext,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    variables: dict[str, Any],
) -> None:
    shown = render_chat(ctx, messages, tools, variables) != render_chat(
        ctx, messages, None, variables
    )
    if not shown:
        raise ApiError("this model's chat template does not render tools", "tools")


def _literal(ctx: RequestContext) -> Any:
    """A fixed text in a Lark grammar: its special tokens as token references."""
    specials = ctx.tokenizer.special_tokens

    def literal(text: str) -> str:
        parts = [text]
        for token in specials:
            if token in text:
                parts = [p for part in parts for p in _split_keep(part, token)]
        return " ".join(
            f"<[{specials[p]}]>" if p in specials else json.dumps(p) for p in parts if p
        )

    return literal


def _split_keep(text: str, token: str) -> list[str]:
    pieces = text.split(token)
    out = [pieces[0]]
    for piece in pieces[1:]:
        out += [token, piece]
    return out


def _check_stream_options(body: _OpenAIFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise ApiError("`stream_options` is only allowed with `stream: true`", "stream_options")


_RESERVED_VARIABLES = frozenset({"messages", "tools", "bos_token", "eos_token"})


def template_variables(
    kwargs: dict[str, Any] | None, reasoning_effort: str | None
) -> dict[str, Any]:
    """What a request adds to the chat template's variables."""
    variables = dict(kwargs or {})
    for key in variables:
        if key in _RESERVED_VARIABLES:
            raise ApiError(
                f"chat_template_kwargs may not set {key!r}", f"chat_template_kwargs.{key}"
            )
    if reasoning_effort is not None:
        variables.setdefault("reasoning_effort", reasoning_effort)
    return variables


def _check_text_output(body: ChatCompletionBody) -> None:
    """Fields asking for output other than text: a 400, never ignored."""
    others = sorted(set(body.modalities or ()) - {"text"})
    if others:
        raise ApiError(f"modalities {others} are not served; only text is", "modalities")
    check_unsupported({"audio": body.audio, "web_search_options": body.web_search_options})


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the template reads them (checked; `messages[i]` in errors)."""
    return [_message_dict(i, m) for i, m in enumerate(messages)]


def render_chat(
    ctx: RequestContext,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    variables: dict[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation, through the chat template."""
    if ctx.chat_template is None:
        raise ApiError("this model has no chat template; use /v1/completions", "messages")
    try:
        return ctx.chat_template.render(messages, tools, variables)
    except ChatTemplateError as e:
        raise ApiError(str(e), "messages") from e


def parse_chat(raw: bytes, ctx: RequestContext) -> ParsedRequest:
    return chat_request(decode_body(raw, ChatCompletionBody), ctx, new_id("chatcmpl"))


def chat_request(body: ChatCompletionBody, ctx: RequestContext, response_id: str) -> ParsedRequest:
    """A chat body (decoded, or built from another API's) checked and expanded."""
    model = check_model(body.model, ctx)
    _check_stream_options(body)
    _check_text_output(body)
    messages = chat_messages(body.messages)
    variables = template_variables(body.chat_template_kwargs, body.reasoning_effort)
    asked = _constraints(body)
    tool_parser, rendered_tools = _tool_setup(body, ctx, asked, messages, variables)
    constraint = asked.resolve(ctx.grammar)
    top = body.top_logprobs or 0
    if top > 0 and not body.logprobs:
        raise ApiError("top_logprobs requires logprobs to be true", "top_logprobs")
    if top > ctx.max_logprobs:
        raise ApiError(f"top_logprobs must be at most {ctx.max_logprobs}", "top_logprobs")
    text = render_chat(ctx, messages, rendered_tools, variables)
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    thinking = prompt_opens_thought(text) if ctx.reasoning_parser else None
    logprobs = LogprobParams(
        return_logprob=bool(body.logprobs),
        num_top=top,
        processed=logprobs_processed(body.logprobs_mode, ctx),
    )
    max_tokens = body.max_completion_tokens or body.max_tokens
    opts = _options(body, ctx, max_tokens, 1, "messages", logprobs, constraint)
    return ParsedRequest(
        api="chat",
        response_id=response_id,
        model=model,
        choices=build_choices(response_id, [ids], [None], opts, ctx, lora_of(model, ctx)),
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        logprobs=bool(body.logprobs),
        tool_parser=tool_parser,
        named_tool=isinstance(body.tool_choice, dict),
        thinking=thinking,
        return_token_ids=bool(body.return_token_ids),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompts(prompt: Any, ctx: RequestContext) -> tuple[list[list[int]], list[str | None]]:
    """Token ids and text of each prompt: a string, strings, token ids, or lists of them."""
    error = ApiError(
        "prompt must be a string, a list of strings, a list of token ids, "
        "or a list of lists of token ids",
        "prompt",
    )
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError("prompt must not be empty", "prompt") if prompt == [] else error
    if all(_is_int(t) for t in prompt):
        prompt = [prompt]
    ids_list: list[list[int]] = []
    texts: list[str | None] = []
    for item in prompt:
        if isinstance(item, str):
            if not item:
                raise ApiError("prompt must not be empty", "prompt")
            ids_list.append(ctx.tokenizer.encode(item))
            texts.append(item)
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            check_token_ids(item, ctx, "prompt")
            ids_list.append(item)
            texts.append(None)
        else:
            raise error
    return ids_list, texts


def parse_completion(raw: bytes, ctx: RequestContext) -> ParsedRequest:
    body = decode_body(raw, CompletionBody)
    model = check_model(body.model, ctx)
    _check_stream_options(body)
    check_unsupported({"suffix": body.suffix})
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise ApiError("best_of is not supported (it must equal n)", "best_of")
    if body.logprobs is not None and body.logprobs > ctx.max_logprobs:
        raise ApiError(f"logprobs must be at most {ctx.max_logprobs}", "logprobs")
    ids_list, texts = _prompts(body.prompt, ctx)
    echo = bool(body.echo)
    has_logprobs = body.logprobs is not None
    if echo or has_logprobs:  # the text is echoed, and text_offset counts from its length
        texts = [
            ctx.tokenizer.decode(ids) if t is None else t
            for ids, t in zip(ids_list, texts, strict=True)
        ]
    logprobs = LogprobParams(
        return_logprob=has_logprobs,
        num_top=body.logprobs or 0,
        prompt_start=0 if echo and has_logprobs else -1,
        processed=logprobs_processed(body.logprobs_mode, ctx),
    )
    constraint = _constraints(body).resolve(ctx.grammar)
    # NOTE: `max_tokens: 0` with echo scores the prompt without generating (lm-eval).
    opts = _options(body, ctx, body.max_tokens, 0 if echo else 1, "prompt", logprobs, constraint)
    response_id = new_id("cmpl")
    return ParsedRequest(
        api="completion",
        response_id=response_id,
        model=model,
        choices=build_choices(response_id, ids_list, texts, opts, ctx, lora_of(model, ctx)),
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        echo=echo,
        logprobs=has_logprobs,
        return_token_ids=bool(body.return_token_ids),
    )
