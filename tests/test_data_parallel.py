"""--data-parallel-size: engine replicas behind one frontend, each request routed to the
replica most likely to hold its prefix, else to the least loaded."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import numpy as np
from server_process import start_server
from test_server_faults import assert_gone, children_of

from tokenmill.frontend.engine.replica_router import BALANCE_SLACK, BLOCK_TOKENS, ReplicaRouter


def ids(tokens: list[int]) -> bytes:
    return np.asarray(tokens, np.int32).tobytes()


def test_the_router_follows_the_prefix_and_spreads_the_rest() -> None:
    router = ReplicaRouter(2)
    prefix = list(range(100, 100 + 3 * BLOCK_TOKENS))
    first = router.pick(ids(prefix + [1, 2, 3]))
    assert router.pick(ids(prefix + [4, 5])) == first  # 3 blocks seen there
    other = router.pick(ids(list(range(500, 540))))  # nothing seen: the less loaded
    assert other == 1 - first
    expected = [0, 0]
    expected[first], expected[other] = 2, 1
    assert router.in_flight == expected
    for replica in (first, first, other):
        router.finished(replica)
    assert router.in_flight == [0, 0]
    # with nothing seen anywhere and equal loads, turns alternate
    fresh = [router.pick(ids(list(range(1000 + 50 * i, 1050 + 50 * i)))) for i in range(4)]
    assert sorted(fresh) == [0, 0, 1, 1]


def test_the_router_gives_up_the_prefix_past_the_balance_slack() -> None:
    router = ReplicaRouter(2)
    prompt = ids(list(range(BLOCK_TOKENS * 2)))
    picks = [router.pick(prompt) for _ in range(BALANCE_SLACK + 2)]
    home = picks[0]
    assert picks[: BALANCE_SLACK + 1] == [home] * (BALANCE_SLACK + 1)
    assert picks[-1] != home  # 33 in flight there, none on the other: balance first


def test_the_router_forgets_the_least_recent_blocks() -> None:
    router = ReplicaRouter(2, max_blocks=4)
    old = list(range(4 * BLOCK_TOKENS))
    home = router.pick(ids(old))
    longer = old + list(range(5000, 5000 + 4 * BLOCK_TOKENS))
    assert router.pick(ids(longer)) == home  # 8 blocks remembered there: the old 4 go
    assert len(router.blocks[home]) == 4
    assert router.pick(ids(old)) == 1 - home  # seen nowhere now: the less loaded


def per_replica(server, name: str) -> list[float]:
    metrics = server.metrics()
    return [metrics[f'tokenmill_{name}{{replica="{d}"}}'] for d in range(2)]


def test_two_replicas_answer_as_one_route_prefixes_home_and_fail_together(
    server, tiny_checkpoint, tmp_path: Path
) -> None:
    """Replicas answer as one engine does (bit for bit: the same kernels),
    a shared prefix is found where it went first, distinct prompts take turns, and one
    replica's dead rank stops the server with no orphans."""
    dp2 = start_server(
        tiny_checkpoint("llama"),
        tmp_path / "log",
        "--data-parallel-size", "2", "--kv-cache-tokens", "8192", "--max-model-len", "1024",
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        rng = random.Random()
        prefix = [rng.randrange(100, 1000) for _ in range(4 * BLOCK_TOKENS)]
        cached = []
        for i in range(4):  # one after another: each finds the prefix where it went first
            body = {"prompt": prefix + [10 + i, 11], "max_tokens": 1, "model": dp2.model}
            status, reply = dp2.post("/v1/completions", body)
            assert status == 200, reply
            cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached == [0] + [len(prefix)] * 3

        before = per_replica(dp2, "prefix_cache_queried_tokens_total")
        for _ in range(4):  # nothing shared: turns alternate; each replica answers as one
            body = {
                "input_ids": [rng.randrange(100, 1000) for _ in range(40)],
                "return_logprob": True,
                "top_logprobs_num": 5,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            }
            status, two = dp2.post("/generate", body)
            assert status == 200, two
            _, one = server.post("/generate", body)
            assert two["output_ids"] == one["output_ids"]
            # NOTE: the same kernels at another thread count: the same numbers, bit for bit
            assert (
                two["meta_info"]["output_token_logprobs"]
                == one["meta_info"]["output_token_logprobs"]
            )
            assert (
                two["meta_info"]["output_top_logprobs"] == one["meta_info"]["output_top_logprobs"]
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = per_replica(dp2, "prefix_cache_queried_tokens_total")
            if all(a >= b + 80 for a, b in zip(after, before, strict=True)):
                break
            time.sleep(0.1)
        assert all(a >= b + 80 for a, b in zip(after, before, strict=True)), (before, after)

        children = children_of(dp2.proc.pid)
        assert len(children) == 6  # per replica: a detokenizer, a controller, a rank
        (victim,) = [p for p, cmd in children.items() if "tokenmill.tp_worker" in cmd][1:]
        os.kill(victim, signal.SIGKILL)
        assert dp2.proc.wait(timeout=30) != 0
        assert_gone(children)
        assert "tp_worker0.dp" in dp2.log() and "exited with status" in dp2.log()
    finally:
        dp2.stop()
