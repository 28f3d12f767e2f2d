"""Sampling parameters of every HTTP API, checked and completed (main process).

The endpoint modules gather what the caller gave into a `SamplingInput` (None = not given);
`sampling_fields` checks what the body types cannot say (token ids against the vocabulary,
`logit_bias` keys and values), fills what was not given from the checkpoint's
`generation_config.json` (temperature, top_p, top_k, min_p, repetition_penalty, as vLLM
does), and returns the `SamplingParams` fields other than max_tokens and seed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any

from msgspec import Meta

from tokenmill.frontend.api.common import ApiError, RequestContext, check_token_ids
from tokenmill.frontend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MAX_LOGIT_BIAS = 1024  # entries per request: each crosses to the worker every step
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias is in [-100, 100]

RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]

# generation_config.json keys used as defaults, with the range a request may give them.
_DEFAULT_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (1e-9, 1.0),
    "top_k": (-1, 2**31 - 1),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (1e-9, 2.0),
}
_OURS: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


@dataclass(frozen=True)
class SamplingInput:
    """Sampling values as an API body gives them; None = not given."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None


def sampling_fields(given: SamplingInput, ctx: RequestContext, prefix: str = "") -> dict[str, Any]:
    """SamplingParams fields (all but max_tokens and seed); `prefix` names params in errors
    (the native API's "sampling_params."). eos ends generation unless `ignore_eos`, on top of
    the caller's own stop token ids."""
    stops = list(given.stop_token_ids or ())
    check_token_ids(stops, ctx, prefix + "stop_token_ids")
    if not given.ignore_eos:
        stops += [i for i in ctx.tokenizer.eos_token_ids if i not in stops]
    defaults = generation_defaults(ctx.tokenizer)

    def pick(name: str) -> Any:
        value = getattr(given, name)
        return defaults.get(name, _OURS[name]) if value is None else value

    return {
        "temperature": float(pick("temperature")),
        "top_p": float(pick("top_p")),
        "top_k": max(int(pick("top_k")), 0),
        "min_p": float(pick("min_p")),
        "stop_token_ids": tuple(stops),
        "ignore_eos": bool(given.ignore_eos),
        "min_tokens": given.min_tokens or 0,
        "presence_penalty": given.presence_penalty or 0.0,
        "frequency_penalty": given.frequency_penalty or 0.0,
        "repetition_penalty": float(pick("repetition_penalty")),
        "logit_bias": logit_bias_pairs(given.logit_bias, ctx, prefix + "logit_bias"),
    }


def logit_bias_pairs(
    bias: dict[str, float] | None, ctx: RequestContext, param: str
) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs sorted by id, each checked."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries", param)
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(f"logit_bias key {key!r} is not a token id", param) from None
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise ApiError(f"logit_bias value {value} for token {key} is not in [-100, 100]", param)
        pairs.append((token, float(value)))
    check_token_ids([t for t, _ in pairs], ctx, param)
    if len({t for t, _ in pairs}) != len(pairs):
        raise ApiError("logit_bias names a token id twice", param)
    return tuple(sorted(pairs))


@lru_cache(maxsize=8)
def generation_defaults(tokenizer: Tokenizer) -> dict[str, float]:
    """The sampling defaults the checkpoint's generation_config.json sets (only those it
    sets, and only valid ones). NOTE: like vLLM, `do_sample` is not read."""
    config = getattr(tokenizer, "generation_config", {}) or {}
    defaults: dict[str, float] = {}
    for name, (low, high) in _DEFAULT_RANGES.items():
        value = config.get(name)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not low <= value <= high:
            logger.warning("generation_config.json: ignoring %s=%r (not in range)", name, value)
            continue
        defaults[name] = value
    if defaults:
        logger.info("sampling defaults from generation_config.json: %s", defaults)
    return defaults
