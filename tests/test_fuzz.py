"""Fuzzing the real server from its own /openapi.json (slow): bodies that are not objects,
objects with the documented fields set to any JSON value, unknown fields, valid bodies with
one field replaced, and raw bytes. None may get a 5xx or take the server down; every
refusal is OpenAI's error object.

    pytest -m slow tests/test_fuzz.py -s     # prints how many bodies were sent, and 5xx
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
VALID = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/score": {"query": "a", "items": ["b"], "label_token_ids": [5]},
    "/generative_scoring": {"query": "a", "items": ["b"], "label_token_ids": [5]},
    "/v1/rerank": {"query": "a", "documents": ["b"]},
}
COUNTS = {"bodies": 0, "5xx": 0}


def properties(doc: dict, path: str) -> list[str]:
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = ref["$ref"].rsplit("/", 1)[1]
    return sorted(doc["components"]["schemas"][name]["properties"])


def bodies(doc: dict, path: str) -> st.SearchStrategy[bytes]:
    fields = properties(doc, path)
    some_fields = st.dictionaries(st.sampled_from(fields), JSON, max_size=6)
    unknown = st.dictionaries(st.text(min_size=1, max_size=10), JSON, min_size=1, max_size=2)
    one_replaced = st.tuples(st.sampled_from(fields), JSON).map(
        lambda kv: {**VALID[path], kv[0]: kv[1]}
    )
    with_unknown = st.builds(lambda a, b: {**VALID[path], **a, **b}, some_fields, unknown)
    objects = st.one_of(some_fields, one_replaced, with_unknown)
    as_json = st.one_of(objects, JSON).map(lambda body: json.dumps(body).encode())
    return st.one_of(as_json, as_json, as_json, st.binary(max_size=64))


def post(base_url: str, path: str, raw: bytes) -> tuple[int, Any]:
    req = urllib.request.Request(
        base_url + path, data=raw, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("path", list(VALID))
def test_no_body_gets_a_5xx(server, path: str) -> None:
    _, text = server.get("/openapi.json")
    doc = json.loads(text)

    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies(doc, path))
    def check(raw: bytes) -> None:
        status, answer = post(server.base_url, path, raw)
        COUNTS["bodies"] += 1
        COUNTS["5xx"] += status >= 500
        assert status < 500, (raw[:300], answer)
        if status >= 400:
            assert set(answer["error"]) == {"message", "type", "param", "code"}

    check()
    assert server.get("/health")[0] == 200
    print(f"\nfuzz {path}: {COUNTS['bodies']} bodies so far, {COUNTS['5xx']} got a 5xx")
