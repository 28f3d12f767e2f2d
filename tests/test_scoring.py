"""The scoring endpoints through the real server: /v1/score, /generative_scoring and
/v1/rerank against transformers in float32, and the query prefilled once per request."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from test_server_e2e import wait_idle

from tokenmill.frontend.api.rerank_prompt import DEFAULT_TEMPLATE

LABELS = [7, 93, 82]
QUERY = "Is this a question about the capital of France? Say y or n."
ITEMS = ["Paris is the capital.", "Berlin — and é 🎉.", "n"]


@pytest.fixture(scope="module")
def hf(server):
    model = Path(server.model)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    lm = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    return tok, lm


def next_token_logprobs(lm: torch.nn.Module, ids: list[int], labels: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = lm(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)[labels].numpy().astype(np.float64)


def expected_scores(lm, prompts: list[list[int]], labels: list[int], softmax: bool) -> np.ndarray:
    rows = []
    for ids in prompts:
        lp = next_token_logprobs(lm, ids, labels)
        rows.append(np.exp(lp - lp.max()) / np.exp(lp - lp.max()).sum() if softmax else np.exp(lp))
    return np.array(rows)


@pytest.mark.parametrize("item_first", [False, True])
@pytest.mark.parametrize("apply_softmax", [False, True])
def test_score_equals_transformers_for_text(server, hf, item_first, apply_softmax) -> None:
    tok, lm = hf
    status, body = server.post(
        "/v1/score",
        {
            "model": server.model,
            "query": QUERY,
            "items": ITEMS,
            "label_token_ids": LABELS,
            "apply_softmax": apply_softmax,
            "item_first": item_first,
        },
    )
    assert status == 200, body
    if item_first:
        prompts = [tok(i).input_ids + tok(QUERY, add_special_tokens=False).input_ids for i in ITEMS]
    else:
        prompts = [tok(QUERY).input_ids + tok(i, add_special_tokens=False).input_ids for i in ITEMS]
    expected = expected_scores(lm, prompts, LABELS, apply_softmax)
    np.testing.assert_allclose(body["scores"], expected, atol=1e-5, rtol=0)
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_score_and_generative_scoring_equal_transformers_for_token_ids(server, hf) -> None:
    _, lm = hf
    query = [1, *range(200, 240)]
    items = [[300 + i, 301 + i, 302 + 2 * i] for i in range(5)]
    request = {"query": query, "items": items, "label_token_ids": LABELS}
    status, sglang = server.post("/v1/score", request)
    assert status == 200, sglang
    status, vllm = server.post("/generative_scoring", request)
    assert status == 200, vllm
    prompts = [query + item for item in items]
    np.testing.assert_allclose(
        sglang["scores"], expected_scores(lm, prompts, LABELS, False), atol=1e-5, rtol=0
    )
    softmaxed = expected_scores(lm, prompts, LABELS, True)[:, 0]  # vLLM's default: softmax
    assert [d["index"] for d in vllm["data"]] == list(range(5))
    np.testing.assert_allclose([d["score"] for d in vllm["data"]], softmaxed, atol=1e-5, rtol=0)


def test_rerank_orders_by_relevance_and_cuts_top_n(server, hf) -> None:
    tok, lm = hf
    query = "capital of France"
    docs = ["Paris is in France.", "n n n", "y", "Bananas are yellow."]
    status, body = server.post(
        "/v1/rerank", {"model": server.model, "query": query, "documents": docs, "top_n": 3}
    )
    assert status == 200, body
    head, tail = DEFAULT_TEMPLATE.replace("{query}", query).split("{document}")
    yes, no = (
        tok("y", add_special_tokens=False).input_ids + tok("n", add_special_tokens=False).input_ids
    )
    relevance = []
    for doc in docs:
        ids = tok(head).input_ids + tok(doc, add_special_tokens=False).input_ids
        ids += tok(tail, add_special_tokens=False).input_ids
        lp = next_token_logprobs(lm, ids, [yes, no])
        relevance.append(1.0 / (1.0 + np.exp(lp[1] - lp[0])))
    order = sorted(range(len(docs)), key=lambda i: -relevance[i])[:3]
    assert [r["index"] for r in body["results"]] == order
    np.testing.assert_allclose(
        [r["relevance_score"] for r in body["results"]], [relevance[i] for i in order], atol=1e-5
    )
    assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in order]


def test_the_query_is_computed_once_per_request(server) -> None:
    """Six items after a 60-token query that is under half of each prompt: the first item
    computes the query, the other five find it in the prefix cache."""
    rng = random.Random()
    query = [rng.randrange(100, 1000) for _ in range(60)]  # fresh: nothing of it is cached
    # distinct first tokens: no item extends another's cached prompt past the query
    items = [[10 + i] + [rng.randrange(100, 1000) for _ in range(99)] for i in range(6)]
    status, body = server.post(
        "/v1/score", {"query": query, "items": items, "label_token_ids": [5]}
    )
    assert status == 200, body
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 5 * len(query)}
    assert wait_idle(server)["tokenmill_kv_slots_used"] == 0
