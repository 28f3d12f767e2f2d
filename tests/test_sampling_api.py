"""Sampling parameters at the HTTP layer: what each API accepts, the SamplingParams it turns
into, the 400s for values out of range, and the checkpoint's generation_config defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tokenmill.frontend.api.chat_template import ChatTemplate
from tokenmill.frontend.api.common import ApiError, RequestContext
from tokenmill.frontend.api.native_requests import parse_generate
from tokenmill.frontend.api.openai_requests import parse_chat, parse_completion
from tokenmill.frontend.server_config import SchedulerArgs, ServerConfig, validate
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.protocol.requests import SamplingParams

MESSAGES = [{"role": "user", "content": "hi"}]


def _ctx(model_dir: Path) -> RequestContext:
    tokenizer = Tokenizer(model_dir)
    template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)  # type: ignore[arg-type]
    return RequestContext(tokenizer, template, "m", 256, 20)


@pytest.fixture(scope="module")
def ctx(tiny_checkpoint) -> RequestContext:
    return _ctx(tiny_checkpoint("llama"))


def _chat(ctx: RequestContext, **body: Any) -> SamplingParams:
    raw = json.dumps({"messages": MESSAGES, "max_tokens": 8, **body}).encode()
    return parse_chat(raw, ctx).choices[0].request.sampling


def _completion(ctx: RequestContext, **body: Any) -> SamplingParams:
    raw = json.dumps({"prompt": "hi", "max_tokens": 8, **body}).encode()
    return parse_completion(raw, ctx).choices[0].request.sampling


def _generate(ctx: RequestContext, **sampling: Any) -> SamplingParams:
    raw = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 8, **sampling}})
    return parse_generate(raw.encode(), ctx).choices[0].request.sampling


EVERYTHING = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "seed": 42,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
    "repetition_penalty": 1.3,
    "logit_bias": {"17": 5.0, "3": -100},
    "stop_token_ids": [9],
    "ignore_eos": True,
}


@pytest.mark.parametrize("parse", [_chat, _completion, _generate])
def test_every_parameter_reaches_sampling_params(ctx: RequestContext, parse: Any) -> None:
    extra = {"min_new_tokens": 2} if parse is _generate else {"min_tokens": 2}
    p = parse(ctx, **EVERYTHING, **extra)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 20, 0.05, 42)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.3)
    assert p.logit_bias == ((3, -100.0), (17, 5.0))
    assert p.stop_token_ids == (9,) and p.ignore_eos and p.min_tokens == 2


def test_omitted_parameters_are_off(ctx: RequestContext) -> None:
    p = _chat(ctx)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logit_bias == () and p.min_tokens == 0 and p.temperature == 1.0
    assert set(ctx.tokenizer.eos_token_ids) <= set(p.stop_token_ids)


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"99999": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias[...]"),  # msgspec names a dict value so
    ({"logit_bias": {"5": 1.0, "05": 2.0}}, "logit_bias"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"temperature": 2.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
@pytest.mark.parametrize("parse", [_chat, _completion])
def test_out_of_range_is_a_400_naming_the_param(
    ctx: RequestContext, parse: Any, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as error:
        parse(ctx, **body)
    assert error.value.status == 400 and error.value.param == param


NATIVE_BAD = [
    ({"presence_penalty": -3}, "sampling_params.presence_penalty"),
    ({"repetition_penalty": 0}, "sampling_params.repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "sampling_params.logit_bias"),
    ({"min_new_tokens": 9}, "sampling_params.min_new_tokens"),
    ({"stop_token_ids": [10**6]}, "sampling_params.stop_token_ids"),
]


@pytest.mark.parametrize(("sampling", "param"), NATIVE_BAD)
def test_native_out_of_range_is_a_400(
    ctx: RequestContext, sampling: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as error:
        _generate(ctx, **sampling)
    assert error.value.param == param


def test_generation_config_gives_the_defaults(tiny_checkpoint, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, min_p=7.0)
    (model / "generation_config.json").write_text(json.dumps(config))
    ctx = _ctx(model)
    for parse in (_chat, _completion, _generate):
        p = parse(ctx)
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.1)
        assert p.min_p == 0.0  # out of range in the file: ignored
        given = parse(ctx, temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.0)
        assert (given.temperature, given.top_p, given.top_k) == (0.0, 1.0, 0)
        assert given.repetition_penalty == 1.0


def test_logprobs_mode_flag_is_validated() -> None:
    validate(ServerConfig(scheduler=SchedulerArgs(logprobs_mode="processed")))
    with pytest.raises(ValueError, match="--logprobs-mode"):
        validate(ServerConfig(scheduler=SchedulerArgs(logprobs_mode="softmax")))
