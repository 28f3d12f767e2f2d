"""The scoring APIs (main process): many prompts that share a query, each read at the next
token's distribution over a few label tokens; nothing is generated for the caller.

- POST /v1/score, SGLang's shape: `{"scores": [[P(label) for each label] for each item]}`.
- POST /generative_scoring, vLLM's shape: `{"data": [{"index", "object": "score", "score"}]}`,
  the score being the first label's probability.
- POST /v1/rerank and /rerank, the Cohere / Jina shape vLLM serves: documents ranked by
  P(yes) / (P(yes) + P(no)) after the prompt of rerank_prompt.py.

Each item is one GenerateRequest: prompt = query + item (item + query with `item_first`),
max_tokens 1, greedy, the labels as its `token_ids`. The items say how long the query is
(`shared_prefix_len`), so the scheduler prefills it once and every item extends it from the
prefix cache. Values are the engine's float32 log-softmax of the raw logits at the prompt's
last position; a probability is its exp, and `apply_softmax` renormalises over the distinct
label ids (in float64 here).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import Meta

from tokenmill.frontend.api.common import (
    MAX_TOKEN_IDS_LOGPROB,
    ApiError,
    Choice,
    NonNegative,
    ParsedRequest,
    RequestContext,
    check_model,
    check_token_ids,
    decode_body,
    is_token_ids,
    lora_of,
    new_id,
)
from tokenmill.protocol.arrays import pack
from tokenmill.protocol.requests import (
    DetokenizeParams,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
)

LabelIds = Annotated[list[NonNegative], Meta(max_length=MAX_TOKEN_IDS_LOGPROB)]


class ScoreBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """/v1/score (SGLang) and /generative_scoring (vLLM): the same fields."""

    model: str | None = None
    query: str | list[int] | None = None
    items: str | list[Any] | None = None  # texts or token-id lists, checked by `_item_ids`
    label_token_ids: LabelIds | None = None
    apply_softmax: bool | None = None  # default: false (SGLang), true (vLLM)
    item_first: bool = False
    add_special_tokens: bool = True  # for the text at the prompt's start


class RerankBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    query: str
    documents: str | list[str]
    top_n: NonNegative | None = None  # 0 or none: every document
    return_documents: bool = True


@dataclass(frozen=True)
class ScoringJob:
    """The engine requests of one scoring call and what its response needs."""

    parsed: ParsedRequest  # one choice per item, in the items' order
    label_ids: tuple[int, ...]
    apply_softmax: bool
    documents: list[str] | None = None  # rerank
    top_n: int = 0
    return_documents: bool = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt_ids) for c in self.parsed.choices)


@dataclass
class ScoredItems:
    """What the engine sent back for each item, in the items' order."""

    logprobs: list[list[float]]  # one per label id
    cached_tokens: list[int]  # prompt tokens found in the prefix cache

    @classmethod
    def empty(cls, n: int) -> ScoredItems:
        return cls([[] for _ in range(n)], [0] * n)


def parse_score(raw: bytes, ctx: RequestContext) -> ScoringJob:
    return _parse_items(raw, ctx, default_softmax=False)


def parse_generative_scoring(raw: bytes, ctx: RequestContext) -> ScoringJob:
    return _parse_items(raw, ctx, default_softmax=True)


def _parse_items(raw: bytes, ctx: RequestContext, default_softmax: bool) -> ScoringJob:
    body = decode_body(raw, ScoreBody)
    model = check_model(body.model, ctx)
    if body.query is None:
        raise ApiError("`query` is required: text or a list of token ids", "query")
    if not body.label_token_ids:
        raise ApiError("`label_token_ids` must hold at least one token id", "label_token_ids")
    check_token_ids(body.label_token_ids, ctx, "label_token_ids")
    labels = tuple(body.label_token_ids)
    items = _item_ids(body, ctx)
    query = _ids(body.query, ctx, "query", special=body.add_special_tokens and not body.item_first)
    if body.item_first:
        prompts, shared = [item + query for item in items], 0
    else:
        prompts, shared = [query + item for item in items], len(query)
    apply_softmax = default_softmax if body.apply_softmax is None else body.apply_softmax
    parsed = _parsed(model, prompts, shared, labels, ctx, "items")
    return ScoringJob(parsed, labels, apply_softmax)


def parse_rerank(raw: bytes, ctx: RequestContext) -> ScoringJob:
    body = decode_body(raw, RerankBody)
    model = check_model(body.model, ctx)
    if ctx.rerank is None:
        raise ApiError(
            "/v1/rerank is off on this server: its answers (--rerank-labels) are not single "
            "tokens of this model; restart it with two that are",
            status=400,
        )
    documents = [body.documents] if isinstance(body.documents, str) else body.documents
    _check_count(len(documents), ctx, "documents")
    prompts, shared = ctx.rerank.prompts(body.query, documents, ctx.tokenizer)
    parsed = _parsed(model, prompts, shared, ctx.rerank.label_ids, ctx, "documents", "rerank")
    return ScoringJob(
        parsed,
        ctx.rerank.label_ids,
        apply_softmax=True,
        documents=documents,
        top_n=body.top_n or len(documents),
        return_documents=body.return_documents,
    )


def _check_count(count: int, ctx: RequestContext, param: str) -> None:
    if count == 0:
        raise ApiError(f"`{param}` must hold at least one entry", param)
    if count > ctx.max_score_items:
        raise ApiError(
            f"{count} {param} is more than this server's --max-score-items "
            f"({ctx.max_score_items}); split the request",
            param,
        )


def _ids(value: Any, ctx: RequestContext, param: str, special: bool) -> list[int]:
    """Text (tokenized, special tokens when `special`) or token ids, checked."""
    if isinstance(value, str):
        return ctx.tokenizer.encode(value, add_special_tokens=special)
    if not is_token_ids(value):
        raise ApiError(f"`{param}` must be text or a list of token ids", param)
    check_token_ids(value, ctx, param)
    return value


def _item_ids(body: ScoreBody, ctx: RequestContext) -> list[list[int]]:
    items = [body.items] if isinstance(body.items, str) else body.items
    if items is None:
        raise ApiError("`items` is required: texts or lists of token ids", "items")
    _check_count(len(items), ctx, "items")
    texts = all(isinstance(i, str) for i in items)
    if not texts and not all(isinstance(i, list) for i in items):
        raise ApiError("`items` must be all texts or all lists of token ids", "items")
    special = body.add_special_tokens and body.item_first
    return [_ids(item, ctx, f"items[{i}]", special) for i, item in enumerate(items)]


def _parsed(
    model: str,
    prompts: list[list[int]],
    shared: int,
    label_ids: tuple[int, ...],
    ctx: RequestContext,
    param: str,
    id_prefix: str = "score",
) -> ParsedRequest:
    """One greedy one-token request per prompt, reading the labels' logprobs."""
    response_id = new_id(id_prefix)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    logprobs = LogprobParams(token_ids=label_ids)
    detokenize = DetokenizeParams(text_in_logprobs=False)
    choices = []
    for i, ids in enumerate(prompts):
        _check_length(ids, i, ctx, param)
        request = GenerateRequest(
            req_id=f"{response_id}-{i}",
            input_ids=pack(np.asarray(ids, dtype=np.int32)),
            sampling=sampling,
            logprobs=logprobs,
            detokenize=detokenize,
            shared_prefix_len=shared,
            lora_name=lora_of(model, ctx),
        )
        choices.append(Choice(i, request, i, ids, None))
    return ParsedRequest(api="score", response_id=response_id, model=model, choices=choices)


def _check_length(ids: list[int], index: int, ctx: RequestContext, param: str) -> None:
    if not ids:
        raise ApiError(f"{param}[{index}]: the prompt is empty", param)
    if len(ids) >= ctx.max_model_len:
        raise ApiError(
            f"{param}[{index}]: the prompt has {len(ids)} tokens; this model's maximum context "
            f"length is {ctx.max_model_len}, and scoring reads the token after the prompt",
            param,
        )


def probabilities(
    label_ids: tuple[int, ...], logprobs: list[float], normalise: bool
) -> list[float]:
    """P(label) for each label: exp(logprob), or renormalised over the distinct labels."""
    by_id = dict(zip(reversed(label_ids), reversed(logprobs), strict=True))  # first one wins
    if normalise:
        top = max(by_id.values())
        weights = {t: math.exp(v - top) for t, v in by_id.items()}
        total = sum(weights.values())
        return [weights[t] / total for t in label_ids]
    return [math.exp(by_id[t]) for t in label_ids]


def _usage(job: ScoringJob, scored: ScoredItems) -> dict[str, Any]:
    tokens = job.prompt_tokens
    return {
        "prompt_tokens": tokens,
        "completion_tokens": 0,
        "total_tokens": tokens,
        "prompt_tokens_details": {"cached_tokens": sum(scored.cached_tokens)},
    }


def score_response(job: ScoringJob, scored: ScoredItems) -> dict[str, Any]:
    """SGLang's /v1/score body."""
    scores = [probabilities(job.label_ids, lp, job.apply_softmax) for lp in scored.logprobs]
    usage = _usage(job, scored)
    return {"scores": scores, "model": job.parsed.model, "usage": usage, "object": "scoring"}


def generative_scoring_response(job: ScoringJob, scored: ScoredItems) -> dict[str, Any]:
    """vLLM's /generative_scoring body."""
    data = [
        {
            "index": i,
            "object": "score",
            "score": probabilities(job.label_ids, lp, job.apply_softmax)[0],
        }
        for i, lp in enumerate(scored.logprobs)
    ]
    return {
        "id": job.parsed.response_id,
        "object": "list",
        "created": int(time.time()),
        "model": job.parsed.model,
        "data": data,
        "usage": _usage(job, scored),
    }


def rerank_response(job: ScoringJob, scored: ScoredItems) -> dict[str, Any]:
    """The Cohere / Jina / vLLM rerank body: the top_n documents, most relevant first."""
    assert job.documents is not None
    relevance = [probabilities(job.label_ids, lp, True)[0] for lp in scored.logprobs]
    order = sorted(range(len(relevance)), key=lambda i: -relevance[i])[: job.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": relevance[i]}
        if job.return_documents:
            result["document"] = {"text": job.documents[i]}
        results.append(result)
    usage = _usage(job, scored)
    del usage["completion_tokens"]  # NOTE: the rerank usage (Cohere, vLLM) has none
    return {
        "id": job.parsed.response_id,
        "model": job.parsed.model,
        "usage": usage,
        "results": results,
    }
