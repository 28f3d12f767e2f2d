"""The persistent decode batch: while a batch decodes the same rows, the controller reuses the
rows' part of the message and the worker the rows' inputs. Both must give, step by step,
exactly what building everything anew gives (and the fast path must actually run)."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import torch
from helpers import make_engine
from test_controller import make_controller, request, run_until_idle, tokens_of

from tokenmill.controller.batch_builder import BatchBuilder, build_forward_batch
from tokenmill.controller.scheduler import ScheduledRow
from tokenmill.protocol.arrays import pack
from tokenmill.protocol.requests import (
    DetokenizeParams,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
)
from tokenmill.protocol.step import ForwardBatch
from tokenmill.tp_worker.step_inputs import StepInputs, StepInputsBuilder
from tokenmill.tp_worker.upload import Upload


def _messages() -> list[GenerateRequest]:
    """Rows that join and leave at different steps, each asking something else."""
    return [
        request("plain", [3, 4, 5], max_tokens=9),
        request("top", [6, 7], max_tokens=14, return_logprob=True, num_top=3),
        request("ids", [8, 9, 10, 11], max_tokens=6, token_ids=(5, 6)),
        request("min", [12, 13], max_tokens=12, sampling={"min_tokens": 5}),
        request("pen", [14, 15], max_tokens=11, sampling={"presence_penalty": 0.5}),
        request("bias", [16], max_tokens=10, sampling={"logit_bias": ((7, 2.0),)}),
        request("late", [17, 18, 19, 20, 21, 22, 23, 24, 25], max_tokens=8),
    ]


@pytest.mark.parametrize("decode_steps", [1, 3])
@pytest.mark.parametrize("overlap", [False, True])
def test_batch_builder_sends_what_a_fresh_build_sends(
    monkeypatch: pytest.MonkeyPatch, decode_steps: int, overlap: bool
) -> None:
    built = BatchBuilder.build
    reused: list[bool] = []
    last: list[ForwardBatch] = []

    def checked(
        self: BatchBuilder, step_id: int, rows: list[ScheduledRow], num_steps: int = 1
    ) -> ForwardBatch:
        fills = [row.request.fill_table for row in rows]
        fresh = built(BatchBuilder(), step_id, rows, num_steps)  # what build_forward_batch does
        for row, fill in zip(rows, fills, strict=True):
            row.request.fill_table = fill  # NOTE: the fresh build cleared them
        batch = built(self, step_id, rows, num_steps)
        assert batch == fresh, f"step {step_id}"
        reused.append(bool(last) and batch.logprobs is last[-1].logprobs)
        last.append(batch)
        return batch

    monkeypatch.setattr(BatchBuilder, "build", checked)
    # NOTE: a small pool: the late request waits for slots, and rows leave and join
    controller, sockets = make_controller(
        kv_tokens=96, max_running=4, decode_steps=decode_steps, overlap_schedule=overlap
    )
    sockets.inbox.extend(_messages())
    run_until_idle(controller)
    assert sum(reused) >= 5, "no decode step reused its rows' part"
    assert not all(reused[1:]), "rows changed, yet every step reused the part before"
    assert len(tokens_of(sockets.outputs, "late")) == 8


def _generate(req_id: str, sampling: dict[str, object], **logprobs: object) -> GenerateRequest:
    """A prompt of its own: 4 to 11 tokens from where the id's first letter says."""
    first = 3 + 20 * (ord(req_id[0]) - ord("a"))
    return GenerateRequest(
        req_id,
        pack(np.arange(first, first + 4 + len(req_id) + len(sampling), dtype=np.int32)),
        SamplingParams(**{"max_tokens": 10, "temperature": 0.0, **sampling}),  # type: ignore[arg-type]
        LogprobParams(**logprobs),  # type: ignore[arg-type]
        DetokenizeParams(),
    )


def _same_inputs(a: StepInputs, b: StepInputs) -> None:
    _same(a, b, "inputs")


def _same(x: object, y: object, name: str) -> None:
    """Field by field, tensors and arrays by value."""
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and torch.equal(x, y), name
    elif isinstance(x, np.ndarray):
        np.testing.assert_array_equal(x, y, err_msg=name)
    elif isinstance(x, tuple):
        assert isinstance(y, tuple) and len(x) == len(y), name
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _same(u, v, f"{name}[{i}]")
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        assert type(x) is type(y), name
        for field in dataclasses.fields(x):
            _same(getattr(x, field.name), getattr(y, field.name), f"{name}.{field.name}")
    else:
        assert x == y, name


def test_worker_keeps_the_rows_inputs_of_a_decode_run(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint
) -> None:
    built = StepInputsBuilder.build
    kept: list[bool] = []

    def checked(self: StepInputsBuilder, batch: ForwardBatch) -> StepInputs:
        before = self._last
        inputs = built(self, batch)
        _same_inputs(inputs, StepInputs.from_batch(batch, Upload(self.device)))
        kept.append(before is not None and inputs.sampling is before[1].sampling)
        return inputs

    monkeypatch.setattr(StepInputsBuilder, "build", checked)
    engine = make_engine(tiny_checkpoint(), rows=8)
    messages = [
        _generate("plain", {"max_tokens": 16}),
        _generate("top", {"max_tokens": 16}, return_logprob=True, num_top=4),
        _generate("ids", {"max_tokens": 6}, token_ids=(5, 9)),
        _generate("random", {"temperature": 0.8, "seed": 7, "max_tokens": 16}),
        _generate("bias", {"logit_bias": ((11, 3.0),), "max_tokens": 16}),
        _generate("min", {"min_tokens": 4, "max_tokens": 8}),
        _generate("pen", {"frequency_penalty": 0.4, "max_tokens": 7}),
    ]
    engine.sockets.inbox.extend(messages)
    while engine.sockets.inbox or engine.controller.has_work():
        engine.controller.run_once()
    assert sum(kept) >= 3, "no decode step kept its rows' inputs"
    assert not all(kept[1:])


def test_a_changed_ask_takes_the_whole_path(tiny_checkpoint) -> None:
    """Two batches over the same rows that differ only in one row's top-k: the second must not
    reuse the first's inputs."""
    engine = make_engine(tiny_checkpoint(), rows=4)
    builder = StepInputsBuilder(torch.device("cpu"))
    engine.sockets.inbox.extend([_generate("a", {}), _generate("b", {"seed": 3})])
    engine.controller.run_once()  # the prefill step
    rows = engine.controller.scheduler.schedule()
    assert rows and not any(row.is_prefill for row in rows)
    first = build_forward_batch(10, rows)
    builder.build(first)
    assert builder._last is not None, "a decode batch's rows are kept"
    asks = msgspec.structs.replace(
        first.logprobs, num_top=pack(np.array([2] + [0] * (len(rows) - 1), np.int32))
    )
    second = msgspec.structs.replace(first, step_id=11, logprobs=asks)
    inputs = builder.build(second)
    assert inputs.max_top == 2
    _same_inputs(inputs, StepInputs.from_batch(second, Upload(torch.device("cpu"))))


def test_every_step_keeps_its_tokens_rows_and_positions_on_the_host(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint
) -> None:
    """What the Triton attention plans its tiles from, so that it copies nothing back from a
    GPU (a sync): the host's rows and positions equal the device's in prompt chunks, in
    persistent decode steps and in a multi-step run's later iterations."""
    sizes: list[int] = []

    def check(inputs: StepInputs) -> StepInputs:
        assert inputs.host is not None, "a step without its rows on the host"
        rows, positions = inputs.host.tokens
        np.testing.assert_array_equal(rows, inputs.token_rows.numpy())
        np.testing.assert_array_equal(positions, inputs.positions.numpy())
        sizes.append(len(rows))
        return inputs

    built, stepped = StepInputsBuilder.build, StepInputs.next_decode_step
    monkeypatch.setattr(StepInputsBuilder, "build", lambda self, b: check(built(self, b)))
    monkeypatch.setattr(
        StepInputs, "next_decode_step", lambda self, i, ids: check(stepped(self, i, ids))
    )
    engine = make_engine(tiny_checkpoint(), rows=4, decode_steps=3, max_prefill_tokens=8)
    engine.sockets.inbox.extend(
        [_generate("plain", {"max_tokens": 9}), _generate("long", {"max_tokens": 5})]
    )
    while engine.sockets.inbox or engine.controller.has_work():
        engine.controller.run_once()
    assert max(sizes) == 8 and sizes.count(2) >= 3, sizes  # NOTE: chunks, then both decoding
