"""The stop ban, logit_bias and penalties (tp_worker/sample/penalties.py) against a plain
per-request reference, through ForwardBatches the controller's batch builder makes.

A randomised schedule drives several requests through chunked prefills, decode steps,
preemptions that restart a row from zero or from a cached prefix, table refills that are not
restarts, and rows handed from one request to the next; after every step each sampling row's
logits must equal what one request alone, written out token by token, gives.
"""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import numpy as np
import pytest
import torch

from tokenmill.controller.batch_builder import build_forward_batch
from tokenmill.controller.request import Request
from tokenmill.controller.scheduler import ScheduledRow
from tokenmill.protocol.arrays import pack, unpack
from tokenmill.protocol.requests import (
    DetokenizeParams,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
)
from tokenmill.protocol.step import ForwardBatch
from tokenmill.tp_worker.sample.penalties import LogitAdjuster, LogitAdjustments
from tokenmill.tp_worker.upload import Upload

VOCAB = 64
EOS = 2
NUM_ROWS = 4
CPU = torch.device("cpu")
HOST = Upload(CPU)  # NOTE: the arrays used where they lie, as a CPU worker does


def reference_logits(
    logits: np.ndarray,
    prompt: list[int],
    output: list[int],
    p: SamplingParams,
    eos_ids: tuple[int, ...] = (EOS,),
) -> np.ndarray:
    """One request, one position, float64, in vLLM's order: ban, bias, penalties."""
    z = logits.astype(np.float64).copy()
    if len(output) < p.min_tokens:
        for token in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)):
            z[token] = -np.inf
    for token, bias in p.logit_bias:
        z[token] += bias
    for token in set(prompt) | set(output):
        z[token] = (
            z[token] / p.repetition_penalty if z[token] > 0 else z[token] * p.repetition_penalty
        )
    for token, count in Counter(output).items():
        z[token] -= p.frequency_penalty * count + p.presence_penalty
    return z


def _request(req_id: str, prompt: list[int], **sampling: object) -> Request:
    message = GenerateRequest(
        req_id=req_id,
        input_ids=pack(np.asarray(prompt, np.int32)),
        sampling=SamplingParams(max_tokens=100, **sampling),  # type: ignore[arg-type]
        logprobs=LogprobParams(),
        detokenize=DetokenizeParams(),
    )
    request = Request.from_message(message, 0)
    request.slots = list(range(1000))
    return request


def _random_params(rng: random.Random) -> dict[str, object]:
    if rng.random() < 0.25:
        return {}  # no penalty at all: the row's logits must come back untouched
    return {
        "presence_penalty": rng.choice([0.0, 0.5, -1.2, 2.0]),
        "frequency_penalty": rng.choice([0.0, 0.3, -0.7, 1.9]),
        "repetition_penalty": rng.choice([1.0, 1.3, 0.6, 2.0]),
        "logit_bias": tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), 3)),
        "min_tokens": rng.choice([0, 0, 3, 8]),
        "stop_token_ids": tuple(rng.sample(range(VOCAB), 2)),
        "ignore_eos": rng.random() < 0.3,
    }


class Simulation:
    """Requests moving through table rows as the controller moves them; no model."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.adjuster = LogitAdjuster(NUM_ROWS, VOCAB, (EOS,), CPU)
        self.free_rows = list(range(NUM_ROWS))
        self.running: list[Request] = []
        self.num_requests = 0
        self.num_checked = 0
        self.admitted: set[str] = set()  # first step to come: a chunk, as the scheduler makes

    def admit(self) -> None:
        while self.free_rows and self.rng.random() < 0.7:
            prompt = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 20))]
            request = _request(f"r{self.num_requests}", prompt, **_random_params(self.rng))
            self.num_requests += 1
            self._place(request, cached=self.rng.choice([0, 0, len(prompt) - 1]))

    def _place(self, request: Request, cached: int) -> None:
        """Admission: a row, and a cached prefix of `cached` tokens (filled into the table)."""
        request.row = self.free_rows.pop(self.rng.randrange(len(self.free_rows)))
        request.num_computed_tokens = cached
        request.fill_table = cached > 0
        self.running.append(request)
        self.admitted.add(request.req_id)

    def schedule(self) -> list[ScheduledRow]:
        rows = []
        for request in self.running:
            if self.rng.random() < 0.2:
                continue  # not in this step
            if request.is_prefill or request.req_id in self.admitted:
                self.admitted.discard(request.req_id)
                left = request.num_tokens - request.num_computed_tokens
                rows.append(ScheduledRow.of(request, self.rng.randint(1, left), True))
            else:
                if self.rng.random() < 0.1:
                    request.fill_table = True  # a refill past the prefill: not a restart
                rows.append(ScheduledRow.of(request, 1, False))
        return rows

    def step(self) -> None:
        rows = self.schedule()
        if not rows:
            return
        batch = build_forward_batch(1, rows)
        adjust = LogitAdjustments.from_batch(batch, HOST)
        self.adjuster.begin(adjust)
        logits = torch.randn(len(rows), VOCAB) * 4  # [B, V] float32
        adjusted = self.adjuster.adjust(logits, adjust, 0)
        for b, row in enumerate(rows):
            self._check(row, logits[b], adjusted[b])
            row.request.num_computed_tokens = row.end
            if row.samples:
                row.request.output_ids.append(
                    self.rng.choice([EOS, 5, 6, 7, self.rng.randrange(VOCAB)])
                )
        self._finish_or_preempt()

    def _check(self, row: ScheduledRow, raw: torch.Tensor, got: torch.Tensor) -> None:
        request, p = row.request, row.request.message.sampling
        if not row.samples:
            return
        if p == SamplingParams(max_tokens=100):
            assert torch.equal(got, raw), "a row with no penalty changed"
        want = reference_logits(raw.numpy(), request.prompt_ids, request.output_ids, p)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-6, atol=1e-4)
        self.num_checked += 1

    def _finish_or_preempt(self) -> None:
        for request in list(self.running):
            roll = self.rng.random()
            if request.is_prefill or roll > 0.15:
                continue
            self.running.remove(request)
            self.free_rows.append(request.row)
            if roll < 0.05:  # preempted: recomputed from zero or from a cached prefix
                self._place(request, cached=self.rng.choice([0, request.num_tokens - 1]))


@pytest.mark.parametrize("seed", range(6))
def test_adjusted_logits_match_reference_along_a_random_schedule(seed: int) -> None:
    sim = Simulation(seed)
    for _ in range(150):
        sim.admit()
        sim.step()
    assert sim.num_checked > 100 and sim.num_requests > 10


def _decode_batch(requests: list[Request], num_steps: int) -> ForwardBatch:
    rows = [ScheduledRow.of(r, 1, False) for r in requests]
    batch = build_forward_batch(1, rows)
    slots = np.zeros((num_steps - 1, len(rows)), np.int32)
    return msgspec.structs.replace(batch, num_steps=num_steps, decode_slots=pack(slots))


def test_multi_step_counts_each_iteration_and_lifts_the_ban_on_time() -> None:
    adjuster = LogitAdjuster(NUM_ROWS, VOCAB, (EOS,), CPU)
    params = {"frequency_penalty": 0.8, "repetition_penalty": 1.5, "min_tokens": 3}
    requests = [_request("a", [1, 3, 3], **params), _request("b", [4], presence_penalty=1.0)]
    for row, request in enumerate(requests):
        request.row = row
        adjust = LogitAdjustments.from_batch(
            build_forward_batch(1, [ScheduledRow.of(request, request.num_tokens, True)]), HOST
        )
        adjuster.begin(adjust)
        request.num_computed_tokens = request.num_tokens
        request.output_ids.append(9)  # the prefill's sample
    adjust = LogitAdjustments.from_batch(_decode_batch(requests, 4), HOST)
    adjuster.begin(adjust)
    for i in range(4):
        if i > 0:
            sampled = torch.tensor([9, EOS if i == 1 else 11])  # [B]: fed back next iteration
            adjuster.count_sampled(adjust, sampled)
            for request, token in zip(requests, sampled.tolist(), strict=True):
                request.output_ids.append(token)
        logits = torch.randn(2, VOCAB)
        got = adjuster.adjust(logits, adjust, i)
        for b, request in enumerate(requests):
            # iteration i samples output number len(output_ids) (counted so far, 0-based)
            want = reference_logits(
                logits[b].numpy(), request.prompt_ids, request.output_ids, request.message.sampling
            )
            np.testing.assert_allclose(got[b].double().numpy(), want, rtol=1e-6, atol=1e-5)
    assert requests[0].output_ids[:3] == [9, 9, 9]


def test_no_adjustment_returns_the_logits_themselves() -> None:
    adjuster = LogitAdjuster(NUM_ROWS, VOCAB, (EOS,), CPU)
    request = _request("a", [1, 2, 3])
    request.row = 0
    batch = build_forward_batch(1, [ScheduledRow.of(request, 3, True)])
    assert batch.sampling.penalties is None and batch.sampling.logit_bias is None
    assert batch.sampling.stop_ban is None
    adjust = LogitAdjustments.from_batch(batch, HOST)
    logits = torch.randn(1, VOCAB)
    assert adjuster.adjust(logits, adjust, 0) is logits


def test_stop_ban_masks_eos_and_stop_ids_until_min_tokens() -> None:
    adjuster = LogitAdjuster(NUM_ROWS, VOCAB, (EOS,), CPU)
    request = _request("a", [1, 2, 3], min_tokens=2, stop_token_ids=(7,))
    request.row = 1
    batch = build_forward_batch(1, [ScheduledRow.of(request, 3, True)])
    adjust = LogitAdjustments.from_batch(batch, HOST)
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = logits[0, 7] = 50.0
    got = adjuster.adjust(logits, adjust, 0)
    assert got[0, EOS] == -np.inf and got[0, 7] == -np.inf
    assert torch.isfinite(got[0, :EOS]).all() and got[0, 3] == 0
    request.num_computed_tokens, request.output_ids = 3, [5, 6]  # min_tokens reached
    batch = build_forward_batch(2, [ScheduledRow.of(request, 1, False)])
    assert batch.sampling.stop_ban is None


def test_step_and_request_messages_round_trip_with_every_change() -> None:
    request = _request(
        "a", [1, 2, 3, 1], presence_penalty=0.5, logit_bias=((4, 2.5),), min_tokens=2
    )
    request.row, request.num_computed_tokens, request.fill_table = 2, 2, True
    batch = build_forward_batch(1, [ScheduledRow.of(request, 2, True)])
    decoded = msgspec.msgpack.Decoder(ForwardBatch).decode(msgspec.msgpack.encode(batch))
    s = decoded.sampling
    assert s.penalties is not None and s.logit_bias is not None and s.stop_ban is not None
    assert unpack(s.penalties.history_ids).tolist() == [1, 2]  # the cached prefix
    assert unpack(s.penalties.restart).tolist() == [True]
    assert unpack(s.logit_bias.ids).tolist() == [4] and unpack(s.stop_ban.num_steps)[0] == 2
    message = request.message
    wire = msgspec.msgpack.encode(message)
    assert msgspec.msgpack.Decoder(GenerateRequest).decode(wire) == message
