"""Turns the scheduler's rows into one ForwardBatch message (controller process).

Only what changed crosses: the new tokens, their slots, per-row counters and asks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate

import msgspec

from tokenmill.controller.scheduler import ScheduledRow
from tokenmill.protocol.arrays import Array, pack_list
from tokenmill.protocol.requests import SamplingParams
from tokenmill.protocol.step import (
    FED_LAST_SAMPLE,
    ForwardBatch,
    GrammarRows,
    LogitBias,
    LogprobAsks,
    PenaltyBatch,
    SamplingBatch,
    StopBan,
)


def build_forward_batch(step_id: int, rows: list[ScheduledRow], num_steps: int = 1) -> ForwardBatch:
    """The step's message, every field built from the rows (BatchBuilder reuses what a run of
    decode steps keeps)."""
    return BatchBuilder().build(step_id, rows, num_steps)


@dataclass(frozen=True)
class RowsPart:
    """What a batch says about its rows besides their tokens, positions and slots: which table
    rows, how many new tokens each, and every row's asks. While a batch decodes the same
    requests in the same table rows this stays the same from step to step: a decode row's
    asks are its request's (no prompt position to score, no restart of its penalty history),
    and only the stop ban (min_tokens counting down) is the step's own."""

    key: tuple[tuple[str, int], ...]  # (request id, table row) of each row, in batch order
    req_rows: Array
    extend_lens: Array
    is_prefill: Array
    sampling: SamplingBatch  # its stop_ban: None (built per step)
    logprobs: LogprobAsks
    min_tokens: bool  # some row's request has min_tokens: a stop ban may apply
    constrained: bool  # some row's request has a grammar
    lora_slots: Array | None  # [B] int32 each row's adapter slot; None: no row has one


class BatchBuilder:
    """Builds each step's ForwardBatch; while the batch decodes the same requests in the same
    table rows, the rows' part comes from the step before (vLLM V1 keeps such a persistent
    batch): a step then packs its tokens, positions and slots only."""

    def __init__(self) -> None:
        self._decode: RowsPart | None = None  # the last batch's, where it decoded only

    def build(self, step_id: int, rows: list[ScheduledRow], num_steps: int = 1) -> ForwardBatch:
        ids: list[int] = []
        slots: list[int] = []
        for row in rows:
            request = row.request
            fed = row.num_new - len(row.drafts)
            known = request.tokens(row.start, row.start + fed)
            ids += known
            if len(known) < fed:  # NOTE: a decode row's token, sampled by a step in flight
                ids.append(FED_LAST_SAMPLE)
            ids += row.drafts
            slots += request.slots[row.start : row.end]
        # NOTE: a table row (re)fills with the slots of what the request computed before
        filled = [row for row in rows if row.request.fill_table]
        decodes = _decodes_only(rows)
        part = self._same_rows(rows) if decodes and not filled else None
        if part is None:
            # NOTE: reads fill_table (penalty restarts): before it is cleared
            part = _rows_part(rows, _key(rows) if decodes else ())
            self._decode = part if decodes else None
        for row in filled:
            row.request.fill_table = False
        stop_ban = _stop_ban(rows) if part.min_tokens else None
        sampling = part.sampling
        if stop_ban is not None or part.constrained:
            grammar = _grammar_rows(rows) if part.constrained else None
            sampling = msgspec.structs.replace(sampling, stop_ban=stop_ban, grammar=grammar)
        return ForwardBatch(
            step_id=step_id,
            input_ids=_i32(ids),
            out_slots=_i32(slots),
            req_rows=part.req_rows,
            prefix_lens=_i32([row.start for row in rows]),
            extend_lens=part.extend_lens,
            is_prefill=part.is_prefill,
            fill_rows=_i32([row.request.row for row in filled]) if filled else _NONE,
            fill_lens=_i32([row.start for row in filled]) if filled else _NONE,
            fill_slots=_i32([s for row in filled for s in row.request.slots[: row.start]])
            if filled
            else _NONE,
            sampling=sampling,
            logprobs=part.logprobs,
            num_steps=num_steps,
            decode_slots=_decode_slots(rows, num_steps),
            num_drafts=_i32([len(row.drafts) for row in rows])
            if any(row.drafts for row in rows)
            else None,
            lora_slots=part.lora_slots,
        )

    def _same_rows(self, rows: list[ScheduledRow]) -> RowsPart | None:
        """The last batch's rows' part, where it decoded only and these decode rows are the
        same requests in the same table rows."""
        last = self._decode
        if last is None or len(last.key) != len(rows) or _key(rows) != last.key:
            return None
        return last


def _key(rows: list[ScheduledRow]) -> tuple[tuple[str, int], ...]:
    return tuple((row.request.req_id, row.request.row) for row in rows)


def _decodes_only(rows: list[ScheduledRow]) -> bool:
    return not any(row.is_prefill or row.num_new != 1 for row in rows)


def _rows_part(rows: list[ScheduledRow], key: tuple[tuple[str, int], ...]) -> RowsPart:
    params = [row.request.message.sampling for row in rows]
    asks = [row.request.message.logprobs for row in rows]
    return RowsPart(
        key=key,
        req_rows=_i32([row.request.row for row in rows]),
        extend_lens=_i32([row.num_new for row in rows]),
        is_prefill=pack_list([row.is_prefill for row in rows], "bool"),
        sampling=SamplingBatch(
            temperature=_f32([p.temperature for p in params]),
            top_k=_i32([p.top_k for p in params]),
            top_p=_f32([p.top_p for p in params]),
            min_p=_f32([p.min_p for p in params]),
            seed=pack_list([p.seed for p in params], "int64"),
            logit_bias=_logit_bias(params),
            penalties=_penalties(rows),
        ),
        logprobs=LogprobAsks(
            num_top=_i32([a.num_top for a in asks]),
            token_ids_offsets=_offsets([a.token_ids for a in asks]),
            token_ids=_i32([t for a in asks for t in a.token_ids]),
            prompt_start=_i32([_prompt_start(row) for row in rows]),
            prompt_next_id=_i32([_prompt_next_id(row) for row in rows]),
            sampled=any(a.reads_samples for a in asks),
            processed=pack_list([a.processed for a in asks], "bool")
            if any(a.processed for a in asks)
            else None,
        ),
        min_tokens=any(p.min_tokens for p in params),
        constrained=any(row.request.grammar is not None for row in rows),
        lora_slots=_i32([row.request.lora_slot for row in rows])
        if any(row.request.lora_slot >= 0 for row in rows)
        else None,
    )


def _grammar_rows(rows: list[ScheduledRow]) -> GrammarRows | None:
    """The rows whose sample is kept and constrained; their masks follow the batch (the
    controller sends them once the steps before are back: controller.send_due_masks)."""
    constrained = [
        b for b, row in enumerate(rows) if row.samples and row.request.grammar is not None
    ]
    return GrammarRows(rows=_i32(constrained)) if constrained else None


def _decode_slots(rows: list[ScheduledRow], num_steps: int) -> Array | None:
    """[N-1, B]: the slot of each row's position in decode iterations 1..N-1 (every row of
    a multi-step batch decodes, from its pending token at row.start)."""
    if num_steps == 1:
        return None
    slots = [row.request.slots[row.start + i] for i in range(1, num_steps) for row in rows]
    return pack_list(slots, "int32", (num_steps - 1, len(rows)))


def _uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def _penalties(rows: list[ScheduledRow]) -> PenaltyBatch | None:
    """A row restarts on its first step after an admission: a prefill from position 0, or
    from a cached prefix whose slots fill the table (and whose tokens the worker then gets as
    history). NOTE: a table fill of a row past its prefill (the tree kept its own copy of
    some slots) is not a restart."""
    params = [row.request.message.sampling for row in rows]
    if not any(_uses_penalties(p) for p in params):
        return None
    restart = [
        _uses_penalties(p) and row.is_prefill and (row.start == 0 or row.request.fill_table)
        for row, p in zip(rows, params, strict=True)
    ]
    history = [
        row.request.tokens(0, row.start) if r else [] for row, r in zip(rows, restart, strict=True)
    ]
    return PenaltyBatch(
        presence=_f32([p.presence_penalty for p in params]),
        frequency=_f32([p.frequency_penalty for p in params]),
        repetition=_f32([p.repetition_penalty for p in params]),
        num_prompt_tokens=_i32([row.request.num_prompt_tokens for row in rows]),
        restart=pack_list(restart, "bool"),
        history_offsets=_offsets(history),
        history_ids=_i32([t for h in history for t in h]),
    )


def _logit_bias(params: list[SamplingParams]) -> LogitBias | None:
    if not any(p.logit_bias for p in params):
        return None
    return LogitBias(
        offsets=_offsets([p.logit_bias for p in params]),
        ids=_i32([i for p in params for i, _ in p.logit_bias]),
        values=_f32([v for p in params for _, v in p.logit_bias]),
    )


def _stop_ban(rows: list[ScheduledRow]) -> StopBan | None:
    """Decode iterations whose sample must not end the request: output index
    row.num_outputs + i is banned from stop ids while it is below min_tokens."""
    params = [row.request.message.sampling for row in rows]
    steps = [
        max(0, p.min_tokens - row.num_outputs) if row.samples else 0
        for row, p in zip(rows, params, strict=True)
    ]
    if not any(steps):
        return None
    ids = [p.stop_token_ids if n else () for p, n in zip(params, steps, strict=True)]
    return StopBan(
        num_steps=_i32(steps),
        ban_eos=pack_list([not p.ignore_eos for p in params], "bool"),
        offsets=_offsets(ids),
        ids=_i32([t for i in ids for t in i]),
    )


def _offsets(lists: list) -> Array:
    return _i32(accumulate((len(x) for x in lists), initial=0))


def _prompt_start(row: ScheduledRow) -> int:
    request = row.request
    if not request.wants_prompt_scores or row.start >= request.num_prompt_tokens:
        return -1
    return request.message.logprobs.prompt_start


def _prompt_next_id(row: ScheduledRow) -> int:
    request = row.request
    return request.token_at(row.end) if row.end < request.num_prompt_tokens else -1


_NONE = pack_list([], "int32")  # NOTE: made once: most steps fill no table row


def _i32(values: Iterable[int]) -> Array:
    return pack_list(values, "int32")


def _f32(values: Iterable[float]) -> Array:
    return pack_list(values, "float32")
