"""Request bodies of the native /generate API, as SGLang defines it (main process).

`text` or `input_ids` (one prompt or a batch), `sampling_params`, and the logprob options
that make this API the one for scoring: `logprob_start_len`, `top_logprobs_num`,
`token_ids_logprob`, `return_text_in_logprobs`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tokenmill.frontend.api.common import (
    MAX_STOP_NATIVE,
    MAX_TOKEN_IDS_LOGPROB,
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
    decode_body,
    is_token_ids,
    logprobs_processed,
    lora_of,
    new_id,
    routed_experts_start,
    stop_strings,
)
from tokenmill.frontend.api.constraints import Asked, add_sglang_fields
from tokenmill.frontend.api.sampling import (
    RepetitionPenalty,
    SamplingInput,
    sampling_fields,
)
from tokenmill.protocol.requests import DetokenizeParams, LogprobParams

# SGLang's default when max_new_tokens is not given (capped to what the context leaves).
DEFAULT_MAX_NEW_TOKENS = 128


class NativeSampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: NonNegative | None = None
    min_new_tokens: NonNegative | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegative] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: NumChoices | None = None
    seed: Seed | None = None
    sampling_seed: Seed | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None  # a JSON schema's text
    regex: str | None = None
    ebnf: str | None = None  # an EBNF (GBNF) grammar, or a Lark one
    speculative_decoding: bool | None = None  # False: no drafts (as in chat and completions)


class GenerateBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None  # not in SGLang's body; checked like the OpenAI APIs' when given
    # SGLang's: the adapter (by its name) every prompt runs with, or each prompt's
    lora_path: str | list[str | None] | None = None
    text: str | list[str] | None = None
    input_ids: Any = None  # list[int] | list[list[int]], checked by `_prompts`
    sampling_params: NativeSampling | None = None
    logprobs_mode: str | None = None  # raw or processed; default: the server's --logprobs-mode
    return_logprob: bool | None = None
    logprob_start_len: Annotated[int, Meta(ge=-1)] | None = None
    top_logprobs_num: TopLogprobs | None = None
    token_ids_logprob: (
        Annotated[list[NonNegative], Meta(max_length=MAX_TOKEN_IDS_LOGPROB)] | None
    ) = None
    return_text_in_logprobs: bool | None = None
    # --enable-return-routed-experts: meta_info.routed_experts, positions from the start on
    return_routed_experts: bool | None = None
    routed_experts_start_len: NonNegative | None = None
    stream: bool | None = None
    rid: str | None = None


def _prompts(body: GenerateBody, ctx: RequestContext) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the body was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError("give exactly one of `text` and `input_ids`", "text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts or any(not t for t in texts):
            raise ApiError("text must not be empty", "text")
        return [ctx.tokenizer.encode(t) for t in texts], isinstance(body.text, list)
    ids = body.input_ids
    batched = isinstance(ids, list) and bool(ids) and all(isinstance(i, list) for i in ids)
    prompts = ids if batched else [ids]
    for prompt in prompts:
        if not is_token_ids(prompt):
            raise ApiError("input_ids must be a list of token ids or a list of them", "input_ids")
        if not prompt:
            raise ApiError("input_ids must not be empty", "input_ids")
        check_token_ids(prompt, ctx, "input_ids")
    return prompts, batched


def _logprob_params(body: GenerateBody, ctx: RequestContext) -> LogprobParams:
    top = body.top_logprobs_num or 0
    if top > ctx.max_logprobs:
        raise ApiError(f"top_logprobs_num must be at most {ctx.max_logprobs}", "top_logprobs_num")
    token_ids = tuple(body.token_ids_logprob or ())
    check_token_ids(list(token_ids), ctx, "token_ids_logprob")
    mode = logprobs_processed(body.logprobs_mode, ctx)
    if not body.return_logprob:
        return LogprobParams(token_ids=token_ids, processed=mode)
    start = -1 if body.logprob_start_len is None else body.logprob_start_len
    return LogprobParams(
        return_logprob=True, num_top=top, token_ids=token_ids, prompt_start=start, processed=mode
    )


def _options(body: GenerateBody, ctx: RequestContext) -> PromptOptions:
    sp = body.sampling_params or NativeSampling()
    asked = Asked()
    add_sglang_fields(asked, "sampling_params.", sp.json_schema, sp.regex, sp.ebnf)
    constraint = asked.resolve(ctx.grammar)
    given = SamplingInput(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        logit_bias=sp.logit_bias,
        stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos,
        min_tokens=sp.min_new_tokens,
    )
    sampling = sampling_fields(given, ctx, "sampling_params.")
    routed_start = routed_experts_start(
        body.return_routed_experts, body.routed_experts_start_len, ctx
    )
    detokenize = DetokenizeParams(
        stop=stop_strings(sp.stop, MAX_STOP_NATIVE, "sampling_params.stop"),
        skip_special_tokens=sp.skip_special_tokens is not False,
        include_stop_str=bool(sp.no_stop_trim),
        text_in_logprobs=bool(body.return_text_in_logprobs),
        routed_experts=routed_start >= 0,
    )
    return PromptOptions(
        n=sp.n or 1,
        max_tokens=sp.max_new_tokens,
        min_max_tokens=0,
        max_tokens_param="sampling_params.max_new_tokens",
        prompt_param="input_ids" if body.input_ids is not None else "text",
        seed=sp.seed if sp.seed is not None else sp.sampling_seed,
        sampling=sampling,
        logprobs=_logprob_params(body, ctx),
        detokenize=detokenize,
        min_tokens_param="sampling_params.min_new_tokens",
        constraint=constraint,
        speculative=sp.speculative_decoding is not False,
        routed_experts_start=routed_start,
    )


def _lora(
    asked: str | list[str | None] | None, num_prompts: int, model: str, ctx: RequestContext
) -> list[str]:
    """Each prompt's adapter: SGLang's `lora_path` (one name, or one per prompt; None is the
    base model), else the one `model` names."""
    if asked is None:
        return [model] * num_prompts
    names = [asked] * num_prompts if isinstance(asked, str) else asked
    if len(names) != num_prompts:
        raise ApiError(
            f"lora_path names {len(names)} adapters for {num_prompts} prompts", "lora_path"
        )
    return [check_model(name, ctx) if name else "" for name in names]


def parse_generate(raw: bytes, ctx: RequestContext) -> ParsedRequest:
    body = decode_body(raw, GenerateBody)
    model = check_model(body.model, ctx)
    prompts, batched = _prompts(body, ctx)
    lora = _lora(body.lora_path, len(prompts), lora_of(model, ctx), ctx)
    opts = _options(body, ctx)
    for ids in prompts:
        start = opts.logprobs.prompt_start
        if start >= len(ids):
            raise ApiError(
                f"logprob_start_len {start} is not below the prompt length {len(ids)}",
                "logprob_start_len",
            )
    if opts.max_tokens is None:
        # NOTE: SGLang's default, shortened rather than refused when the context is nearly full.
        room = ctx.max_model_len - max(len(ids) for ids in prompts)
        opts = replace(opts, max_tokens=max(0, min(DEFAULT_MAX_NEW_TOKENS, room)))
    # NOTE: `rid` is accepted but not used as the engine id, which must be unique.
    response_id = new_id("gen")
    choices = build_choices(response_id, prompts, [None] * len(prompts), opts, ctx, lora)
    return ParsedRequest(
        api="generate",
        response_id=response_id,
        model=ctx.served_model_name,
        choices=choices,
        stream=bool(body.stream),
        batched=batched or opts.n > 1,
        text_in_logprobs=bool(body.return_text_in_logprobs),
    )
