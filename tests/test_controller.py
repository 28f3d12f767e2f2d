"""Controller tests on the CPU with no model: fake step results in, assert the next step
message and the outputs (like vLLM's scheduler tests)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from tokenmill.controller.config import ControllerConfig
from tokenmill.controller.controller import Controller
from tokenmill.controller.scheduler import DECODE_SLOT_RUN
from tokenmill.controller.step_timing import StepTiming
from tokenmill.controller.token_prefix import common_prefix_len
from tokenmill.offline.engine import LocalSockets
from tokenmill.protocol.arrays import pack, unpack
from tokenmill.protocol.outputs import BatchOutput, RequestOutput
from tokenmill.protocol.requests import (
    AbortRequest,
    DetokenizeParams,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
)
from tokenmill.protocol.stats import EngineReport
from tokenmill.protocol.step import FED_LAST_SAMPLE, ForwardBatch, StepResult, WorkerReady
from tokenmill.tp_worker.fed_samples import LastSamples

VOCAB = 50
EOS = 1


def fake_step(batch: ForwardBatch) -> StepResult:
    """A deterministic 'model': next id = (last input id + 1) mod VOCAB (skipping EOS unless
    the input is 40), logprob = -0.1 * next id; prompt position p scores -p / 100."""
    ids, ext = unpack(batch.input_ids), unpack(batch.extend_lens)
    steps = [_ban_stops(_next(ids[np.cumsum(ext) - 1]), batch, 0)]
    for i in range(1, batch.num_steps):  # multi-step: each iteration feeds the last sample
        steps.append(_ban_stops(_next(steps[-1]), batch, i))
    next_ids = np.stack(steps)  # [N, B]
    n = batch.num_steps
    num_top = unpack(batch.logprobs.num_top)
    k = int(num_top.max()) if len(num_top) else 0
    rows = int((num_top > 0).sum())
    plan = _prompt_positions(batch)
    counts = [len(p) for p in plan]
    positions = np.concatenate(plan) if plan else np.zeros(0)
    m = len(unpack(batch.logprobs.token_ids))
    kp = int(num_top[[i for i, c in enumerate(counts) if c]].max()) if any(counts) else 0
    return StepResult(
        step_id=batch.step_id,
        next_ids=pack(next_ids),
        logprobs=pack((-0.1 * next_ids).astype(np.float32)),
        top_ids=pack(np.tile(np.arange(k, dtype=np.int32), (n, rows, 1))),
        top_logprobs=pack(np.full((n, rows, k), -1.0, np.float32)),
        token_ids_logprobs=pack(np.full((n, m), -2.0, np.float32)),
        prompt_offsets=pack(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)),
        prompt_logprobs=pack((-positions / 100).astype(np.float32)),
        prompt_top_ids=pack(np.zeros((len(positions), kp), np.int32)),
        prompt_top_logprobs=pack(np.zeros((len(positions), kp), np.float32)),
    )


def _ban_stops(next_ids: np.ndarray, batch: ForwardBatch, step: int) -> np.ndarray:
    """min_tokens, as the worker does it: in decode iteration `step`, a row's banned stop id
    is replaced (here by 3)."""
    ban = batch.sampling.stop_ban
    if ban is None:
        return next_ids
    num_steps, offsets, stop_ids = unpack(ban.num_steps), unpack(ban.offsets), unpack(ban.ids)
    out = next_ids.copy()
    for b, n in enumerate(num_steps):
        banned = set(stop_ids[offsets[b] : offsets[b + 1]].tolist())
        banned |= {EOS} if unpack(ban.ban_eos)[b] else set()
        if step < n and int(out[b]) in banned:
            out[b] = 3
    return out


def _next(last: np.ndarray) -> np.ndarray:
    """The fake model's next token after each of `last`."""
    nxt = np.where(last == 40, EOS, (last + 1) % VOCAB)
    return np.where((nxt == EOS) & (last != 40), 2, nxt).astype(np.int32)


def _prompt_positions(batch: ForwardBatch) -> list[np.ndarray]:
    """Scored prompt positions per row, by the rule the worker follows."""
    start = unpack(batch.logprobs.prompt_start)
    nxt = unpack(batch.logprobs.prompt_next_id)
    pre, ext = unpack(batch.prefix_lens), unpack(batch.extend_lens)
    out = []
    for b in range(len(start)):
        if start[b] < 0:
            out.append(np.zeros(0))
            continue
        lo = max(int(start[b]), int(pre[b]) + 1)
        hi = int(pre[b] + ext[b]) + (1 if nxt[b] >= 0 else 0)
        out.append(np.arange(lo, max(lo, hi), dtype=np.float64))
    return out


class FakeSockets(LocalSockets):
    """The in-process sockets over the fake model, keeping what went out for the asserts."""

    def __init__(self, num_rows: int = 64) -> None:
        super().__init__(self._step)
        self.last_samples = LastSamples(num_rows)  # NOTE: the worker's, for FED_LAST_SAMPLE
        self.batches: list[ForwardBatch] = []
        self.reports: list[EngineReport] = []

    def send_batch(self, batch: ForwardBatch) -> None:
        self.batches.append(batch)
        super().send_batch(batch)

    def send_report(self, report: EngineReport) -> None:
        self.reports.append(report)

    def _step(self, batch: ForwardBatch) -> StepResult:
        batch = self.last_samples.feed(batch)
        result = fake_step(batch)
        self.last_samples.record(batch, result)
        return result


def make_controller(
    kv_tokens: int = 256,
    max_running: int = 8,
    max_prefill: int = 64,
    max_model_len: int = 128,
    decode_steps: int = 1,
    **limits: float,
) -> tuple[Controller, FakeSockets]:
    config = ControllerConfig(
        "",
        (),
        "",
        "",
        "",
        max_running_requests=max_running,
        max_prefill_tokens=max_prefill,
        report_interval_s=0.0,
        integrity_idle_s=0.0,
        decode_steps=decode_steps,
        **limits,  # type: ignore[arg-type]
    )
    sockets = FakeSockets()
    ready = WorkerReady(
        kv_cache_tokens=kv_tokens, max_model_len=max_model_len, eos_token_ids=(EOS,)
    )
    return Controller(config, ready, sockets), sockets  # type: ignore[arg-type]


def request(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    sampling: dict[str, object] | None = None,
    **logprobs: object,
) -> GenerateRequest:
    return GenerateRequest(
        req_id,
        pack(np.array(prompt, np.int32)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **(sampling or {})),  # type: ignore[arg-type]
        LogprobParams(**logprobs),
        DetokenizeParams(),
    )


def run_until_idle(controller: Controller, limit: int = 500) -> None:
    for _ in range(limit):
        controller.run_once()
        if not controller.scheduler.has_work():
            controller.run_once()  # one idle pass runs the integrity checks
            return
    raise AssertionError("the controller did not finish its requests")


def tokens_of(outputs: list[RequestOutput], req_id: str) -> list[int]:
    return [int(t) for o in outputs if o.req_id == req_id for t in unpack(o.new_ids)]


def test_generates_until_max_tokens_and_frees_everything() -> None:
    controller, sockets = make_controller()
    sockets.inbox.append(request("a", [3, 4, 5], max_tokens=4))
    run_until_idle(controller)
    assert tokens_of(sockets.outputs, "a") == [6, 7, 8, 9]
    assert sockets.outputs[-1].finish_reason == "length"
    assert sockets.outputs[0].detokenize is not None and sockets.outputs[1].detokenize is None
    assert controller.kv.num_available == 256 and controller.rows.num_free == 8


def test_chunked_prefill_respects_budget_and_next_step_message() -> None:
    controller, sockets = make_controller(max_prefill=10)
    sockets.inbox.append(request("a", list(range(3, 28)), max_tokens=2))  # 25 tokens
    controller.run_once()
    first = sockets.batches[0]
    assert unpack(first.extend_lens).tolist() == [10]
    assert unpack(first.is_prefill).tolist() == [True]
    run_until_idle(controller)
    extends = [unpack(b.extend_lens).tolist() for b in sockets.batches]
    assert extends == [[10], [10], [5], [1]]
    prefix = [unpack(b.prefix_lens).tolist() for b in sockets.batches]
    assert prefix == [[0], [10], [20], [25]]
    assert not unpack(sockets.batches[-1].is_prefill)[0]
    assert tokens_of(sockets.outputs, "a") == [28, 29]


def test_eos_and_stop_token_ids_finish_with_stop() -> None:
    controller, sockets = make_controller()
    sockets.inbox.append(request("eos", [38, 39], max_tokens=10))  # 39 -> 40 -> EOS
    run_until_idle(controller)
    assert tokens_of(sockets.outputs, "eos") == [40, EOS]
    assert sockets.outputs[-1].finish_reason == "stop"
    assert sockets.outputs[-1].finish_detail == str(EOS)


def test_max_tokens_zero_scores_the_prompt_only() -> None:
    controller, sockets = make_controller(max_prefill=4)
    sockets.inbox.append(
        request("echo", list(range(3, 13)), max_tokens=0, prompt_start=0, num_top=2)
    )
    run_until_idle(controller)
    (out,) = sockets.outputs
    assert out.finish_reason == "length" and len(unpack(out.new_ids)) == 0
    assert out.prompt is not None
    assert unpack(out.prompt.token_ids).tolist() == list(range(3, 13))
    # Position 0 has no logprob; positions 1..9 were scored across three chunks.
    np.testing.assert_allclose(unpack(out.prompt.logprobs), -np.arange(1, 10) / 100)
    assert unpack(out.prompt.top_ids).shape == (9, 2)


def test_prompt_logprobs_from_a_start_position() -> None:
    controller, sockets = make_controller(max_prefill=5)
    sockets.inbox.append(
        request("s", list(range(3, 20)), max_tokens=1, prompt_start=7, return_logprob=True)
    )
    run_until_idle(controller)
    out = sockets.outputs[0]
    assert out.prompt is not None and out.prompt.start == 7
    np.testing.assert_allclose(unpack(out.prompt.logprobs), -np.arange(7, 17) / 100)
    assert unpack(out.logprobs).shape == (1,)


def test_admission_waits_instead_of_over_committing() -> None:
    controller, sockets = make_controller(kv_tokens=40, max_prefill=64)
    for i, name in enumerate("abc"):
        sockets.inbox.append(request(name, list(range(3 + i, 18 + i)), max_tokens=3))  # 15 each
    controller.run_once()
    assert len(controller.scheduler.running) == 2 and len(controller.scheduler.waiting) == 1
    run_until_idle(controller)
    for i, name in enumerate("abc"):
        assert tokens_of(sockets.outputs, name) == [18 + i, 19 + i, 20 + i]


def test_preemption_requeues_and_loses_nothing() -> None:
    controller, sockets = make_controller(kv_tokens=36, max_prefill=64, max_model_len=64)
    sockets.inbox.append(request("a", list(range(3, 13)), max_tokens=12))
    sockets.inbox.append(request("b", list(range(15, 25)), max_tokens=12))
    run_until_idle(controller)
    assert controller.scheduler.num_preemptions > 0
    assert tokens_of(sockets.outputs, "a") == list(range(13, 25))
    assert tokens_of(sockets.outputs, "b") == list(range(25, 37))


def test_abort_frees_slots_and_reports_abort() -> None:
    controller, sockets = make_controller()
    sockets.inbox.append(request("a", [3, 4, 5], max_tokens=50))
    controller.run_once()
    controller.run_once()
    assert controller.slots.num_free < 256
    sockets.inbox.append(AbortRequest("a"))
    sockets.inbox.append(AbortRequest("unknown"))
    run_until_idle(controller)
    assert sockets.outputs[-1].finish_reason == "abort"
    assert controller.kv.num_available == 256


def test_a_request_ended_before_its_first_step_tells_the_detokenizer_how() -> None:
    """Aborted while waiting, turned away by a full queue, or timed out in it: the one output
    such a request gets carries its detokenize params (the detokenizer has not seen it)."""
    controller, sockets = make_controller(max_running=1, max_queued_requests=3)
    for name in ("running", "waiting", "aborted", "turned away"):
        sockets.inbox.append(request(name, [3, 4, 5], max_tokens=50))
    sockets.inbox.append(AbortRequest("aborted"))
    controller.run_once()
    ended = {o.req_id: o for o in sockets.outputs if o.finish_reason is not None}
    assert ended["aborted"].finish_reason == "abort"
    assert ended["turned away"].finish_reason == "rejected"
    assert "--max-queued-requests" in ended["turned away"].finish_detail
    assert all(o.detokenize is not None for o in ended.values())
    assert [r.req_id for r in controller.scheduler.waiting] == ["waiting"]
    run_until_idle(controller)
    assert controller.kv.num_available == 256


def test_a_request_waiting_past_the_queue_timeout_fails(monkeypatch) -> None:
    import tokenmill.controller.controller as controller_module

    controller, sockets = make_controller(max_running=1, queue_timeout_s=5.0)
    now = [1000.0]
    monkeypatch.setattr(controller_module.time, "monotonic", lambda: now[0])
    monkeypatch.setattr("tokenmill.controller.request.time.monotonic", lambda: now[0])
    sockets.inbox.append(request("first", [3, 4], max_tokens=30))
    sockets.inbox.append(request("second", [5, 6], max_tokens=30))
    controller.run_once()  # "first" runs, "second" waits
    now[0] += 6.0
    controller.run_once()
    second = [o for o in sockets.outputs if o.req_id == "second"]
    assert [o.finish_reason for o in second] == ["queue_timeout"]
    assert second[0].detokenize is not None
    run_until_idle(controller)
    assert tokens_of(sockets.outputs, "first") == list(range(5, 35))  # it ran on, untouched
    assert controller.kv.num_available == 256


def test_generation_logprobs_slice_per_request() -> None:
    controller, sockets = make_controller()
    sockets.inbox.append(request("plain", [3, 4], max_tokens=2))
    sockets.inbox.append(
        request("top", [5, 6], max_tokens=2, return_logprob=True, num_top=3, token_ids=(7, 8))
    )
    run_until_idle(controller)
    top = [o for o in sockets.outputs if o.req_id == "top"]
    plain = [o for o in sockets.outputs if o.req_id == "plain"]
    assert all(o.logprobs is None and o.top_ids is None for o in plain)
    for o in top:
        assert unpack(o.top_ids).shape == (1, 3)
        assert unpack(o.token_ids_logprobs).tolist() == [[-2.0, -2.0]]
        assert unpack(o.logprobs).tolist() == pytest.approx([-0.1 * unpack(o.new_ids)[0]])


def _run_all(decode_steps: int, messages: list, **kwargs: int) -> tuple[Controller, FakeSockets]:
    controller, sockets = make_controller(decode_steps=decode_steps, **kwargs)
    sockets.inbox.extend(messages)
    run_until_idle(controller)
    return controller, sockets


def test_multi_step_decoding_gives_the_same_outputs() -> None:
    messages = [
        request("eos", [35, 36], max_tokens=20, return_logprob=True, num_top=2),  # 40 -> EOS
        request("len7", [3, 4, 5], max_tokens=7, return_logprob=True, token_ids=(5, 6)),
        request("len1", [10, 11], max_tokens=1),
        request("long", [37, 38], max_tokens=9),
    ]
    _, single = _run_all(1, messages)
    controller, multi = _run_all(4, messages)
    assert any(b.num_steps == 4 for b in multi.batches)
    assert len(multi.batches) < len(single.batches)
    for name in ("eos", "len7", "len1", "long"):
        assert tokens_of(multi.outputs, name) == tokens_of(single.outputs, name)
        a = [o for o in single.outputs if o.req_id == name]
        b = [o for o in multi.outputs if o.req_id == name]
        assert a[-1].finish_reason == b[-1].finish_reason
        for field in ("logprobs", "top_ids", "token_ids_logprobs"):
            got = [unpack(getattr(o, field)) for o in b if getattr(o, field) is not None]
            want = [unpack(getattr(o, field)) for o in a if getattr(o, field) is not None]
            if want:
                np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
    assert tokens_of(multi.outputs, "eos") == [37, 38, 39, 40, EOS]
    assert controller.kv.num_available == 256


def test_multi_step_batch_carries_the_next_slots() -> None:
    controller, sockets = make_controller(decode_steps=3)
    sockets.inbox.append(request("a", [3, 4, 5], max_tokens=7))
    run_until_idle(controller)
    multi = [b for b in sockets.batches if b.num_steps > 1]
    assert multi and all(b.decode_slots is not None for b in multi)
    first = multi[0]
    prefix = int(unpack(first.prefix_lens)[0])
    slots = unpack(first.decode_slots)[:, 0].tolist()
    assert len(slots) == first.num_steps - 1
    # the slots of the following positions: what the next batches' out_slots would be
    assert slots == list(range(prefix + 1, prefix + first.num_steps))
    assert sum(b.num_steps for b in sockets.batches[1:]) == 6  # 7 tokens: 1 from the prefill


def test_multi_step_waits_for_prefills_and_queues() -> None:
    controller, sockets = make_controller(decode_steps=4, max_prefill=4)
    sockets.inbox.append(request("a", [3, 4, 5], max_tokens=12))
    controller.run_once()
    controller.run_once()
    sockets.inbox.append(request("b", list(range(3, 14)), max_tokens=4))  # 11 tokens: 3 chunks
    run_until_idle(controller)
    for batch in sockets.batches:
        if unpack(batch.is_prefill).any():
            assert batch.num_steps == 1
    assert tokens_of(sockets.outputs, "a") == list(range(6, 18))
    assert tokens_of(sockets.outputs, "b") == [14, 15, 16, 17]


def test_decoding_rows_get_their_slots_in_runs() -> None:
    """Two requests decoding side by side: each row's slots come in runs of consecutive
    slots (not interleaved one per step), none past what the request can use, all freed."""
    controller, sockets = make_controller(kv_tokens=256, max_model_len=128)
    sockets.inbox.append(request("a", [3, 4, 5], max_tokens=40))
    sockets.inbox.append(request("b", [6, 7, 8], max_tokens=20))
    controller.run_once()
    while all(r.num_tokens < 22 for r in controller.scheduler.running):
        controller.run_once()
    for r in controller.scheduler.running:
        decode = r.slots[3:]
        gaps = sum(1 for x, y in zip(decode, decode[1:], strict=False) if y != x + 1)
        assert gaps <= len(decode) // DECODE_SLOT_RUN, (r.req_id, r.slots)
        assert len(r.slots) <= r.num_prompt_tokens + r.message.sampling.max_tokens - 1
    run_until_idle(controller)
    assert controller.kv.num_available == 256


def test_slot_runs_never_cost_a_preemption_on_a_tight_pool() -> None:
    """Two requests that together need 42 slots, on a 44-slot pool: a run never takes more
    than its request can use, so they finish without a preemption, and nothing leaks."""
    controller, sockets = make_controller(kv_tokens=44, max_prefill=64, max_model_len=64)
    sockets.inbox.append(request("a", list(range(3, 13)), max_tokens=12))
    sockets.inbox.append(request("b", list(range(15, 25)), max_tokens=12))
    run_until_idle(controller)
    assert controller.scheduler.num_preemptions == 0
    assert tokens_of(sockets.outputs, "a") == list(range(13, 25))
    assert tokens_of(sockets.outputs, "b") == list(range(25, 37))
    assert controller.kv.num_available == 44


def test_a_shared_prefix_is_computed_once_even_when_short() -> None:
    """Items of one scoring request share the query: with the hint, the later items wait for
    the first one's prefill and hit the cache, even where the query is under half the prompt
    (where requests without the hint compute it each)."""
    query = list(range(3, 11))  # 8 tokens
    items = [list(range(20 + 12 * i, 32 + 12 * i)) for i in range(4)]  # 12 tokens each

    def run(hint: int) -> Controller:
        controller, sockets = make_controller(kv_tokens=512, max_prefill=256)
        for i, item in enumerate(items):
            message = request(f"s{i}", query + item, max_tokens=1, token_ids=(5, 6))
            sockets.inbox.append(msgspec.structs.replace(message, shared_prefix_len=hint))
        run_until_idle(controller)
        assert all(tokens_of(sockets.outputs, f"s{i}") for i in range(4))
        return controller

    assert run(hint=len(query)).kv.hit_tokens == 3 * len(query)
    assert run(hint=0).kv.hit_tokens == 0


def _distinct_items() -> list[list[int]]:
    return [list(range(40 + 8 * i, 48 + 8 * i)) for i in range(6)]


def _items_that_begin_alike() -> list[list[int]]:
    """Documents that begin with the same word: two shared tokens, three for the first two."""
    items = [[40, 41, 50 + 8 * i] + list(range(100 + 8 * i, 105 + 8 * i)) for i in range(6)]
    items[1][:3] = items[0][:3]
    return items


@pytest.mark.parametrize("make_items", [_distinct_items, _items_that_begin_alike])
def test_items_after_a_cached_query_go_in_one_step(
    make_items: Callable[[], list[list[int]]],
) -> None:
    """The query already cached (an earlier request computed it): every item of a scoring
    request is admitted into the same prefill step, none waits for another's, even where
    items share their first few tokens past the query (not worth a step)."""
    query = list(range(3, 35))  # 32 tokens, more than half of each prompt
    items = make_items()
    controller, sockets = make_controller(kv_tokens=512, max_prefill=256)
    sockets.inbox.append(request("q", query, max_tokens=1))
    run_until_idle(controller)
    first = len(sockets.batches)
    for i, item in enumerate(items):
        message = request(f"s{i}", query + item, max_tokens=1, token_ids=(5, 6))
        sockets.inbox.append(msgspec.structs.replace(message, shared_prefix_len=len(query)))
    run_until_idle(controller)
    assert all(tokens_of(sockets.outputs, f"s{i}") for i in range(6))
    assert len(sockets.batches) - first == 1
    assert controller.kv.hit_tokens == 6 * len(query)


def test_a_prompt_mostly_shared_past_the_cache_waits_and_lets_others_by() -> None:
    """A prompt that shares most of what is not cached with one being prefilled waits one step
    and finds those tokens in the cache instead of computing them again; a prompt behind it
    that shares nothing does not wait for it."""
    prompt = list(range(3, 43))
    controller, sockets = make_controller(kv_tokens=512, max_prefill=256)
    sockets.inbox.append(request("a", prompt, max_tokens=1))
    sockets.inbox.append(request("b", prompt[:-2] + [90, 91], max_tokens=1))
    sockets.inbox.append(request("c", list(range(60, 80)), max_tokens=1))
    run_until_idle(controller)
    assert all(tokens_of(sockets.outputs, r) for r in "abc")
    assert controller.kv.hit_tokens == len(prompt) - 2
    first_step = unpack(sockets.batches[0].extend_lens).tolist()
    assert first_step == [len(prompt), 20] and len(sockets.batches) == 2


@pytest.mark.parametrize("overlap", [True, False])
def test_a_steps_outputs_leave_after_the_next_step_and_in_order(overlap: bool) -> None:
    """Each step's outputs go to the detokenizer right after the next step goes to the
    workers (the detokenizer works while the model does), every one of them, in order; an
    abort's output follows the tokens emitted before it. With overlap scheduling the third
    step is still in flight when the abort comes: its token is dropped with the request."""
    controller, sockets = make_controller(overlap_schedule=overlap)
    events: list[str] = []
    send_batch, send_outputs = sockets.send_batch, sockets.send_outputs

    def batch_out(batch: ForwardBatch) -> None:
        events.append("batch")
        send_batch(batch)

    def outputs_out(outputs: BatchOutput) -> None:
        events.append("outputs")
        send_outputs(outputs)

    sockets.send_batch, sockets.send_outputs = batch_out, outputs_out  # type: ignore[method-assign]
    sockets.inbox.append(request("a", [3, 4, 5], max_tokens=50))
    for _ in range(3):
        controller.run_once()
    assert events == ["batch", "batch", "outputs", "batch", "outputs"]
    assert tokens_of(sockets.outputs, "a") == [6, 7]  # the third step's token is not out yet
    sockets.inbox.append(AbortRequest("a"))
    run_until_idle(controller)
    assert tokens_of(sockets.outputs, "a") == ([6, 7] if overlap else [6, 7, 8])
    assert sockets.outputs[-1].finish_reason == "abort"


def test_common_prefix_len_matches_a_token_by_token_scan() -> None:
    """Blocks compared as slices, then the differing block token by token: the same as the
    plain scan, wherever the first difference falls (inside, at or across block edges)."""
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(300))]
        lead = [rng.randrange(2) for _ in range(rng.randrange(5))]
        b = lead + a[: rng.randrange(300)] + [rng.randrange(3) for _ in range(rng.randrange(70))]
        start = len(lead) if rng.random() < 0.7 else rng.randrange(len(b) + 1)
        expected = 0
        while expected < min(len(a), len(b) - start) and a[expected] == b[start + expected]:
            expected += 1
        assert common_prefix_len(a, b, start) == expected


def test_the_leak_check_waits_for_a_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot pool and tree are checked once the engine has been idle integrity_idle_s, not
    in the gap between back-to-back requests."""
    controller, sockets = make_controller()
    controller.config = dataclasses.replace(controller.config, integrity_idle_s=1.0)
    checks: list[int] = []
    monkeypatch.setattr(controller.kv, "check_integrity", lambda running: checks.append(1))
    clock = [100.0]
    monkeypatch.setattr("tokenmill.controller.controller.time.monotonic", lambda: clock[0])
    sockets.inbox.append(request("a", [3, 4, 5], max_tokens=1))
    run_until_idle(controller)
    clock[0] += 0.5
    controller.run_once()
    assert checks == []
    clock[0] += 0.6
    controller.run_once()
    controller.run_once()
    assert checks == [1]  # once per pause


def test_the_leak_check_counts_requests_paused_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause in place leaves the engine idle with running requests that keep their slots:
    the leak check counts them as owners (it failed the controller once)."""
    controller, sockets = make_controller()
    controller.config = dataclasses.replace(controller.config, integrity_idle_s=1.0)
    clock = [100.0]
    monkeypatch.setattr("tokenmill.controller.controller.time.monotonic", lambda: clock[0])
    sockets.inbox.append(request("a", [3, 4, 5], max_tokens=40))
    for _ in range(6):
        controller.run_once()
    assert controller.scheduler.running
    controller.control.pause("in_place")
    checked = controller.checked_at_step
    clock[0] += 1.5
    controller.run_once()
    controller.run_once()
    assert controller.checked_at_step != checked, "the check did not run while paused"
    controller.control.paused = None
    run_until_idle(controller)


def _mixed_workload(seed: int) -> list[GenerateRequest]:
    """Prompts that run into EOS (after 40), stop ids, min_tokens, max_tokens 0, prompt and
    top logprobs, prompts that share a prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 30) for _ in range(9)]
    messages = []
    for i in range(24):
        start = rng.choice([5, 20, 33, 36, 38])
        prompt = ([] if i % 3 else shared) + [start + j for j in range(rng.randrange(1, 12))]
        prompt = [t % VOCAB if t % VOCAB > EOS else 3 for t in prompt]
        sampling: dict[str, object] = {}
        if i % 4 == 1:
            sampling["stop_token_ids"] = (rng.randrange(10, 45),)
        if i % 5 == 2:
            sampling["min_tokens"] = rng.randrange(1, 8)
        logprobs: dict[str, object] = {"return_logprob": True, "num_top": i % 3}
        if i % 6 == 0:
            logprobs["prompt_start"] = rng.randrange(0, len(prompt))
        max_tokens = 0 if i % 11 == 7 else rng.randrange(1, 24)
        messages.append(request(f"r{i}", prompt, max_tokens, sampling, **logprobs))
    # NOTE: EOS as output 4: min_tokens 4 lets it stop there, min_tokens 5 bans it.
    for min_tokens in (4, 5):
        sampling = {"min_tokens": min_tokens}
        messages.append(request(f"min{min_tokens}", [35, 36], 12, sampling))
    return messages


def _by_request(outputs: list[RequestOutput]) -> dict[str, list[object]]:
    got: dict[str, list[object]] = {}
    for o in outputs:
        entry = got.setdefault(o.req_id, [[], [], [], [], None])
        entry[0] += unpack(o.new_ids).tolist()
        entry[1] += unpack(o.logprobs).tolist() if o.logprobs is not None else []
        entry[2] += unpack(o.top_ids).tolist() if o.top_ids is not None else []
        entry[3] += unpack(o.prompt.logprobs).tolist() if o.prompt is not None else []
        entry[4] = o.finish_reason
    return got


@pytest.mark.parametrize("decode_steps", [1, 3])
@pytest.mark.parametrize("kv_tokens", [512, 96])
def test_overlap_scheduling_gives_what_one_step_at_a_time_gives(
    decode_steps: int, kv_tokens: int
) -> None:
    """The same tokens, logprobs, prompt logprobs and finish reasons with the next step sent
    before the last one is back, on a roomy pool and on one tight enough to preempt; the rows
    the step in flight stopped are wasted, nothing leaks."""
    runs = {}
    for overlap in (False, True):
        controller, sockets = make_controller(
            kv_tokens=kv_tokens,
            max_prefill=32,
            decode_steps=decode_steps,
            overlap_schedule=overlap,
        )
        sockets.inbox.extend(_mixed_workload(seed=7))
        run_until_idle(controller)
        assert controller.kv.num_available == kv_tokens and controller.rows.num_free == 8
        runs[overlap] = (controller, sockets)
    (sync, sync_sockets), (ahead, ahead_sockets) = runs[False], runs[True]
    want, got = _by_request(sync_sockets.outputs), _by_request(ahead_sockets.outputs)
    assert got == want
    assert want["min4"][0] == [37, 38, 39, 40, EOS] and want["min5"][0][4] == 3
    fed = [(unpack(b.input_ids) == FED_LAST_SAMPLE).sum() for b in ahead_sockets.batches]
    assert sum(fed) > 0 and not any(
        (unpack(b.input_ids) == FED_LAST_SAMPLE).any() for b in sync_sockets.batches
    )
    if kv_tokens == 96:
        assert sync.scheduler.num_preemptions > 0 and ahead.scheduler.num_preemptions > 0


def test_step_timing_counts_decode_steps_from_result_to_result() -> None:
    """A step's period runs from the result of the step before to its own (the workers'
    cycle, in either scheduling mode), counted where both steps decoded only: the prefill's
    figures never count, nor does a step after a gap in the step ids."""
    timing = StepTiming(enabled=True)
    steps = [(1, False, 0.5), (2, True, 0.01), (3, True, 0.02), (4, True, 0.04), (6, True, 0.08)]
    for step_id, decode_only, forward in steps:
        timing.on_result(step_id, decode_only, 1.0, forward, 2)
    totals = timing.totals()
    assert totals["step_timing_decode_steps"] == 2  # steps 3 and 4
    assert totals["step_timing_forward_seconds"] == pytest.approx(0.06)
    assert totals["step_timing_period_seconds"] > 0
    assert totals["step_timing_rows"] == totals["step_timing_row_tokens"] == 4
    timing.on_result(7, True, 1.0, 0.3, 2, num_steps=4)  # a 4-step batch of 2 rows
    assert timing.totals()["step_timing_row_tokens"] == 4 + 8
