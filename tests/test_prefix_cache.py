"""The radix prefix cache, alone and inside the controller (fake worker, no model): hits for
plain and generation-logprob requests alike, prompt logprobs that recompute only from their
start, eviction under a small pool, n identical prompts sharing one prefill, and no leak."""

from __future__ import annotations

import numpy as np
import pytest
from test_controller import make_controller, request, run_until_idle, tokens_of

from tokenmill.controller.radix_cache import RadixCache
from tokenmill.controller.slot_pool import IndexPool
from tokenmill.protocol.arrays import unpack
from tokenmill.protocol.requests import AbortRequest

PROMPT = list(range(3, 35))  # 32 tokens


def test_radix_match_insert_split_and_evict() -> None:
    pool = IndexPool(64, "slots")
    cache = RadixCache(pool)
    a = pool.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], a)
    assert cache.match([1, 2, 3, 9]).slots == a[:3]  # splits the edge after 3 tokens
    b = pool.alloc(4)
    kept = cache.insert([1, 2, 3, 7, 8, 9], a[:3] + b[:3])
    assert kept.slots == a[:3] + b[:3]
    pool.free([b[3]])
    dup = pool.alloc(2)
    kept = cache.insert([1, 2], dup)  # already cached: the duplicates are freed
    assert kept.slots == a[:2] and pool.num_free == 64 - 9
    cache.check_integrity()
    locked = cache.match([1, 2, 3, 7, 8, 9])
    cache.lock(locked.node)
    assert cache.evict(100) == 3  # only the unlocked branch [4, 5, 6] goes
    assert cache.match([1, 2, 3, 4]).slots == a[:3]
    cache.unlock(locked.node)
    assert cache.evict(100) == 6 and pool.num_free == 64
    cache.check_integrity()


@pytest.mark.parametrize(
    "asks", [{}, {"return_logprob": True, "num_top": 5}], ids=["no-logprobs", "generation-logprobs"]
)
def test_second_request_hits_all_but_its_last_prompt_token(asks: dict) -> None:
    controller, sockets = make_controller()
    sockets.inbox.append(request("a", PROMPT, max_tokens=3))
    run_until_idle(controller)
    sockets.inbox.append(request("b", PROMPT, max_tokens=3, **asks))
    run_until_idle(controller)
    batch = sockets.batches[-3]  # b's prefill
    assert unpack(batch.prefix_lens).tolist() == [31] and unpack(batch.extend_lens).tolist() == [1]
    assert unpack(batch.fill_lens).tolist() == [31]
    assert unpack(batch.fill_slots).tolist() == unpack(sockets.batches[0].out_slots)[:31].tolist()
    assert controller.kv.hit_tokens == 31 and controller.kv.queried_tokens == 64
    assert tokens_of(sockets.outputs, "b") == tokens_of(sockets.outputs, "a")
    assert [o.num_cached_tokens for o in sockets.outputs if o.req_id == "b"][0] == 31


@pytest.mark.parametrize(("start", "cached"), [(0, 0), (1, 0), (2, 1), (20, 19), (31, 30)])
def test_prompt_logprobs_reuse_the_prefix_only_up_to_their_start(start: int, cached: int) -> None:
    controller, sockets = make_controller()
    sockets.inbox.append(request("warm", PROMPT, max_tokens=2))
    run_until_idle(controller)
    sockets.inbox.append(request("s", PROMPT, max_tokens=1, prompt_start=start, num_top=2))
    run_until_idle(controller)
    scored = next(o for o in sockets.outputs if o.req_id == "s")
    assert unpack(sockets.batches[-1].prefix_lens).tolist() == [cached]
    first = max(start, 1)
    np.testing.assert_allclose(unpack(scored.prompt.logprobs), -np.arange(first, 32) / 100)
    assert controller.kv.hit_tokens == cached


def test_small_pool_evicts_and_results_stay_right() -> None:
    controller, sockets = make_controller(kv_tokens=48, max_model_len=48)
    prompts = {f"r{i}": list(range(3 + i, 23 + i)) for i in range(6)}  # 20 tokens each
    for name, prompt in prompts.items():
        sockets.inbox.append(request(name, prompt, max_tokens=4))
        run_until_idle(controller)
    for name, prompt in prompts.items():
        assert tokens_of(sockets.outputs, name) == [prompt[-1] + k for k in range(1, 5)]
    assert controller.kv.cache.num_cached <= 48
    sockets.inbox.append(request("again", prompts["r5"], max_tokens=4))
    run_until_idle(controller)
    assert controller.kv.hit_tokens == 19  # the newest prompt survived eviction


def test_n_identical_prompts_share_one_prefill() -> None:
    controller, sockets = make_controller(max_prefill=256)
    for i in range(3):
        sockets.inbox.append(request(f"c{i}", PROMPT, max_tokens=2))
    run_until_idle(controller)
    computed = sum(int(unpack(b.extend_lens)[unpack(b.is_prefill)].sum()) for b in sockets.batches)
    assert computed == 32 + 1 + 1  # one full prefill, then one token each
    assert controller.kv.hit_tokens == 62


def test_mixed_run_with_aborts_leaks_nothing() -> None:
    controller, sockets = make_controller(kv_tokens=96, max_prefill=16)
    rng = np.random.default_rng(0)
    for i in range(12):
        length = int(rng.integers(2, 40))
        prompt = PROMPT[: length // 2] + rng.integers(3, 39, length - length // 2).tolist()
        sockets.inbox.append(
            request(
                f"m{i}",
                prompt,
                max_tokens=int(rng.integers(1, 9)),
                prompt_start=int(rng.integers(-1, 3)),
                return_logprob=bool(i % 2),
            )
        )
        if i % 3 == 2:
            sockets.inbox.append(AbortRequest(f"m{i - 1}"))
        controller.run_once()
        controller.run_once()
        controller.kv.check_integrity(controller.scheduler.running)
    run_until_idle(controller)
    controller.kv.check_integrity([])
    assert controller.kv.num_available == 96


def test_disabled_cache_never_hits() -> None:
    from tokenmill.controller.config import ControllerConfig
    from tokenmill.controller.controller import Controller
    from tokenmill.protocol.step import WorkerReady

    _, sockets = make_controller()
    config = ControllerConfig(
        "",
        (),
        "",
        "",
        "",
        max_running_requests=8,
        max_prefill_tokens=64,
        report_interval_s=0.0,
        enable_prefix_cache=False,
    )
    controller = Controller(config, WorkerReady(256, 128, (1,)), sockets)  # type: ignore[arg-type]
    for name in "ab":
        sockets.inbox.append(request(name, PROMPT, max_tokens=2))
        run_until_idle(controller)
    assert controller.kv.hit_tokens == 0 and controller.kv.pool.num_free == 256
