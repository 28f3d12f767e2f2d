"""Turns the scheduler's rows into one ForwardBatch message (controller process).

Only what changed crosses: the new tokens, their slots, per-row counters and asks.
"""

from __future__ import annotations

import numpy as np

from tokenmill.controller.scheduler import ScheduledRow
from tokenmill.protocol.arrays import pack
from tokenmill.protocol.step import ForwardBatch, LogprobAsks, SamplingBatch


def build_forward_batch(step_id: int, rows: list[ScheduledRow]) -> ForwardBatch:
    ids: list[int] = []
    slots: list[int] = []
    for row in rows:
        request = row.request
        ids += request.tokens(row.start, row.end)
        slots += request.slots[row.start : row.end]
    params = [row.request.message.sampling for row in rows]
    asks = [row.request.message.logprobs for row in rows]
    fills = [row.request for row in rows if row.request.fill_table]
    for request in fills:
        request.fill_table = False
    return ForwardBatch(
        step_id=step_id,
        input_ids=_i32(ids),
        out_slots=_i32(slots),
        req_rows=_i32([row.request.row for row in rows]),
        prefix_lens=_i32([row.start for row in rows]),
        extend_lens=_i32([row.num_new for row in rows]),
        is_prefill=pack(np.array([row.is_prefill for row in rows], dtype=bool)),
        fill_rows=_i32([r.row for r in fills]),
        fill_lens=_i32([r.num_computed_tokens for r in fills]),
        fill_slots=_i32([s for r in fills for s in r.slots[: r.num_computed_tokens]]),
        sampling=SamplingBatch(
            temperature=_f32([p.temperature for p in params]),
            top_k=_i32([p.top_k for p in params]),
            top_p=_f32([p.top_p for p in params]),
            min_p=_f32([p.min_p for p in params]),
            seed=pack(np.array([p.seed for p in params], dtype=np.int64)),
        ),
        logprobs=LogprobAsks(
            num_top=_i32([a.num_top for a in asks]),
            token_ids_offsets=_i32(np.cumsum([0] + [len(a.token_ids) for a in asks])),
            token_ids=_i32([t for a in asks for t in a.token_ids]),
            prompt_start=_i32([_prompt_start(row) for row in rows]),
            prompt_next_id=_i32([_prompt_next_id(row) for row in rows]),
        ),
    )


def _prompt_start(row: ScheduledRow) -> int:
    request = row.request
    if not request.wants_prompt_scores or row.start >= request.num_prompt_tokens:
        return -1
    return request.message.logprobs.prompt_start


def _prompt_next_id(row: ScheduledRow) -> int:
    request = row.request
    return request.token_at(row.end) if row.end < request.num_prompt_tokens else -1


def _i32(values: object) -> object:
    return pack(np.asarray(values, dtype=np.int32))


def _f32(values: object) -> object:
    return pack(np.asarray(values, dtype=np.float32))
