"""Logit changes before sampling, batched on the device (tp_worker): the min_tokens stop ban,
`logit_bias`, and presence / frequency / repetition penalties, applied in that order (vLLM's).

Penalties need each request's history. The worker keeps it per row of its request->slot
table: `output_counts` (how often each token was generated) and `in_prompt` (which tokens the
prompt holds), both counted from the tokens the model is fed: the prompt, chunk by chunk, and
each generated token the step (or multi-step iteration) after it is sampled. A row that
restarts (its request's first step after an admission) forgets what it counted, then counts
the cached prefix the controller sends as history. Rows that use no penalty are not touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.protocol.arrays import unpack
from tokenmill.protocol.step import ForwardBatch, LogitBias, PenaltyBatch, StopBan
from tokenmill.tp_worker.grammar_mask import GrammarTensors


def _to(values: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(values)).to(device=device, dtype=dtype)


def row_of_each(offsets: np.ndarray) -> np.ndarray:
    """[B+1] offsets -> [L] int64 the row each element belongs to: [0, 2, 2, 5] ->
    [0, 0, 2, 2, 2]."""
    if offsets[-1] == 0:
        return np.zeros(0, np.int64)  # NOTE: most steps; no numpy calls below
    counts = offsets[1:].astype(np.int64) - offsets[:-1]
    return np.repeat(np.arange(len(offsets) - 1), counts)


@dataclass(frozen=True)
class StopBanTensors:
    num_steps: np.ndarray  # [B] int64 (host): iterations whose sample bans the row's stop ids
    rows: torch.Tensor  # [S] int64 batch row of each stop id
    ids: torch.Tensor  # [S] int64
    row_steps: torch.Tensor  # [S] int64 num_steps of each element's row
    eos_rows: torch.Tensor  # [E] int64 batch rows that also ban the model's eos ids
    eos_steps: torch.Tensor  # [E] int64

    @staticmethod
    def from_message(ban: StopBan, device: torch.device) -> StopBanTensors:
        steps = unpack(ban.num_steps).astype(np.int64)
        rows = row_of_each(unpack(ban.offsets))
        eos_rows = np.flatnonzero(unpack(ban.ban_eos) & (steps > 0))
        return StopBanTensors(
            num_steps=steps,
            rows=_to(rows, device, torch.int64),
            ids=_to(unpack(ban.ids), device, torch.int64),
            row_steps=_to(steps[rows], device, torch.int64),
            eos_rows=_to(eos_rows, device, torch.int64),
            eos_steps=_to(steps[eos_rows], device, torch.int64),
        )


@dataclass(frozen=True)
class BiasTensors:
    rows: torch.Tensor  # [L] int64 batch row of each biased id
    ids: torch.Tensor  # [L] int64
    values: torch.Tensor  # [L] float32

    @staticmethod
    def from_message(bias: LogitBias, device: torch.device) -> BiasTensors:
        return BiasTensors(
            rows=_to(row_of_each(unpack(bias.offsets)), device, torch.int64),
            ids=_to(unpack(bias.ids), device, torch.int64),
            values=_to(unpack(bias.values), device, torch.float32),
        )


@dataclass(frozen=True)
class PenaltyTensors:
    rows: torch.Tensor  # [Bp] int64 batch rows that use a penalty
    table_rows: torch.Tensor  # [Bp] int64 their rows of the request->slot table
    presence: torch.Tensor  # [Bp, 1] float32
    frequency: torch.Tensor  # [Bp, 1] float32
    repetition: torch.Tensor  # [Bp, 1] float32
    restart_rows: torch.Tensor  # [Br] int64 table rows that forget what they counted
    generated: tuple[torch.Tensor, torch.Tensor]  # ([G] table row, [G] id) generated tokens fed
    prompt: tuple[torch.Tensor, torch.Tensor]  # ([Q] table row, [Q] id) prompt tokens fed

    @staticmethod
    def from_message(p: PenaltyBatch, batch: ForwardBatch, device: torch.device) -> PenaltyTensors:
        """Sorts the tokens this step feeds (history first) into prompt and generated ones,
        on the host, where positions are known: no device sync."""
        table = unpack(batch.req_rows).astype(np.int64)
        presence, frequency = unpack(p.presence), unpack(p.frequency)
        repetition = unpack(p.repetition)
        used = (presence != 0) | (frequency != 0) | (repetition != 1)  # [B] bool
        rows = np.flatnonzero(used)
        row, pos, ids = _fed_tokens(p, batch)
        keep = used[row]
        row, pos, ids = row[keep], pos[keep], ids[keep]
        gen = pos >= unpack(p.num_prompt_tokens)[row]

        def index(r: np.ndarray, i: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            return _to(table[r], device, torch.int64), _to(i, device, torch.int64)

        return PenaltyTensors(
            rows=_to(rows, device, torch.int64),
            table_rows=_to(table[rows], device, torch.int64),
            presence=_to(presence[rows, None], device, torch.float32),
            frequency=_to(frequency[rows, None], device, torch.float32),
            repetition=_to(repetition[rows, None], device, torch.float32),
            restart_rows=_to(table[np.flatnonzero(unpack(p.restart) & used)], device, torch.int64),
            generated=index(row[gen], ids[gen]),
            prompt=index(row[~gen], ids[~gen]),
        )


def _fed_tokens(p: PenaltyBatch, batch: ForwardBatch) -> tuple[np.ndarray, ...]:
    """([N] batch row, [N] position, [N] id) of the history and the step's input tokens."""
    extend = unpack(batch.extend_lens).astype(np.int64)
    prefix = unpack(batch.prefix_lens).astype(np.int64)
    hist_offsets = unpack(p.history_offsets)
    hist_row = row_of_each(hist_offsets)
    hist_pos = np.arange(len(hist_row)) - hist_offsets[hist_row]
    fed_row = np.repeat(np.arange(len(extend)), extend)
    fed_pos = np.arange(len(fed_row)) - np.repeat(np.cumsum(extend) - extend, extend)
    row = np.concatenate([hist_row, fed_row])
    pos = np.concatenate([hist_pos, fed_pos + prefix[fed_row]])
    ids = np.concatenate([unpack(p.history_ids), unpack(batch.input_ids)]).astype(np.int64)
    return row, pos, ids


@dataclass(frozen=True)
class LogitAdjustments:
    """What a step changes in the logits; None where no row of the batch asks."""

    stop_ban: StopBanTensors | None = None
    logit_bias: BiasTensors | None = None
    penalties: PenaltyTensors | None = None
    grammar: GrammarTensors | None = None  # NOTE: a constrained batch runs one iteration

    @staticmethod
    def from_batch(batch: ForwardBatch, device: torch.device) -> LogitAdjustments:
        s = batch.sampling
        ban, bias, penalties = s.stop_ban, s.logit_bias, s.penalties
        return LogitAdjustments(
            stop_ban=None if ban is None else StopBanTensors.from_message(ban, device),
            logit_bias=None if bias is None else BiasTensors.from_message(bias, device),
            penalties=None
            if penalties is None
            else PenaltyTensors.from_message(penalties, batch, device),
            grammar=None if s.grammar is None else GrammarTensors(s.grammar, device),
        )

    def active(self, iteration: int) -> bool:
        ban = self.stop_ban is not None and bool((self.stop_ban.num_steps > iteration).any())
        grammar = self.grammar is not None and iteration == 0
        return ban or grammar or self.logit_bias is not None or self.penalties is not None


class LogitAdjuster:
    """The per-table-row history on the device, and the step's logit changes."""

    def __init__(
        self, num_rows: int, vocab: int, eos_ids: tuple[int, ...], device: torch.device
    ) -> None:
        self.output_counts = torch.zeros(num_rows, vocab, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.int64, device=device)  # [Ne]

    def begin(self, adjust: LogitAdjustments) -> None:
        """A step's first iteration: restart rows, then count the tokens the step feeds."""
        p = adjust.penalties
        if p is None:
            return
        if p.restart_rows.numel():
            self.output_counts[p.restart_rows] = 0
            self.in_prompt[p.restart_rows] = False
        ones = torch.ones_like(p.generated[1], dtype=torch.int32)
        self.output_counts.index_put_(p.generated, ones, accumulate=True)
        self.in_prompt[p.prompt] = True

    def count_sampled(self, adjust: LogitAdjustments, sampled: torch.Tensor) -> None:
        """A multi-step iteration feeds each row the token it sampled last (`sampled` [B])."""
        p = adjust.penalties
        if p is None:
            return
        ids = sampled[p.rows]  # [Bp]
        ones = torch.ones_like(ids, dtype=torch.int32)
        self.output_counts.index_put_((p.table_rows, ids), ones, accumulate=True)

    def adjust(
        self,
        logits: torch.Tensor,
        adjust: LogitAdjustments,
        iteration: int,
        bitmask: np.ndarray | None = None,
        keep_raw: bool = True,
    ) -> torch.Tensor:
        """logits [B, V] float32 -> the logits sampled from; the input itself when nothing
        applies, else changed: in a copy where `keep_raw` (raw logprobs read the logits as
        computed), else in place (a [64, 49152] copy and its indexing cost several ms a step
        here). bitmask [G, W]: the grammar rows' allowed ids, applied last
        (adjust.grammar says which rows)."""
        if not adjust.active(iteration):
            return logits
        if keep_raw:
            logits = logits.clone()
        if adjust.stop_ban is not None:
            self._ban(logits, adjust.stop_ban, iteration)
        if adjust.logit_bias is not None:
            b = adjust.logit_bias
            logits.index_put_((b.rows, b.ids), b.values, accumulate=True)
        if adjust.penalties is not None:
            self._penalise(logits, adjust.penalties)
        if adjust.grammar is not None and iteration == 0:
            assert bitmask is not None, "a constrained batch's mask must be known by now"
            adjust.grammar.apply(logits, bitmask, may_empty=adjust.stop_ban is not None)
        return logits

    def _ban(self, logits: torch.Tensor, ban: StopBanTensors, iteration: int) -> None:
        rows = torch.cat([ban.rows, ban.eos_rows.repeat_interleave(len(self.eos_ids))])
        ids = torch.cat([ban.ids, self.eos_ids.repeat(len(ban.eos_rows))])
        steps = torch.cat([ban.row_steps, ban.eos_steps.repeat_interleave(len(self.eos_ids))])
        current = logits[rows, ids]  # [S + E * Ne]
        logits[rows, ids] = torch.where(steps > iteration, float("-inf"), current)

    def _penalise(self, logits: torch.Tensor, p: PenaltyTensors) -> None:
        """vLLM's order: repetition (prompt + output), then frequency and presence (output)."""
        sub = logits[p.rows]  # [Bp, V] float32
        counts = self.output_counts[p.table_rows]  # [Bp, V] int32
        generated = counts > 0  # [Bp, V] bool
        seen = generated | self.in_prompt[p.table_rows]
        repeated = torch.where(sub > 0, sub / p.repetition, sub * p.repetition)
        sub = torch.where(seen, repeated, sub)
        sub = sub - p.frequency * counts - p.presence * generated
        logits[p.rows] = sub
