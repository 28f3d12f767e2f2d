"""Sampling parameters end to end: the real server, the `openai` client and raw HTTP.

logit_bias and min_tokens change what is generated, penalties reproduce with a seed whatever
the company and the prefix cache, stop strings that straddle a token boundary cut streamed
text, and `--logprobs-mode processed` returns the distribution sampled from.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_process import start_server

from tokenmill.frontend.tokenizer import Tokenizer

PROMPT = "The module provides functions"


def _generate(server, **sampling: object) -> dict:
    status, body = server.post(
        "/generate",
        {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, **sampling}},
    )
    assert status == 200, body
    return body


def test_logit_bias_forces_a_token(client, server) -> None:
    body = _generate(server, temperature=0, ignore_eos=True, logit_bias={"100": 100})
    assert body["output_ids"] == [100] * 12
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=1.0,
        logit_bias={"100": 100},
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 4


def test_min_tokens_holds_back_eos(server, tiny_checkpoint) -> None:
    eos = Tokenizer(tiny_checkpoint("llama")).eos_token_ids[0]
    body = _generate(server, temperature=0, min_new_tokens=5, logit_bias={str(eos): 100})
    assert len(body["output_ids"]) == 6 and body["output_ids"][-1] == eos
    assert body["meta_info"]["finish_reason"]["type"] == "stop"
    assert eos not in body["output_ids"][:5]


def test_seeded_penalties_reproduce_in_any_company(server) -> None:
    sampling = {
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 77,
        "presence_penalty": 0.8,
        "frequency_penalty": 0.6,
        "repetition_penalty": 1.4,
        "ignore_eos": True,
    }
    first = _generate(server, **sampling)  # cold
    again = _generate(server, **sampling)  # the prompt now comes from the prefix cache
    assert again["output_ids"] == first["output_ids"]
    others = [{**sampling, "seed": s, "repetition_penalty": 1.1} for s in range(12)]
    with ThreadPoolExecutor(13) as pool:
        crowd = list(pool.map(lambda s: _generate(server, **s), [sampling, *others]))
    assert crowd[0]["output_ids"] == first["output_ids"]
    plain = _generate(server, **{**sampling, "presence_penalty": 0, "repetition_penalty": 1})
    assert plain["output_ids"] != first["output_ids"], "the penalties changed nothing"


def test_stop_string_across_a_token_boundary_cuts_the_stream(client, server) -> None:
    kwargs = {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": 30,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kwargs, logprobs=0).choices[0]
    tokens = whole.logprobs.tokens
    offsets = whole.logprobs.text_offset
    text = whole.text
    # The first boundary where the last character of one token and the first of the next
    # make a string that does not occur earlier: the stop string straddles the two tokens.
    for i in range(len(tokens) - 1):
        boundary = offsets[i + 1]
        stop = text[boundary - 1 : boundary + 1]
        if tokens[i] and tokens[i + 1] and len(stop) == 2 and text.find(stop) == boundary - 1:
            break
    else:
        raise AssertionError(f"no boundary with a fresh two-character string in {tokens}")
    cut = boundary - 1
    chunks = list(client.completions.create(**kwargs, stop=[stop], stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text[:cut]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.fixture(scope="module")
def processed_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("processed") / "server.log"
    proc = start_server(
        tiny_checkpoint("llama"), log, "--logprobs-mode", "processed", "--kv-cache-tokens", "4096"
    )
    yield proc
    assert proc.stop() == 0


def test_processed_logprobs_describe_the_sampled_distribution(server, processed_server) -> None:
    kwargs = {
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 8,
        "temperature": 0.8,
        "top_p": 1.0,
        "seed": 5,
        "logprobs": True,
        "top_logprobs": 6,
        "extra_body": {"top_k": 4, "ignore_eos": True},
    }
    results = []
    for s in (server, processed_server):
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0)
        results.append(c.chat.completions.create(model=s.model, **kwargs).choices[0])
    raw, processed = results
    assert raw.message.content == processed.message.content  # same samples, other numbers
    for r, p in zip(raw.logprobs.content, processed.logprobs.content, strict=True):
        kept = [t.logprob for t in p.top_logprobs if t.logprob > -9999.0]
        assert len(kept) == 4 and p.top_logprobs[-1].logprob == -9999.0  # top_k 4
        assert math.isclose(sum(math.exp(v) for v in kept), 1.0, abs_tol=1e-4)
        assert p.logprob in [t.logprob for t in p.top_logprobs]
        assert abs(p.logprob - r.logprob) > 1e-3  # renormalised over 4 tokens, at 0.8
