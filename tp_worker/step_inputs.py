"""A ForwardBatch decoded into device tensors, with the indices every step derives (tp_worker).

Positions, row starts, and which hidden states score which prompt tokens are computed here
once, so the model runner's step reads as a short sequence of calls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import torch

from tokenmill.protocol.arrays import Array, unpack
from tokenmill.protocol.step import ForwardBatch, SamplingBatch
from tokenmill.tp_worker.sample.penalties import LogitAdjustments, row_of_each
from tokenmill.tp_worker.sample.sampling import Filters, SamplingTensors
from tokenmill.tp_worker.upload import Upload, empty


def _tensor(array: Array, up: Upload, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """One copy out of the message's bytes (which are read-only), already in `dtype`."""
    if 0 in array.shape:  # NOTE: a decode step has ~10 empty inputs: not even unpacked
        return empty(array.shape, dtype, up.device)
    return up.cast(unpack(array), dtype)


@dataclass(frozen=True)
class LastLayerRows:
    """The tokens whose final hidden state a step reads: each row's last token and the prompt
    positions it scores, a suffix of each row's new tokens. Past its KV write, the last layer
    computes these alone (a row's numbers do not depend on the rows beside it)."""

    index: torch.Tensor  # [K] int64 token index in [T] of each kept token
    first_pos: torch.Tensor  # [B] int64 position of each row's first kept token
    counts: torch.Tensor  # [B] int64 kept tokens per row
    starts: torch.Tensor  # [B] int64 index in [K] of each row's first kept token
    prompt_index: torch.Tensor  # [P] int64 index in [K] of each prompt-scoring state
    last_index: torch.Tensor  # [L] int64 index in [K] of each token whose logits are read

    @staticmethod
    def plan(
        extend_lens: np.ndarray,
        token_starts: np.ndarray,
        prefix_lens: np.ndarray,
        keep_from: np.ndarray,
        prompt_hidden_index: np.ndarray,
        up: Upload,
        logit_lens: np.ndarray | None = None,
    ) -> LastLayerRows | None:
        """token_starts [B]: each row's first new token in [T]; keep_from [B]: its first kept
        one, counted from there; logit_lens [B]: how many of its last tokens give logits
        (None: one). None when every token is kept (a decode step)."""
        counts = extend_lens - keep_from
        if counts.sum() == extend_lens.sum():
            return None
        starts = np.cumsum(counts) - counts
        index = runs(token_starts + keep_from, counts)
        kept_at = np.full(int(extend_lens.sum()), -1, np.int64)
        kept_at[index] = np.arange(len(index))
        prompt_index = kept_at[prompt_hidden_index]
        assert (prompt_index >= 0).all(), "a prompt-scoring state outside the kept tokens"

        return LastLayerRows(
            up(index),
            up(prefix_lens + keep_from),
            up(counts),
            up(starts),
            up(prompt_index),
            up(suffix_index(starts, counts, logit_lens)),
        )


def suffix_index(starts: np.ndarray, counts: np.ndarray, lens: np.ndarray | None) -> np.ndarray:
    """[L] int64: the indices of each row's last lens[b] tokens (None: its last one), of
    rows that start at starts[b] with counts[b] tokens."""
    if lens is None:
        return (starts + counts - 1).astype(np.int64)
    return runs(starts + counts - lens, lens)


def runs(firsts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """[sum(lens)] int64: lens[b] consecutive integers from firsts[b], row after row:
    runs([5, 0], [2, 3]) -> [5, 6, 0, 1, 2]."""
    if not len(lens):
        return np.zeros(0, np.int64)  # NOTE: most steps' table fills; no numpy calls below
    offsets = np.cumsum(lens) - lens
    return (np.repeat(firsts - offsets, lens) + np.arange(int(lens.sum()))).astype(np.int64)


@dataclass(frozen=True)
class VerifyPlan:
    """A step that verifies drafts (ForwardBatch.num_drafts): which logits each of its N
    sampling iterations reads, the drafts those samples are compared with, and where."""

    num_drafts: np.ndarray  # [B] int64
    logit_rows: torch.Tensor  # [N, B] int64 row of [L] logits each iteration samples from
    draft_ids: np.ndarray  # [N - 1, B] int64 the draft after iteration i's sample; -1 none
    draft_at: np.ndarray  # [N - 1, B] int64 index in [T] of that draft; -1 none
    # [N, B] int64 position of the token whose logits iteration i reads (its sample is the
    # token at the position after, which keys a sampled row's noise)
    read_pos: torch.Tensor

    @property
    def num_iterations(self) -> int:
        return self.logit_rows.shape[0]

    @staticmethod
    def plan(
        num_drafts: np.ndarray,
        starts: np.ndarray,
        prefix: np.ndarray,
        extend: np.ndarray,
        ids: np.ndarray,
        up: Upload,
    ) -> VerifyPlan:
        """ids [T]: the step's input tokens; a row's drafts are its last num_drafts[b]."""
        lens = num_drafts + 1
        offsets = np.cumsum(lens) - lens
        steps = np.arange(int(num_drafts.max()) + 1)[:, None]  # [N, 1]
        reached = np.minimum(steps, num_drafts[None, :])  # [N, B]
        first = starts + extend - num_drafts  # [B] index in [T] of each row's first draft
        has = steps[:-1] < num_drafts[None, :]
        draft_at = np.where(has, first[None, :] + steps[:-1], -1)  # [N - 1, B]
        read_pos = (prefix + extend - lens)[None, :] + reached
        return VerifyPlan(
            num_drafts,
            up(offsets[None, :] + reached),
            _draft_ids(ids, draft_at),
            draft_at,
            up(read_pos),
        )

    def with_ids(self, ids: np.ndarray) -> VerifyPlan:
        """The plan for the step's tokens `ids` [T], whose drafts a draft model wrote."""
        return replace(self, draft_ids=_draft_ids(ids, self.draft_at))

    def accepted(self, next_ids: np.ndarray) -> np.ndarray:
        """next_ids [N, B] sampled -> [B] int32 drafts kept: each row's leading run of drafts
        that equal its sample at their position."""
        if self.num_iterations == 1:
            return np.zeros(next_ids.shape[1], np.int32)
        agree = next_ids[:-1] == self.draft_ids  # NOTE: -1 (no draft) never agrees
        return np.cumprod(agree, axis=0).sum(axis=0).astype(np.int32)


def _sampling(s: SamplingBatch, temperature: np.ndarray, up: Upload) -> SamplingTensors:
    """The rows' sampling parameters on the device, with what the host already knows: which
    rows draw noise and which filters they use (each a sync on a GPU, asked of the device)."""
    top_k, top_p, min_p = unpack(s.top_k), unpack(s.top_p), unpack(s.min_p)
    random = np.flatnonzero(temperature > 0)
    return SamplingTensors(
        temperature=up(temperature),
        top_k=_tensor(s.top_k, up),
        top_p=_tensor(s.top_p, up, torch.float32),
        min_p=_tensor(s.min_p, up, torch.float32),
        seed=_tensor(s.seed, up),
        random_rows=up(random),
        random_filters=Filters.of(top_k[random], top_p[random], min_p[random]),
    )


def _draft_ids(ids: np.ndarray, draft_at: np.ndarray) -> np.ndarray:
    return np.where(draft_at >= 0, ids[np.maximum(draft_at, 0)], -1)


@dataclass(frozen=True)
class HostRows:
    """A step's rows as host arrays ([B] int64 each), kept beside their device copies: a
    backend that plans on the host (the Triton attention's tiles) then needs no copy back,
    which on a GPU is a sync."""

    req_rows: np.ndarray
    prefix_lens: np.ndarray
    extend_lens: np.ndarray

    @cached_property
    def tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """[T] each new token's table row and its position."""
        return np.repeat(self.req_rows, self.extend_lens), runs(self.prefix_lens, self.extend_lens)

    def next_decode(self) -> HostRows:
        """The rows one token further on (a multi-step run's next iteration)."""
        ones = np.ones_like(self.extend_lens)
        return HostRows(self.req_rows, self.prefix_lens + self.extend_lens, ones)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64
    req_rows: torch.Tensor  # [B] int64
    token_rows: torch.Tensor  # [T] int64 table row of each new token
    prefix_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64
    is_prefill: torch.Tensor  # [B] bool
    starts: torch.Tensor  # [B] int64 index of each row's first token in [T]
    # NOTE: [L] int64 index in [T] of each token whose logits are read: each row's last (and,
    # verifying drafts, the 1 + num_drafts[b] last); None where that is all of [T] (a decode
    # step: T == L says so, since no row comes with none).
    last_index: torch.Tensor | None
    # NOTE: the table cells a step fills (a prefix-cache hit's slots): each slot's row and
    # column, laid out on the host (on the device, a ragged arange's length is a sync)
    fill_rows: torch.Tensor  # [S] int64
    fill_cols: torch.Tensor  # [S] int64
    fill_slots: torch.Tensor  # [S] int32
    sampling: SamplingTensors
    adjust: LogitAdjustments  # stop ban, logit bias, penalties (before temperature)
    top_rows: torch.Tensor  # [R] int64 rows with num_top > 0
    max_top: int
    token_id_rows: torch.Tensor  # [M] int64 row of each caller-given id
    token_ids: torch.Tensor  # [M] int64
    prompt_rows: torch.Tensor  # [Pr] int64 rows scoring prompt positions
    prompt_hidden_index: torch.Tensor  # [P] int64 token index in [T] of each scoring state
    prompt_targets: torch.Tensor  # [P] int64 token each of those states predicts
    prompt_offsets: np.ndarray  # [B + 1] int32 each row's first scored prompt position in [P]
    prompt_num_top: int
    sampled_logprobs: bool  # some row reads its sampled tokens' logprobs
    # [Q] int64 rows whose sampled logprobs are processed (LogprobAsks.processed); None: none
    processed_rows: torch.Tensor | None
    decode_slots: torch.Tensor | None  # [N-1, B] int64
    last_layer: LastLayerRows | None  # None: every token's final hidden state is kept
    verify: VerifyPlan | None = None  # None: no row has drafts
    host: HostRows | None = None  # None: the rows are on the device only
    # NOTE: each row's and each new token's adapter slot (ForwardBatch.lora_slots); None:
    # no row has one
    lora_row_slots: np.ndarray | None = None  # [B] int32
    lora_token_slots: np.ndarray | None = None  # [T] int32

    @staticmethod
    def from_batch(batch: ForwardBatch, up: Upload) -> StepInputs:
        extend_np = unpack(batch.extend_lens).astype(np.int64)
        prefix_np = unpack(batch.prefix_lens).astype(np.int64)
        starts_np = np.cumsum(extend_np) - extend_np
        req_rows = unpack(batch.req_rows).astype(np.int64)
        host = HostRows(req_rows, prefix_np, extend_np)
        token_rows, positions = host.tokens
        fill_rows = unpack(batch.fill_rows).astype(np.int64)
        fill_lens = unpack(batch.fill_lens).astype(np.int64)
        num_top = unpack(batch.logprobs.num_top)
        prompt = _prompt_plan(batch, extend_np, prefix_np, starts_np)
        s = batch.sampling
        temperature = unpack(s.temperature).astype(np.float32)
        verify, logit_lens = None, None
        if batch.num_drafts is not None:
            drafts = unpack(batch.num_drafts).astype(np.int64)
            logit_lens = drafts + 1
            prompt.keep_from[:] = np.minimum(prompt.keep_from, extend_np - logit_lens)
            ids = unpack(batch.input_ids).astype(np.int64)
            verify = VerifyPlan.plan(drafts, starts_np, prefix_np, extend_np, ids, up)
        logit_index = suffix_index(starts_np, extend_np, logit_lens)
        lora = None if batch.lora_slots is None else unpack(batch.lora_slots).astype(np.int32)
        return StepInputs(
            input_ids=_tensor(batch.input_ids, up),
            positions=up(positions),
            out_slots=_tensor(batch.out_slots, up),
            req_rows=up(req_rows),
            token_rows=up(token_rows),
            prefix_lens=up(prefix_np),
            extend_lens=up(extend_np),
            is_prefill=_tensor(batch.is_prefill, up, torch.bool),
            starts=up(starts_np),
            last_index=None if len(positions) == len(logit_index) else up(logit_index),
            fill_rows=up(np.repeat(fill_rows, fill_lens)),
            fill_cols=up(runs(np.zeros_like(fill_lens), fill_lens)),
            fill_slots=_tensor(batch.fill_slots, up, torch.int32),
            sampling=_sampling(s, temperature, up),
            adjust=LogitAdjustments.from_batch(batch, up),
            top_rows=up(np.flatnonzero(num_top > 0)),
            max_top=int(num_top.max()) if len(num_top) else 0,
            token_id_rows=up(row_of_each(unpack(batch.logprobs.token_ids_offsets))),
            token_ids=_tensor(batch.logprobs.token_ids, up),
            prompt_rows=up(prompt.rows),
            prompt_hidden_index=up(prompt.hidden_index),
            prompt_targets=up(prompt.targets),
            prompt_offsets=prompt.offsets,
            prompt_num_top=prompt.num_top,
            sampled_logprobs=batch.logprobs.sampled,
            processed_rows=None
            if batch.logprobs.processed is None
            else up(np.flatnonzero(unpack(batch.logprobs.processed))),
            decode_slots=None if batch.decode_slots is None else _tensor(batch.decode_slots, up),
            last_layer=LastLayerRows.plan(
                extend_np,
                starts_np,
                prefix_np,
                prompt.keep_from,
                prompt.hidden_index,
                up,
                logit_lens,
            ),
            verify=verify,
            host=host,
            lora_row_slots=lora,
            lora_token_slots=None if lora is None else np.repeat(lora, extend_np),
        )

    def next_tokens(self, batch: ForwardBatch, up: Upload) -> StepInputs:
        """The inputs of `batch`, which decodes these inputs' rows again with the same asks
        (StepInputsBuilder checked it): its tokens, their positions and slots; the rest as
        here."""
        # NOTE: one new token a row: each token's position is its row's prefix length.
        prefix_np = unpack(batch.prefix_lens).astype(np.int64)
        prefix = up(prefix_np)
        host = self.host
        return replace(
            self,
            input_ids=_tensor(batch.input_ids, up),
            positions=prefix,
            out_slots=_tensor(batch.out_slots, up),
            prefix_lens=prefix,
            decode_slots=None if batch.decode_slots is None else _tensor(batch.decode_slots, up),
            host=None if host is None else replace(host, prefix_lens=prefix_np),
        )

    def verify_iteration(self, step: int) -> StepInputs:
        """The inputs a verifying step samples with at iteration `step`: each row as if its
        new tokens ended at its draft before that position (the position, which keys a
        sampled row's noise, is the one plain decoding samples there)."""
        assert self.verify is not None
        read_pos = self.verify.read_pos[step]
        ones = torch.ones_like(read_pos)
        return replace(self, prefix_lens=read_pos, extend_lens=ones, host=None)

    def next_decode_step(self, step: int, sampled: torch.Tensor) -> StepInputs:
        """Inputs of decode iteration `step` (>= 1) of a multi-step run: every row extends by
        the token it sampled last (`sampled` [B]), written to decode_slots[step - 1]."""
        assert self.decode_slots is not None, "num_steps > 1 needs decode_slots"
        seq_lens = self.prefix_lens + self.extend_lens
        ones = torch.ones_like(self.extend_lens)
        return replace(
            self,
            positions=seq_lens,
            token_rows=self.req_rows,
            out_slots=self.decode_slots[step - 1],
            prefix_lens=seq_lens,
            extend_lens=ones,
            is_prefill=torch.zeros_like(self.is_prefill),
            starts=torch.arange(len(ones), device=ones.device),
            last_index=None,
            input_ids=sampled,
            last_layer=None,
            host=None if self.host is None else self.host.next_decode(),
            lora_token_slots=self.lora_row_slots,
        )


class StepInputsBuilder:
    """StepInputs for each batch. A batch that decodes the same table rows with the same asks
    as the batch before (most steps: the controller's BatchBuilder then sends the same bytes
    for them) keeps that batch's row inputs (sampling, logprob asks, logit bias, row indices)
    and builds only its tokens, positions and slots: the worker's half of a persistent batch.
    Found by comparing the messages, so anything else (a row joining or leaving, a prompt
    chunk, a table fill, a stop ban or penalties, which change every step) takes the whole
    path."""

    def __init__(self, device: torch.device, staged: bool | None = None) -> None:
        """staged: the arrays through one copy (upload.py; None: on a GPU, not on the CPU)."""
        self.device = device
        self.staged = staged
        self._last: tuple[ForwardBatch, StepInputs] | None = None  # a batch whose rows decode

    def build(self, batch: ForwardBatch) -> StepInputs:
        up = Upload(self.device, self.staged)
        last = self._last
        if last is not None and _same_rows(batch, last[0]):
            inputs = last[1].next_tokens(batch, up)
        else:
            inputs = StepInputs.from_batch(batch, up)
        up.flush()
        self._last = (batch, inputs) if _rows_persist(batch, inputs) else None
        return inputs


def _rows_persist(batch: ForwardBatch, inputs: StepInputs) -> bool:
    """Every row decodes one token and asks nothing that changes from step to step."""
    s = batch.sampling
    return (
        batch.input_ids.shape == batch.req_rows.shape
        and batch.num_drafts is None
        and not batch.fill_rows.shape[0]
        and s.stop_ban is None
        and s.penalties is None
        and (s.grammar is None or s.grammar.bitmask is None)
        and b"\x01" not in batch.is_prefill.data
        and not len(inputs.prompt_rows)
    )


def _same_rows(batch: ForwardBatch, last: ForwardBatch) -> bool:
    """`batch` decodes `last`'s rows again (one token each) with the same asks."""
    return (
        batch.num_steps == last.num_steps
        and batch.input_ids.shape == last.input_ids.shape
        and not batch.fill_rows.shape[0]
        and batch.req_rows == last.req_rows
        and batch.extend_lens == last.extend_lens
        and batch.is_prefill == last.is_prefill
        and batch.sampling == last.sampling
        and batch.logprobs == last.logprobs
        and batch.lora_slots == last.lora_slots
    )


@dataclass(frozen=True)
class _PromptPlan:
    rows: np.ndarray
    hidden_index: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray  # [B + 1] int32
    num_top: int
    keep_from: np.ndarray  # [B] first token (from the row's first new one) whose state is read


def _prompt_plan(
    batch: ForwardBatch, extend_lens: np.ndarray, prefix_lens: np.ndarray, starts: np.ndarray
) -> _PromptPlan:
    """Which hidden states score which prompt tokens: the state at position p predicts the
    token at p + 1, scored when p + 1 >= prompt_start (the chunk's last state predicts
    prompt_next_id, or nothing when the chunk ends the prompt)."""
    asks = batch.logprobs
    prompt_start = unpack(asks.prompt_start)
    rows = np.flatnonzero(prompt_start >= 0)
    keep_from = np.maximum(extend_lens - 1, 0)  # NOTE: the last token's state gives the logits
    if not len(rows):  # NOTE: most steps: nothing below to compute
        none = np.zeros(0, np.int64)
        offsets = np.zeros(len(extend_lens) + 1, np.int32)
        return _PromptPlan(none, none, none, offsets, 0, keep_from)
    next_ids, num_top = unpack(asks.prompt_next_id), unpack(asks.num_top)
    input_ids = unpack(batch.input_ids).astype(np.int64)
    counts = np.zeros(len(extend_lens), np.int64)
    hidden, targets = [], []
    for b in rows:  # NOTE: a loop over rows that asked, not over tokens or the vocabulary.
        first = max(int(prompt_start[b]) - 1, int(prefix_lens[b])) - int(prefix_lens[b])
        end = int(extend_lens[b]) - (1 if next_ids[b] < 0 else 0)
        if end <= first:
            continue
        idx = np.arange(first, end) + starts[b]
        tgt = np.append(
            input_ids[idx[:-1] + 1], next_ids[b] if next_ids[b] >= 0 else input_ids[idx[-1] + 1]
        )
        hidden.append(idx)
        targets.append(tgt)
        counts[b] = len(idx)
        keep_from[b] = min(keep_from[b], first)
    return _PromptPlan(
        rows=rows.astype(np.int64),
        hidden_index=np.concatenate(hidden) if hidden else np.zeros(0, np.int64),
        targets=np.concatenate(targets) if targets else np.zeros(0, np.int64),
        offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
        num_top=int(num_top[rows].max()) if len(rows) else 0,
        keep_from=keep_from,
    )
