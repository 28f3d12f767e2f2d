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

from dataclasses import dataclass, replace

import numpy as np
import torch

from tokenmill.protocol.arrays import unpack
from tokenmill.protocol.step import ForwardBatch, LogitBias, PenaltyBatch, StopBan
from tokenmill.tp_worker.sample.grammar_mask import GrammarTensors
from tokenmill.tp_worker.upload import Upload


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
    def from_message(ban: StopBan, up: Upload) -> StopBanTensors:
        steps = unpack(ban.num_steps).astype(np.int64)
        rows = row_of_each(unpack(ban.offsets))
        eos_rows = np.flatnonzero(unpack(ban.ban_eos) & (steps > 0))
        return StopBanTensors(
            num_steps=steps,
            rows=up.cast(rows, torch.int64),
            ids=up.cast(unpack(ban.ids), torch.int64),
            row_steps=up.cast(steps[rows], torch.int64),
            eos_rows=up.cast(eos_rows, torch.int64),
            eos_steps=up.cast(steps[eos_rows], torch.int64),
        )


@dataclass(frozen=True)
class BiasTensors:
    rows: torch.Tensor  # [L] int64 batch row of each biased id
    ids: torch.Tensor  # [L] int64
    values: torch.Tensor  # [L] float32

    @staticmethod
    def from_message(bias: LogitBias, up: Upload) -> BiasTensors:
        return BiasTensors(
            rows=up.cast(row_of_each(unpack(bias.offsets)), torch.int64),
            ids=up.cast(unpack(bias.ids), torch.int64),
            values=up.cast(unpack(bias.values), torch.float32),
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
    # Verifying drafts: ([D] table row, [D] id) of each draft, counted from the iteration
    # that samples after it on; [D] host int64 that iteration (1 = the row's first draft) and
    # batch row. None: no drafts.
    drafts: tuple[torch.Tensor, torch.Tensor] | None = None
    draft_steps: np.ndarray | None = None
    draft_rows: np.ndarray | None = None
    draft_at: np.ndarray | None = None  # [D] host int64 index in the step's [T] tokens

    def with_draft_ids(self, ids: np.ndarray) -> PenaltyTensors:
        """The same, counting the drafts in `ids` [T] (a draft model's, written into the
        placeholders the batch came with)."""
        if self.drafts is None or self.draft_at is None:
            return self
        drafts = (self.drafts[0], _to(ids[self.draft_at], self.drafts[1].device, torch.int64))
        return replace(self, drafts=drafts)

    @staticmethod
    def from_message(p: PenaltyBatch, batch: ForwardBatch, up: Upload) -> PenaltyTensors:
        """Sorts the tokens this step feeds (history first) into prompt and generated ones,
        on the host, where positions are known: no device sync."""
        table = unpack(batch.req_rows).astype(np.int64)
        presence, frequency = unpack(p.presence), unpack(p.frequency)
        repetition = unpack(p.repetition)
        used = (presence != 0) | (frequency != 0) | (repetition != 1)  # [B] bool
        rows = np.flatnonzero(used)
        row, pos, ids, step = _fed_tokens(p, batch)
        at = np.arange(len(row)) - (len(row) - len(unpack(batch.input_ids)))  # [T] index
        keep = used[row]
        row, pos, ids, step, at = row[keep], pos[keep], ids[keep], step[keep], at[keep]
        gen = pos >= unpack(p.num_prompt_tokens)[row]

        def index(r: np.ndarray, i: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            return up.cast(table[r], torch.int64), up.cast(i, torch.int64)

        draft = step > 0
        gen &= ~draft

        return PenaltyTensors(
            rows=up.cast(rows, torch.int64),
            table_rows=up.cast(table[rows], torch.int64),
            presence=up.cast(presence[rows, None], torch.float32),
            frequency=up.cast(frequency[rows, None], torch.float32),
            repetition=up.cast(repetition[rows, None], torch.float32),
            restart_rows=up.cast(table[np.flatnonzero(unpack(p.restart) & used)], torch.int64),
            generated=index(row[gen], ids[gen]),
            prompt=index(row[~gen & ~draft], ids[~gen & ~draft]),
            drafts=index(row[draft], ids[draft]) if draft.any() else None,
            draft_steps=step[draft] if draft.any() else None,
            draft_rows=row[draft] if draft.any() else None,
            draft_at=at[draft] if draft.any() else None,
        )


def _fed_tokens(p: PenaltyBatch, batch: ForwardBatch) -> tuple[np.ndarray, ...]:
    """([N] batch row, [N] position, [N] id, [N] draft iteration) of the history and the
    step's input tokens; the iteration is 0 except for drafts (ForwardBatch.num_drafts):
    1 for a row's first, which the sample after it may see, 2 for the next, and so on."""
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
    step = np.zeros(len(row), np.int64)
    if batch.num_drafts is not None:
        drafts = unpack(batch.num_drafts).astype(np.int64)[fed_row]
        step[len(hist_row) :] = np.maximum(0, fed_pos - (extend[fed_row] - drafts) + 1)
    return row, pos, ids, step


@dataclass(frozen=True)
class LogitAdjustments:
    """What a step changes in the logits; None where no row of the batch asks."""

    stop_ban: StopBanTensors | None = None
    logit_bias: BiasTensors | None = None
    penalties: PenaltyTensors | None = None
    grammar: GrammarTensors | None = None  # NOTE: a constrained batch runs one iteration

    @staticmethod
    def from_batch(batch: ForwardBatch, up: Upload) -> LogitAdjustments:
        """NOTE: the grammar's rows and masks copy on their own (the masks may come after the
        batch, once the forward pass is done)."""
        s = batch.sampling
        ban, bias, penalties = s.stop_ban, s.logit_bias, s.penalties
        return LogitAdjustments(
            stop_ban=None if ban is None else StopBanTensors.from_message(ban, up),
            logit_bias=None if bias is None else BiasTensors.from_message(bias, up),
            penalties=None
            if penalties is None
            else PenaltyTensors.from_message(penalties, batch, up),
            grammar=None
            if s.grammar is None
            else GrammarTensors(s.grammar, up.device, batch.num_drafts is not None),
        )

    def active(self, iteration: int) -> bool:
        """Whether iteration `iteration` changes a logit. NOTE: a grammar constrains the first
        iteration of a step, and each of a verifying step (a row's drafts go through its
        grammar, which gives a mask for each position)."""
        ban = self.stop_ban is not None and bool((self.stop_ban.num_steps > iteration).any())
        grammar = self.grammar is not None and (iteration == 0 or self.grammar.per_iteration)
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

    def count_drafts(self, adjust: LogitAdjustments, iteration: int) -> None:
        """A verifying step's iteration `iteration` samples after each row's first
        `iteration` drafts: the drafts numbered `iteration` join the counts."""
        p = adjust.penalties
        if p is None or p.drafts is None:
            return
        assert p.draft_steps is not None
        self._count_drafts(p, np.equal(p.draft_steps, iteration), 1)

    def uncount_rejected(self, adjust: LogitAdjustments, accepted: np.ndarray) -> None:
        """accepted [B]: the drafts each row kept; the others leave the counts (the next
        step feeds the row's tokens from its last kept one)."""
        p = adjust.penalties
        if p is None or p.drafts is None:
            return
        self._count_drafts(p, p.draft_steps > accepted[p.draft_rows], -1)

    def _count_drafts(self, p: PenaltyTensors, which: np.ndarray, sign: int) -> None:
        assert p.drafts is not None
        if not which.any():
            return
        index = torch.from_numpy(np.flatnonzero(which)).to(p.drafts[0].device)
        rows, ids = p.drafts[0][index], p.drafts[1][index]
        values = torch.full_like(ids, sign, dtype=torch.int32)
        self.output_counts.index_put_((rows, ids), values, accumulate=True)

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
        if adjust.grammar is not None and (iteration == 0 or adjust.grammar.per_iteration):
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
