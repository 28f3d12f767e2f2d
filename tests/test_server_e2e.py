"""End to end: the real server (frontend, controller, tp_worker, detokenizer processes) on
loopback, driven by the `openai` client, checked against the in-process runner and
`transformers`."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
import transformers
from helpers import assert_same_tp_answer, make_engine, oracle

from tokenmill.detokenizer.token_table import TokenTable
from tokenmill.offline.engine import OfflineOutput, OfflineRequest

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a module for dates — é, 🎉."},
]


@pytest.fixture(scope="module")
def reference(server):
    """Chat prompt ids as the server renders them, and tools to score them in-process."""
    from pathlib import Path

    model = Path(server.model)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    prompt_ids = tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    return {
        "prompt_ids": list(prompt_ids),
        "hf": hf,
        "engine": make_engine(model),
        "table": TokenTable.from_file(model),
    }


def test_chat_logprobs_match_runner_and_transformers(client, server, reference) -> None:
    resp = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    choice = resp.choices[0]
    content = choice.logprobs.content
    prompt = reference["prompt_ids"]
    ours = reference["engine"].generate(
        [OfflineRequest(prompt, max_tokens=16, num_top=5, stop_at_eos=True)]
    )[0]
    table = reference["table"]
    assert [c.token for c in content] == [table.token_string(t) for t in ours.output_ids]
    np.testing.assert_allclose([c.logprob for c in content], ours.logprobs, atol=1e-5, rtol=0)
    for c, top_lps in zip(content, ours.top_logprobs, strict=True):
        np.testing.assert_allclose([t.logprob for t in c.top_logprobs], top_lps, atol=1e-5, rtol=0)
    ref = oracle(reference["hf"], prompt + ours.output_ids)
    positions = np.arange(len(prompt) - 1, len(prompt) - 1 + len(ours.output_ids))
    np.testing.assert_allclose(
        [c.logprob for c in content], ref.of(positions, ours.output_ids), atol=1e-4, rtol=0
    )
    text_bytes = b"".join(bytes(c.bytes) for c in content if c.bytes is not None)
    assert text_bytes.decode("utf-8", errors="replace") == choice.message.content
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(content)


def test_streamed_chat_concatenates_to_the_whole(client, server) -> None:
    kwargs = {
        "model": server.model,
        "messages": MESSAGES,
        "max_tokens": 20,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert text == whole.choices[0].message.content
    assert [e.model_dump() for e in entries] == [
        e.model_dump() for e in whole.choices[0].logprobs.content
    ]
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_echo_scores_the_prompt(client, server, reference) -> None:
    prompt = reference["prompt_ids"]
    resp = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=0, echo=True, logprobs=5
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = oracle(reference["hf"], prompt)
    expected = ref.of(np.arange(len(prompt) - 1), prompt[1:])
    np.testing.assert_allclose(lp.token_logprobs[1:], expected, atol=1e-4, rtol=0)
    assert all(len(d) >= 5 for d in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_streamed_completion_matches_whole(client, server) -> None:
    kwargs = {
        "model": server.model,
        "prompt": "Return the number of",
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": 2,
    }
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [
        t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == whole.choices[0].logprobs.token_logprobs


def test_64_concurrent_requests_equal_one_by_one(server) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 1000, int(n)).tolist() for n in rng.integers(2, 200, 64)]

    async def run(concurrent: bool) -> list[tuple[str, list[float]]]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)

        async def one(p: list[int]) -> tuple[str, list[float]]:
            r = await aclient.completions.create(
                model=server.model, prompt=p, max_tokens=12, temperature=0, logprobs=1
            )
            return r.choices[0].text, r.choices[0].logprobs.token_logprobs

        if concurrent:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        return [await one(p) for p in prompts]

    alone = asyncio.run(run(concurrent=False))
    together = asyncio.run(run(concurrent=True))
    for (text_a, lps_a), (text_b, lps_b) in zip(alone, together, strict=True):
        assert text_a == text_b
        np.testing.assert_allclose(lps_a, lps_b, atol=1e-5, rtol=0)


def wait_idle(server, timeout: float = 10.0) -> dict[str, float]:
    """Metrics once the engine reports no running or waiting request and no used slot, twice
    0.5 s apart: it reports at most every 0.35 s when idle (0.25 s, checked after a 0.1 s
    receive), so one idle reading may predate the last request."""
    deadline = time.monotonic() + timeout
    was_idle = False
    while True:
        metrics = server.metrics()
        idle = (
            metrics["tokenmill_num_requests_running"] == 0
            and metrics["tokenmill_num_requests_waiting"] == 0
            and metrics["tokenmill_kv_slots_used"] == 0
        )
        if (idle and was_idle) or time.monotonic() > deadline:
            return metrics
        was_idle = idle
        time.sleep(0.5 if idle else 0.1)


def test_cancelled_streams_free_their_kv_slots(server) -> None:
    before = wait_idle(server)
    assert before["tokenmill_kv_slots_used"] == 0

    async def cancel_midway() -> None:
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)

        async def one(i: int) -> None:
            stream = await aclient.completions.create(
                model=server.model,
                prompt=f"Stream number {i}",
                max_tokens=500,
                stream=True,
                temperature=0.7,
                extra_body={"ignore_eos": True},
            )
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            await stream.close()

        await asyncio.gather(*(one(i) for i in range(20)))

    asyncio.run(cancel_midway())
    after = wait_idle(server)
    assert after["tokenmill_kv_slots_used"] == 0
    assert after["tokenmill_num_requests_running"] == 0
    assert after["tokenmill_kv_slots_total"] == before["tokenmill_kv_slots_total"]
    finished = {k: v for k, v in after.items() if k.startswith("tokenmill_requests_finished")}
    assert finished.get('tokenmill_requests_finished_total{finish_reason="abort"}', 0) >= 20
    status, _ = server.post(
        "/v1/completions", {"model": server.model, "prompt": "still", "max_tokens": 2}
    )
    assert status == 200


def _generate_scoring_ids(server, reference, new_tokens: int, **extra: object) -> tuple:
    """/generate greedy with `token_ids_logprob` [7, 9]: every output position's values
    checked against transformers; the meta_info and the oracle returned for more checks."""
    prompt = reference["prompt_ids"]
    status, body = server.post(
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0},
            "token_ids_logprob": [7, 9],
            **extra,
        },
    )
    assert status == 200, body
    meta = body["meta_info"]
    ref = oracle(reference["hf"], prompt + body["output_ids"])
    scored = meta["output_token_ids_logprobs"]
    assert len(scored) == new_tokens
    for i, entries in enumerate(scored):
        expected = ref.logprobs[len(prompt) - 1 + i, [7, 9]]
        np.testing.assert_allclose([e[0] for e in entries], expected, atol=1e-4, rtol=0)
    return meta, ref


def test_native_generate_token_ids_logprob_and_start_len(server, reference) -> None:
    prompt = reference["prompt_ids"]
    meta, ref = _generate_scoring_ids(
        server,
        reference,
        4,
        return_logprob=True,
        logprob_start_len=5,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
    )
    assert len(meta["output_token_logprobs"]) == 4
    assert len(meta["input_token_logprobs"]) == len(prompt) - 5
    expected = ref.of(np.arange(4, len(prompt) - 1), prompt[5:])
    np.testing.assert_allclose(
        [e[0] for e in meta["input_token_logprobs"]], expected, atol=1e-4, rtol=0
    )


def test_token_ids_logprob_without_return_logprob(server, reference) -> None:
    """Label logprobs alone (no return_logprob): once took the detokenizer down."""
    meta, _ = _generate_scoring_ids(server, reference, 2)
    assert "output_token_logprobs" not in meta


def test_bad_requests_get_400_and_the_engine_keeps_serving(server) -> None:
    bad = [
        {"model": server.model, "prompt": "x", "max_tokens": -1},
        {"model": server.model, "prompt": [10**9], "max_tokens": 1},
        {"model": server.model, "prompt": "x", "max_tokens": 10**7},
        {"model": server.model, "prompt": "x", "logprobs": 21},
        {"model": "nope", "prompt": "x"},
    ]
    for body in bad:
        status, err = server.post("/v1/completions", body)
        assert status in (400, 404), body
        assert set(err["error"]) >= {"message", "type", "param", "code"}
    status, _ = server.post("/v1/completions", b"{not json")
    assert status == 400
    status, body = server.post(
        "/v1/completions", {"model": server.model, "prompt": "ok", "max_tokens": 3}
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_stop_string_cuts_text_and_stops_the_engine(client, server) -> None:
    kwargs = {
        "model": server.model,
        "prompt": "Return the number of",
        "max_tokens": 40,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and stop in full
    cut = client.completions.create(**kwargs, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kwargs, stop=[stop], stream=True)
    )
    assert streamed == cut.choices[0].text
    after = wait_idle(server)
    assert after["tokenmill_kv_slots_used"] == 0


def test_n_choices_with_a_seed_are_reproducible(client, server) -> None:
    kwargs = {
        "model": server.model,
        "messages": MESSAGES,
        "max_tokens": 12,
        "n": 3,
        "temperature": 1.0,
        "seed": 1234,
        "logprobs": True,
    }
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1, "choices of one request must sample independently"
    for a, b in zip(first.choices, second.choices, strict=True):
        assert [e.logprob for e in a.logprobs.content] == [e.logprob for e in b.logprobs.content]


def test_prefix_cache_hits_and_warm_equals_cold(server) -> None:
    prompt = list(range(300, 300 + 150))

    def generate(**extra: object) -> dict:
        status, body = server.post(
            "/generate",
            {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                "return_logprob": True,
                "top_logprobs_num": 5,
                **extra,
            },
        )
        assert status == 200, body
        return body["meta_info"]

    def hits(expected: float | None = None) -> float:
        """The hit counter once it is settled: the engine reports every 0.25 s, so a request
        can come and go between two reports; two readings 0.35 s apart must agree (and show
        `expected`, when given)."""
        deadline = time.monotonic() + 5
        value = wait_idle(server)["tokenmill_prefix_cache_hit_tokens_total"]
        while True:
            time.sleep(0.35)
            again = wait_idle(server)["tokenmill_prefix_cache_hit_tokens_total"]
            settled = again == value and (expected is None or value == expected)
            if settled or time.monotonic() > deadline:
                return again
            value = again

    before = hits()
    cold = generate(logprob_start_len=100)  # nothing cached yet: computed in full
    assert cold["cached_tokens"] == 0
    warm_plain = generate()  # generation logprobs only: the longest prefix (all but one)
    assert warm_plain["cached_tokens"] == len(prompt) - 1
    warm = generate(logprob_start_len=100)  # reuses the cache up to position 99 only
    assert warm["cached_tokens"] == 99
    assert hits(before + len(prompt) - 1 + 99) == before + len(prompt) - 1 + 99
    for key in ("input_token_logprobs", "output_token_logprobs"):
        np.testing.assert_allclose(
            [e[0] for e in warm[key]], [e[0] for e in cold[key]], atol=1e-5, rtol=0
        )
        assert [e[1] for e in warm[key]] == [e[1] for e in cold[key]]
    np.testing.assert_allclose(
        [e[0] for e in warm_plain["output_token_logprobs"]],
        [e[0] for e in cold["output_token_logprobs"]],
        atol=1e-5,
        rtol=0,
    )


def test_small_kv_cache_evicts_and_stays_right(tiny_checkpoint, tmp_path) -> None:
    """A pool of 640 slots holds a few 200-token prompts: later requests evict earlier
    prefixes; every answer still equals the in-process runner's, cache hit or not."""
    from server_process import start_server

    model = tiny_checkpoint("llama")
    small = start_server(
        model,
        tmp_path / "log",
        "--kv-cache-tokens",
        "640",
        "--max-model-len",
        "320",
        "--max-running-requests",
        "2",
    )
    try:
        engine = make_engine(model)
        rng = np.random.default_rng(7)
        prefixes = [rng.integers(5, 1000, 150).tolist() for _ in range(4)]
        prompts = [p + rng.integers(5, 1000, 50).tolist() for p in prefixes for _ in range(2)]
        prompts += prompts[:3]  # revisit: some prefixes were evicted, some not
        for i, prompt in enumerate(prompts):
            status, body = small.post(
                "/generate",
                {
                    "input_ids": prompt,
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                },
            )
            assert status == 200, body
            ref = engine.generate([OfflineRequest(prompt, max_tokens=8)])[0]
            assert body["output_ids"] == ref.output_ids, f"request {i}"
            np.testing.assert_allclose(
                [e[0] for e in body["meta_info"]["output_token_logprobs"]],
                ref.logprobs,
                atol=1e-5,
                rtol=0,
                err_msg=f"request {i}, {body['meta_info'].get('cached_tokens')} tokens cached",
            )
        metrics = wait_idle(small)
        assert metrics["tokenmill_prefix_cache_hit_tokens_total"] > 0
        assert metrics["tokenmill_prefix_cache_tokens"] <= 640
    finally:
        assert small.stop() == 0


@pytest.mark.parametrize("decode_steps", ["1", "3"])
def test_overlap_scheduling_under_load_serves_what_the_runner_computes(
    tiny_checkpoint, tmp_path, decode_steps: str
) -> None:
    """--overlap-schedule with 8 clients at once against a 300-slot pool (prefixes evicted,
    requests preempted): greedy requests of 1-20 tokens after shared prefixes, half of them
    stopped early by a stop id, with top logprobs. Each answer equals the in-process runner's
    (one request at a time, cut after the stop id's first appearance) and the pool ends
    empty."""
    from concurrent.futures import ThreadPoolExecutor

    from server_process import start_server

    model = tiny_checkpoint("llama")
    engine = make_engine(model)
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(5, 1000, 100).tolist() for _ in range(6)]
    jobs = []
    for _ in range(160):
        prompt = prefixes[rng.integers(6)] + rng.integers(5, 1000, rng.integers(1, 60)).tolist()
        ref = engine.generate(
            [OfflineRequest(prompt, max_tokens=int(rng.integers(1, 21)), num_top=2)]
        )[0]
        cut = int(rng.integers(len(ref.output_ids))) if rng.random() < 0.5 else None
        jobs.append((prompt, ref, cut))
    busy = start_server(
        model,
        tmp_path / "log",
        "--overlap-schedule",
        "--decode-steps",
        decode_steps,
        "--kv-cache-tokens",
        "300",
        "--max-model-len",
        "320",
        "--max-running-requests",
        "3",
    )

    def check(job: tuple[list[int], OfflineOutput, int | None]) -> None:
        prompt, ref, cut = job
        params = {"max_new_tokens": len(ref.output_ids), "temperature": 0, "ignore_eos": True}
        want = len(ref.output_ids)
        if cut is not None:
            params["stop_token_ids"] = [ref.output_ids[cut]]
            want = ref.output_ids.index(ref.output_ids[cut]) + 1
        status, body = busy.post(
            "/generate",
            {
                "input_ids": prompt,
                "return_logprob": True,
                "top_logprobs_num": 2,
                "sampling_params": params,
            },
        )
        assert status == 200, body
        meta = body["meta_info"]
        assert body["output_ids"] == ref.output_ids[:want]
        np.testing.assert_allclose(
            [e[0] for e in meta["output_token_logprobs"]], ref.logprobs[:want], atol=1e-5, rtol=0
        )
        assert [[e[1] for e in top] for top in meta["output_top_logprobs"]] == [
            t.tolist() for t in ref.top_ids[:want]
        ]

    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(check, jobs))
        metrics = wait_idle(busy)
        assert metrics["tokenmill_num_preemptions"] > 0
        assert metrics["tokenmill_prefix_cache_hit_tokens_total"] > 0
        assert metrics["tokenmill_kv_slots_used"] == 0
    finally:
        assert busy.stop() == 0


def test_multi_step_decoding_equals_single_step(server, tiny_checkpoint, tmp_path) -> None:
    """--decode-steps 4: the same tokens and logprobs as one step per round trip, with
    sampling, penalties, min_tokens and several requests decoding together."""
    from server_process import start_server

    multi = start_server(
        tiny_checkpoint("llama"),
        tmp_path / "log",
        "--decode-steps",
        "4",
        "--kv-cache-tokens",
        "8192",
        "--max-model-len",
        "1024",
    )
    bodies = [
        {
            "input_ids": list(range(40, 60)),
            "return_logprob": True,
            "top_logprobs_num": 5,
            "sampling_params": {"max_new_tokens": 13, "temperature": 0},
        },
        {
            "input_ids": list(range(70, 75)),
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 10,
                "temperature": 0.9,
                "seed": 3,
                "frequency_penalty": 0.7,
                "min_new_tokens": 5,
            },
        },
        {
            "input_ids": list(range(200, 230)),
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 7, "temperature": 0.5, "top_k": 5, "seed": 9},
        },
    ]

    def run(target) -> list[dict]:
        async def all_at_once() -> list[dict]:
            import aiohttp

            async with aiohttp.ClientSession() as session:

                async def one(body: dict) -> dict:
                    async with session.post(target.base_url + "/generate", json=body) as r:
                        assert r.status == 200
                        return await r.json()

                return list(await asyncio.gather(*(one(b) for b in bodies)))

        return asyncio.run(all_at_once())

    try:
        single_results, multi_results = run(server), run(multi)
        for a, b in zip(single_results, multi_results, strict=True):
            assert a["output_ids"] == b["output_ids"]
            np.testing.assert_allclose(
                [e[0] for e in a["meta_info"]["output_token_logprobs"]],
                [e[0] for e in b["meta_info"]["output_token_logprobs"]],
                atol=1e-5,
                rtol=0,
            )
        assert wait_idle(multi)["tokenmill_kv_slots_used"] == 0
    finally:
        assert multi.stop() == 0


def test_tensor_parallel_2_matches_1(server, tiny_checkpoint, tmp_path) -> None:
    """Two gloo ranks, each with half the heads, half the MLP and half the vocabulary: the
    same tokens, and logprobs within 1e-5 + 1e-6 |logprob| (the all-reduce sums partial
    products in another order: a relative error, visible on logprobs of -30)."""
    from server_process import start_server

    tp2 = start_server(
        tiny_checkpoint("llama"),
        tmp_path / "log",
        "--tensor-parallel-size",
        "2",
        "--kv-cache-tokens",
        "8192",
        "--max-model-len",
        "1024",
    )
    body = {
        "input_ids": list(range(90, 140)),
        "return_logprob": True,
        "logprob_start_len": 10,
        "top_logprobs_num": 5,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
    }
    # NOTE: a grammar-constrained row: both ranks apply the masks that follow each batch
    constrained = {
        **body,
        "sampling_params": {
            "max_new_tokens": 40,
            "temperature": 1.0,
            "seed": 3,
            "json_schema": '{"type": "object", "properties": {"n": {"type": "integer"}}, '
            '"required": ["n"], "additionalProperties": false}',
        },
    }
    try:
        for request in (body, constrained):
            status, two = tp2.post("/generate", request)
            assert status == 200, two
            _, one = server.post("/generate", request)
            assert_same_tp_answer(two, one)
        assert len(children_of_server(tp2)) == 4  # frontend's children: 2 ranks + 2
    finally:
        assert tp2.stop() == 0


@pytest.mark.parametrize(
    "arch", ["qwen3", "gemma2", "gemma3", "olmo2", "qwen3_moe", "qwen2_moe", "gpt_oss"]
)
def test_tensor_parallel_2_matches_transformers(arch: str, tiny_checkpoint, tmp_path) -> None:
    """Qwen3 and Gemma 3 at TP 2: each rank norms its own q and k heads (the norms' weights
    are every rank's); Gemma 2: the soft-capped scores of each rank's heads, the logits
    soft-capped after the gather; OLMo 2: its q and k norms over the whole projection, the
    ranks' sums of squares all-reduced; Qwen3-MoE: every expert's width halved, a token's
    weighted experts all-reduced once; Qwen2-MoE: its shared expert's too; gpt-oss: each
    rank's heads' sinks, the output bias and the experts' down biases added once; prompt and
    greedy logprobs as transformers computes them (float32)."""
    from helpers import oracle
    from server_process import generate_once

    model = tiny_checkpoint(arch)
    prompt = list(range(90, 140))
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
    }
    flags = ("--tensor-parallel-size", "2", "--max-model-len", "1024")
    answer = generate_once(model, tmp_path / "log", body, *flags)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = prompt + answer["output_ids"]
    ref = oracle(hf, ids)
    positions = np.arange(len(ids) - 1)
    meta = answer["meta_info"]
    ours = [e[0] for e in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
    np.testing.assert_allclose(ours, ref.of(positions, ids[1:]), atol=1e-4, rtol=0)
    assert answer["output_ids"] == ref.logprobs[len(prompt) - 1 :].argmax(-1).tolist()


def test_olmo2_with_kv_heads_that_do_not_divide_is_refused(tiny_checkpoint) -> None:
    """OLMo 2's k norm spans every KV head: with fewer KV heads than ranks (each rank would
    hold a copy of one), refused naming why, rather than normed over copies."""
    from tokenmill.tp_worker.model.config import load_model_config
    from tokenmill.tp_worker.model.decoder import DecoderLayer
    from tokenmill.tp_worker.model.parallel import TpGroup

    config = load_model_config(tiny_checkpoint("olmo2"))
    assert config.num_kv_heads == 2
    DecoderLayer(config, TpGroup(0, 2), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="2 KV heads do not divide among --tensor-parallel-size 4"):
        DecoderLayer(config, TpGroup(0, 4), torch.float32, torch.device("cpu"))


def children_of_server(proc) -> list[int]:
    from test_server_faults import children_of

    return list(children_of(proc.proc.pid))


def test_the_invalid_request_table_against_the_real_server(server) -> None:
    """tests/test_http_api.py's table of invalid requests (run there against a fake engine),
    now through the real engine: each is a 4xx naming its param, and nothing breaks."""
    from test_http_api import INVALID, MAX_MODEL_LEN, MODEL

    def real(body: object) -> object:
        if isinstance(body, dict) and body.get("model") == MODEL:
            return {**body, "model": server.model}
        return body

    # NOTE: these depend on the fake server's own limits (max_logprobs 5, its context length).
    limits = {"max_tokens": MAX_MODEL_LEN, "top_logprobs": 6, "logprobs": 6}
    checked = 0
    for path, body, status, param in INVALID:
        if isinstance(body, dict) and any(body.get(k) == v for k, v in limits.items()):
            continue
        if isinstance(body, dict) and len(str(body.get("prompt", ""))) > 2 * MAX_MODEL_LEN:
            continue
        if isinstance(body, dict) and _bound_by_fake_scoring_limits(body):
            continue
        got, answer = server.post(path, real(body))
        assert got == status, (path, body, answer)
        assert answer["error"]["param"] == param
        checked += 1
    assert checked >= 45
    status, body = server.post(
        "/v1/completions", {"model": server.model, "prompt": "fine", "max_tokens": 2}
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert wait_idle(server)["tokenmill_kv_slots_used"] == 0


def _bound_by_fake_scoring_limits(body: dict) -> bool:
    """Invalid only under the fake server's limits (8 items, a 256-token context)."""
    from test_http_api import MAX_MODEL_LEN

    entries = body.get("items") or body.get("documents") or []
    return isinstance(entries, list) and (
        len(entries) > 8
        or any(len(e) >= MAX_MODEL_LEN for e in entries if isinstance(e, list | str))
    )


def test_preemption_under_a_full_pool_loses_nothing(tiny_checkpoint, tmp_path) -> None:
    """8 requests that together need ~2,000 KV slots, on a 700-slot pool: the scheduler
    preempts and recomputes, and every answer equals the in-process runner's, bitwise: a
    preempted request recomputes its prompt as a prefill and replays its generated tokens
    one per step on the decode path, so their KV is exactly what it was."""
    from server_process import start_server

    model = tiny_checkpoint("llama")
    small = start_server(
        model,
        tmp_path / "log",
        "--kv-cache-tokens",
        "700",
        "--max-model-len",
        "300",
        "--max-running-requests",
        "8",
        "--disable-prefix-cache",
    )
    rng = np.random.default_rng(11)
    prompts = [rng.integers(5, 1000, 100).tolist() for _ in range(8)]

    async def all_at_once() -> list[dict]:
        import aiohttp

        async with aiohttp.ClientSession() as session:

            async def one(ids: list[int]) -> dict:
                body = {
                    "input_ids": ids,
                    "return_logprob": True,
                    "sampling_params": {
                        "max_new_tokens": 150,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                }
                async with session.post(small.base_url + "/generate", json=body) as r:
                    assert r.status == 200
                    return await r.json()

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    try:
        results = asyncio.run(all_at_once())
        assert wait_idle(small)["tokenmill_num_preemptions"] > 0
        engine = make_engine(model)
        for prompt, got in zip(prompts, results, strict=True):
            ref = engine.generate([OfflineRequest(prompt, max_tokens=150)])[0]
            assert got["output_ids"] == ref.output_ids
            np.testing.assert_allclose(
                [e[0] for e in got["meta_info"]["output_token_logprobs"]],
                ref.logprobs,
                atol=0,
                rtol=0,
            )
        assert wait_idle(small)["tokenmill_kv_slots_used"] == 0
    finally:
        assert small.stop() == 0


def _niceness(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def _serving_roles(server) -> dict[int, str]:
    from test_server_faults import children_of

    frontend = server.proc.pid
    children = children_of(frontend)
    modules = {pid: re.search(r"-m (tokenmill\.\w+)", cmd) for pid, cmd in children.items()}
    roles = {pid: m.group(1) for pid, m in modules.items() if m is not None}
    assert sorted(roles.values()) == [
        "tokenmill.controller",
        "tokenmill.detokenizer",
        "tokenmill.tp_worker",
    ]
    return {frontend: "frontend", **roles}


def _niceness_of(roles: dict[int, str]) -> dict[str, set[int]]:
    """Each role's set of niceness values over its threads."""
    return {
        role: {_niceness(int(t)) for t in os.listdir(f"/proc/{pid}/task")}
        for pid, role in roles.items()
    }


def test_serving_processes_yield_the_cores_under_load(server) -> None:
    """--serving-nice 10 (the default): with 4 or more requests in flight the frontend and the
    detokenizer run at niceness 10, every thread of them; with 2 or fewer at 0 again (this
    test runs as root, which may lower it); the controller and the worker never change."""
    from test_server_faults import long_request

    roles = _serving_roles(server)
    idle = {"frontend": {0}, "tokenmill.detokenizer": {0}}
    busy = {"frontend": {10}, "tokenmill.detokenizer": {10}}
    engine = {"tokenmill.controller": {0}, "tokenmill.tp_worker": {0}}
    wait_idle(server)
    assert _niceness_of(roles) == {**idle, **engine}
    errors: list[BaseException] = []
    # NOTE: the clients made first and the six requests sent together: on the tiny model a
    # stream of 1,000 tokens lasts well under a second, less than six clients took to start
    # one after another.
    clients = [
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        for _ in range(6)
    ]
    together = threading.Barrier(len(clients))
    streams = [
        threading.Thread(target=long_request, args=(server, errors, 1000, None, c, together))
        for c in clients
    ]
    for thread in streams:
        thread.start()
    deadline, seen = time.monotonic() + 20, {}
    while time.monotonic() < deadline and seen != {**busy, **engine}:
        time.sleep(0.02)
        seen = _niceness_of(roles)
    for thread in streams:
        thread.join(60)
    assert seen == {**busy, **engine}
    assert errors == []
    wait_idle(server)
    assert _niceness_of(roles) == {**idle, **engine}


def test_serving_priority_follows_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Busy at 4 in flight, idle at 2 (3 changes nothing); where lowering is refused, it
    stays at the busy niceness."""
    from tokenmill.protocol import process

    calls: list[int] = []
    allowed = {10: True, 0: True}
    monkeypatch.setattr(process, "yield_cpu", lambda n: calls.append(n) or allowed[n])
    priority = process.ServingPriority(10)
    for in_flight in (1, 3, 4, 5, 3, 2, 3, 4):
        priority.update(in_flight)
    assert calls == [10, 0, 10] and priority.current == 10
    allowed[0] = False
    for in_flight in (2, 0, 5, 1):
        priority.update(in_flight)
    assert calls == [10, 0, 10, 0] and priority.current == 10
    never = process.ServingPriority(0)
    never.update(64)
    assert never.current == 0 and calls == [10, 0, 10, 0]


@pytest.mark.parametrize("value", [-1, 20])
def test_serving_nice_is_validated(value: int) -> None:
    from tokenmill.frontend.server_config import HttpArgs, ServerConfig, validate

    validate(ServerConfig(http=HttpArgs(serving_nice=0)))
    with pytest.raises(ValueError, match="--serving-nice"):
        validate(ServerConfig(http=HttpArgs(serving_nice=value)))
