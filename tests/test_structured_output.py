"""Grammar constraints: the request shapes, the raw and processed logprobs under a mask, the
same tokens in every schedule, and the real server (tiny qwen2, overlap scheduling on: the
masks follow their batch while it runs).

Engine-level tests drive the real controller and a ModelRunner in process (OfflineEngine);
the server tests go through the `openai` client and check every output with `jsonschema`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from tokenmill.controller.grammar import GrammarEngine
from tokenmill.frontend.api.common import ApiError
from tokenmill.frontend.api.constraints import (
    Asked,
    GrammarValidator,
    add_response_format,
    add_structured_outputs,
    choice_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.offline.engine import OfflineEngine, OfflineOutput, OfflineRequest
from tokenmill.protocol.requests import Constraint
from tokenmill.tp_worker.config import RunnerConfig
from tokenmill.tp_worker.model_runner import ModelRunner

CLASSIFY = {
    "type": "object",
    "properties": {"label": {"enum": ["pos", "neg"]}},
    "required": ["label"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "home", "ok"],
    "additionalProperties": False,
}
PHONE = r"\d{3}-\d{4}"
LABELS = ["positive", "negative", "neutral"]


def _engine(model: Path, rows: int = 8, kv_tokens: int = 4096, **kwargs: object) -> OfflineEngine:
    runner = ModelRunner(
        RunnerConfig(
            model=str(model),
            kv_cache_tokens=kv_tokens,
            max_running_requests=rows,
            max_model_len=512,
            dtype="float32",
            device="cpu",
            logprobs_mode=str(kwargs.pop("logprobs_mode", "raw")),
        )
    )
    grammar = GrammarEngine.for_checkpoint(str(model), runner.model_config.eos_token_ids)
    return OfflineEngine(runner, grammar=grammar, **kwargs)  # type: ignore[arg-type]


def _constraints() -> list[Constraint]:
    return [
        Constraint("json_schema", json_schema_grammar(CLASSIFY, "s")),
        Constraint("json_schema", json_schema_grammar(PERSON, "s")),
        Constraint("regex", regex_grammar(PHONE, "r")),
        Constraint("choice", choice_grammar(LABELS, "c")),
    ]


def _requests(tokenizer: Tokenizer) -> list[OfflineRequest]:
    """Each constraint greedy and sampled (seeded), beside an unconstrained row."""
    prompt = tokenizer.encode("Answer in the format asked: ")
    out = []
    for i, c in enumerate(_constraints()):
        for temperature in (0.0, 1.0):
            out.append(
                OfflineRequest(
                    prompt + [7 + i],
                    max_tokens=80,
                    temperature=temperature,
                    seed=11 + i,
                    num_top=4,
                    stop_at_eos=True,
                    constraint=c,
                )
            )
    out.append(OfflineRequest(prompt, max_tokens=12, num_top=4))
    return out


def _check_output(c: Constraint, text: str) -> None:
    if c.kind == "json_schema":
        schema = CLASSIFY if '"label"' in c.grammar else PERSON
        jsonschema.validate(json.loads(text), schema)
    elif c.kind == "regex":
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
    else:
        assert text in LABELS, text


def _assert_same(a: list[OfflineOutput], b: list[OfflineOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        assert x.logprobs == y.logprobs  # NOTE: bit for bit
        assert [t.tolist() for t in x.top_ids] == [t.tolist() for t in y.top_ids]
        assert x.finish_reason == y.finish_reason


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def reference(llama: Path) -> list[OfflineOutput]:
    """The requests together, one step at a time, the prefix cache cold."""
    return _engine(llama).generate(_requests(Tokenizer(llama)))


def test_every_constrained_output_matches_its_constraint(llama: Path, reference) -> None:
    tokenizer = Tokenizer(llama)
    requests = _requests(tokenizer)
    for request, out in zip(requests, reference, strict=True):
        if request.constraint is None:
            continue
        assert out.finish_reason == "stop", (request.constraint.kind, out)
        _check_output(request.constraint, tokenizer.decode(out.output_ids))


def test_raw_logprobs_are_the_unconstrained_bits(llama: Path, reference) -> None:
    """Each constrained row's logprobs (chosen and top-k) equal, bit for bit, those of an
    unconstrained request forced down the same tokens (its prompt logprobs); the top-k is
    the model's, which may hold tokens the grammar forbade."""
    engine = _engine(llama)
    requests = _requests(Tokenizer(llama))
    forbidden_in_top = 0
    for request, out in zip(requests, reference, strict=True):
        if request.constraint is None:
            continue
        n = len(request.prompt_ids)
        forced = OfflineRequest(
            request.prompt_ids + out.output_ids,
            max_tokens=1,
            prompt_logprob_start=n,
            num_top=4,
        )
        (ref,) = engine.generate([forced])
        assert ref.prompt_logprobs == out.logprobs
        assert [t.tolist() for t in ref.prompt_top_ids] == [t.tolist() for t in out.top_ids]
        assert [t.tolist() for t in ref.prompt_top_logprobs] == [
            t.tolist() for t in out.top_logprobs
        ]
        forbidden_in_top += sum(
            int(out.output_ids[i] != top[0]) for i, top in enumerate(out.top_ids)
        )
    assert forbidden_in_top > 0, "the random model's top choice always obeyed the grammar"


@pytest.mark.parametrize(
    "schedule",
    ["decode_steps_4", "prefix_cache_hit", "no_prefix_cache", "each_alone", "chunked", "preempted"],
)
def test_a_constrained_row_gives_the_same_tokens_in_every_schedule(
    llama: Path, reference, schedule: str
) -> None:
    requests = _requests(Tokenizer(llama))
    if schedule == "decode_steps_4":
        got = _engine(llama, decode_steps=4).generate(requests)
    elif schedule == "prefix_cache_hit":
        engine = _engine(llama)
        engine.generate(requests)
        got = engine.generate(requests)
    elif schedule == "no_prefix_cache":
        got = _engine(llama, enable_prefix_cache=False).generate(requests)
    elif schedule == "each_alone":
        engine = _engine(llama, enable_prefix_cache=False)
        got = [engine.generate([r])[0] for r in requests]
    elif schedule == "chunked":
        got = _engine(llama, max_prefill_tokens=5).generate(requests)
    else:
        engine = _engine(llama, rows=9, kv_tokens=80)  # NOTE: > the longest row
        got = engine.generate(requests)
        assert engine.controller.scheduler.num_preemptions > 0
    _assert_same(got, reference)


def test_processed_logprobs_are_the_masked_distribution(llama: Path) -> None:
    """--logprobs-mode processed: the grammar's forbidden tokens get -inf (-9999.0 in
    JSON), so the allowed ones' probabilities sum to 1; at the first position of a choice
    among three labels only their first tokens are allowed."""
    tokenizer = Tokenizer(llama)
    engine = _engine(llama, logprobs_mode="processed")
    constraint = Constraint("choice", choice_grammar(["yes", "no"], "c"))
    first_ids = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no")}
    (out,) = engine.generate(
        [
            OfflineRequest(
                tokenizer.encode("Say yes or no:"),
                max_tokens=8,
                num_top=20,
                constraint=constraint,
                stop_at_eos=True,
            )
        ]
    )
    top_ids, top = out.top_ids[0], out.top_logprobs[0]
    allowed = np.isfinite(top)
    assert set(top_ids[allowed].tolist()) <= first_ids | set(_first_token_ids(tokenizer))
    assert abs(float(np.exp(top[allowed].astype(np.float64)).sum()) - 1.0) < 1e-5
    assert np.isneginf(top[~allowed]).all()
    assert tokenizer.decode(out.output_ids) in ("yes", "no")


def _first_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Every id that can begin "yes" or "no" (a one-letter token, say)."""
    out = []
    for word in ("yes", "no"):
        for i in range(1, len(word) + 1):
            ids = tokenizer.encode(word[:i], add_special_tokens=False)
            if len(ids) == 1:
                out.append(ids[0])
    return out


# --- request shapes -----------------------------------------------------------------------


def _asked(**fields: object) -> Asked:
    asked = Asked()
    add_response_format(asked, fields.get("response_format"))  # type: ignore[arg-type]
    add_structured_outputs(asked, fields.get("structured_outputs"))  # type: ignore[arg-type]
    return asked


def test_the_peers_request_shapes_become_one_constraint() -> None:
    schema = {"name": "c", "schema": CLASSIFY, "strict": True}
    cases = {
        "json_schema": {"response_format": {"type": "json_schema", "json_schema": schema}},
        "json_object": {"response_format": {"type": "json_object"}},
        "regex": {"structured_outputs": {"regex": PHONE}},
        "choice": {"structured_outputs": {"choice": LABELS}},
        "grammar": {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
    }
    for kind, fields in cases.items():
        items = _asked(**fields).items
        assert [k for _, k, _ in items] == [kind]
    assert not _asked(response_format={"type": "text"}).items
    as_text = _asked(structured_outputs={"json": json.dumps(CLASSIFY)}).items[0][2]
    assert as_text == _asked(structured_outputs={"json": CLASSIFY}).items[0][2]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": 'root ::= "a'}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
        ({"structured_outputs": {"json": {"enum": ["x" * 70_000]}}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": ["x" * 70_000]}}, "structured_outputs.choice"),
    ],
)
def test_malformed_shapes_are_400s_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        _asked(**fields)
    assert e.value.param == param and e.value.status == 400


def test_two_constraints_are_a_400_naming_both() -> None:
    asked = _asked(response_format={"type": "json_object"}, structured_outputs={"regex": PHONE})
    with pytest.raises(ApiError, match="`response_format`, `structured_outputs.regex`"):
        asked.resolve(None)


def test_the_validator_names_what_it_cannot_take(llama: Path) -> None:
    tokenizer = Tokenizer(llama)
    validator = GrammarValidator(llama, tokenizer.num_logits, tokenizer.eos_token_ids)
    bad = [
        (json_schema_grammar({"type": "strnig"}, "p"), "strnig"),
        (json_schema_grammar({"type": "string", "pattern": "(?<=a)b"}, "p"), "look-around"),
        (regex_grammar("a(b", "p"), "unclosed group"),
        (lark_grammar("start: foo", "p"), "unknown name"),
    ]
    for grammar, words in bad:
        with pytest.raises(ApiError, match=re.escape(words)) as e:
            validator.check("grammar", grammar, "p")
        assert e.value.param == "p"
    ok = validator.check("regex", regex_grammar(PHONE, "p"), "p")
    assert ok.kind == "regex"


def test_regex_classes_are_ascii() -> None:
    """\\d is [0-9] (JSON schema's and the peers' meaning), not any Unicode digit."""
    assert "[0-9]{3}" in regex_grammar(PHONE, "r")


# --- the real server ----------------------------------------------------------------------


def _chat(client, model: str, **kwargs: object):
    messages = [{"role": "user", "content": "Fill in the answer."}]
    return client.chat.completions.create(model=model, messages=messages, **kwargs)


def test_every_api_shape_through_the_server_matches_its_constraint(
    qwen2_server, qwen2_client
) -> None:
    """Chat, completions and /generate, greedy and sampled: each output validates."""
    model = qwen2_server.model
    schema = {"name": "person", "schema": PERSON, "strict": True}
    for temperature in (0.0, 1.0):
        sampling = {"temperature": temperature, "seed": 3, "n": 3, "max_tokens": 120}
        chat = _chat(
            qwen2_client,
            model,
            response_format={"type": "json_schema", "json_schema": schema},
            **sampling,
        )
        for c in chat.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content or ""), PERSON)
        anything = _chat(qwen2_client, model, response_format={"type": "json_object"}, **sampling)
        for c in anything.choices:
            if c.finish_reason == "stop":  # NOTE: free text in an object may run past max_tokens
                assert isinstance(json.loads(c.message.content or ""), dict)
        choice = _chat(
            qwen2_client, model, extra_body={"structured_outputs": {"choice": LABELS}}, **sampling
        )
        assert all(c.message.content in LABELS for c in choice.choices)
        regex = qwen2_client.completions.create(
            model=model, prompt="Call ", extra_body={"regex": PHONE}, **sampling
        )
        assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text) for c in regex.choices)
        so_json = qwen2_client.completions.create(
            model=model,
            prompt="{",
            extra_body={"structured_outputs": {"json": CLASSIFY}},
            **sampling,
        )
        for c in so_json.choices:
            jsonschema.validate(json.loads(c.text), CLASSIFY)
    status, body = qwen2_server.post(
        "/generate",
        {
            "text": "Pick: ",
            "sampling_params": {
                "max_new_tokens": 20,
                "temperature": 1.0,
                "n": 3,
                "ebnf": 'root ::= "red" | "green" | "blue" " sky"',
            },
        },
    )
    assert status == 200, body
    assert {b["text"] for b in body} <= {"red", "green", "blue sky"}
    status, body = qwen2_server.post(
        "/generate",
        {
            "text": "x",
            "sampling_params": {"max_new_tokens": 30, "json_schema": json.dumps(CLASSIFY)},
        },
    )
    assert status == 200, body
    jsonschema.validate(json.loads(body["text"]), CLASSIFY)


def test_raw_logprobs_through_the_server_are_the_unconstrained_bits(qwen2_server) -> None:
    """A constrained /generate's output logprobs equal the prompt logprobs of the same tokens
    sent back unconstrained, bit for bit (floats survive JSON exactly)."""
    prompt = list(range(40, 60))
    for params in (
        {"json_schema": json.dumps(PERSON)},
        {"regex": PHONE, "temperature": 1.0, "seed": 5},
    ):
        status, out = qwen2_server.post(
            "/generate",
            {
                "input_ids": prompt,
                "return_logprob": True,
                "top_logprobs_num": 5,
                "sampling_params": {"max_new_tokens": 120, **params},
            },
        )
        assert status == 200, out
        ids = out["output_ids"]
        status, ref = qwen2_server.post(
            "/generate",
            {
                "input_ids": prompt + ids,
                "return_logprob": True,
                "logprob_start_len": len(prompt),
                "top_logprobs_num": 5,
                "sampling_params": {"max_new_tokens": 0},
            },
        )
        assert status == 200, ref
        got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        want = [e[0] for e in ref["meta_info"]["input_token_logprobs"][: len(ids)]]
        assert got == want
        got_top = out["meta_info"]["output_top_logprobs"]
        assert got_top == ref["meta_info"]["input_top_logprobs"][: len(ids)]


def test_streamed_constrained_output_equals_the_whole_one(qwen2_server, qwen2_client) -> None:
    kwargs = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": PERSON}},
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": 9,
    }
    whole = _chat(qwen2_client, qwen2_server.model, **kwargs).choices[0].message.content
    stream = _chat(qwen2_client, qwen2_server.model, stream=True, **kwargs)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole


BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strnig"}},
            }
        },
        "response_format",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"extra_body": {"regex": "a(b"}}, "regex"),
    ({"extra_body": {"ebnf": "root ::= x"}}, "ebnf"),
    (
        {"extra_body": {"structured_outputs": {"grammar": "start: foo"}}},
        "structured_outputs.grammar",
    ),
    ({"extra_body": {"structured_outputs": {"choice": "yes"}}}, "structured_outputs.choice"),
    (
        {"extra_body": {"structured_outputs": {"json": {"type": "string", "pattern": "(?<=a)b"}}}},
        "structured_outputs.json",
    ),
    ({"extra_body": {"structured_outputs": {"regex": "x" * 70_000}}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a"}}, "regex"),
]


def test_bad_constraints_are_400s_and_cost_nothing(qwen2_server, qwen2_client) -> None:
    import openai
    from test_server_e2e import wait_idle

    for kwargs, param in BAD:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(qwen2_client, qwen2_server.model, max_tokens=5, **kwargs)
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
    status, body = qwen2_server.post(
        "/generate", {"text": "x", "sampling_params": {"regex": "(", "max_new_tokens": 3}}
    )
    assert status == 400 and body["error"]["param"] == "sampling_params.regex"
    ok = _chat(qwen2_client, qwen2_server.model, max_tokens=5, extra_body={"regex": "ab+"})
    assert re.fullmatch("ab+", ok.choices[0].message.content or "")
    assert wait_idle(qwen2_server)["tokenmill_kv_slots_used"] == 0


def test_a_constraint_cut_by_max_tokens_ends_with_length(qwen2_server, qwen2_client) -> None:
    out = _chat(
        qwen2_client,
        qwen2_server.model,
        max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    assert out.choices[0].finish_reason == "length"


# --- the worker's mask --------------------------------------------------------------------


def test_bitmasks_unpack_alike_on_the_host_and_the_device_path() -> None:
    import torch

    from tokenmill.tp_worker.sample.grammar_mask import forbidden_ids, unpack_on_device

    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(2**31), 2**31, size=(3, 5), dtype=np.int64).astype(np.int32)
    host = ~forbidden_ids(bitmask, 150, torch.device("cpu"))
    device = unpack_on_device(bitmask, 150, torch.device("cpu"))
    assert torch.equal(host, device) and host.shape == (3, 150)
    want = [
        [bool((int(w) >> (i % 32)) & 1) for i, w in enumerate(np.repeat(r, 32)[:150])]
        for r in bitmask
    ]
    assert host.tolist() == want


def test_a_row_left_with_nothing_samples_among_the_grammars_ids() -> None:
    """min_tokens bans eos where the grammar allows only eos: the grammar wins."""
    import torch

    from tokenmill.protocol.arrays import pack
    from tokenmill.protocol.step import GrammarRows
    from tokenmill.tp_worker.sample.grammar_mask import GrammarTensors

    logits = torch.randn(2, 64)
    logits[1, 3] = float("-inf")  # NOTE: the ban on eos (id 3)
    bitmask = np.zeros((1, 2), np.int32)
    bitmask[0, 0] = 1 << 3
    rows = GrammarTensors(
        GrammarRows(rows=pack(np.array([1], np.int32))), torch.device("cpu"), False
    )
    before = logits[0].clone()
    rows.apply(logits, bitmask, may_empty=True)
    assert torch.equal(logits[0], before)
    assert logits[1, 3] == 0 and torch.isneginf(logits[1, torch.arange(64) != 3]).all()
