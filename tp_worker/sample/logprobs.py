"""Logprobs of sampled tokens, top-k, caller-given ids, and prompt positions (tp_worker).

Values are log-softmax of the float32 logits, computed only where asked: each row's max and
logsum come from one read of its logits (csrc/log_softmax.cpp on the CPU and
cuda/rowwise.py on CUDA, which fix the sum's order; torch elsewhere), and
logprob_j = (x_j - max) - logsum for the ids wanted. The top-k are the top-k logits. Prompt
positions are scored chunk by chunk (lm_head -> logits -> gather -> top-k), so that peak
extra memory is bounded by chunk_size x vocab, never by prompt length x vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.tp_worker.cpu.kernels import library
from tokenmill.tp_worker.cuda import rowwise as rowwise_triton

# NOTE: 2**24 floats (64 MiB) per [chunk, vocab] buffer; a few such buffers live at once.
PROMPT_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ScoredPositions:
    logprobs: torch.Tensor  # [P] float32 logprob of each target token
    top_ids: torch.Tensor  # [P, K] int32
    top_logprobs: torch.Tensor  # [P, K] float32


@dataclass(frozen=True)
class LogSoftmax:
    """log_softmax(logits) [N, V] float32, without the [N, V] result."""

    logits: torch.Tensor  # [N, V] float32
    max: torch.Tensor  # [N] float32
    # NOTE: [N] int64 first index of the max (torch's argmax), where the pass found it free.
    argmax: torch.Tensor | None
    logsum: torch.Tensor  # [N] float32
    # NOTE: the kernel's top-k of every row, found in the same pass ([N, K] int32 / float32).
    top_ids: torch.Tensor | None = None
    top_logits: torch.Tensor | None = None

    @staticmethod
    def of(
        logits: torch.Tensor, cpu_kernel: bool, top: int = 0, triton_rows: bool = False
    ) -> LogSoftmax:
        """cpu_kernel: through csrc/log_softmax.cpp (float32 logits in CPU memory), which
        also finds each row's `top` largest logits. triton_rows: the max and log-sum through
        cuda/rowwise.py where the logits are on CUDA (the Triton backend)."""
        if triton_rows and not cpu_kernel and rowwise_triton.runs_on(logits):
            # NOTE: torch's sum splits a row by the batch's shape (cuda/rowwise.py)
            max_, logsum = rowwise_triton.log_softmax_stats(logits)
            return LogSoftmax(logits, max_, None, logsum)
        if not cpu_kernel:
            max_ = logits.amax(dim=-1)
            # NOTE: summed in float64 (why: csrc/log_softmax.cpp's NOTE, whose totals are
            # double too); torch converts the [rows, vocab] terms, a prompt chunk's at most.
            sums = torch.exp(logits - max_[:, None]).sum(dim=-1, dtype=torch.float64)
            logsum = sums.log().float()
            return LogSoftmax(logits, max_, None, logsum)
        assert logits.dtype == torch.float32 and logits.device.type == "cpu"
        assert logits.dim() == 2 and logits.stride(1) == 1
        rows, top = logits.shape[0], min(top, logits.shape[1])
        max_, logsum = logits.new_empty(rows), logits.new_empty(rows)
        argmax = torch.empty(rows, dtype=torch.int64)
        top_ids = torch.empty(rows, top, dtype=torch.int32)
        top_logits = logits.new_empty(rows, top)
        library().tm_log_softmax_stats(
            logits.data_ptr(),
            rows,
            logits.shape[1],
            logits.stride(0),
            max_.data_ptr(),
            argmax.data_ptr(),
            logsum.data_ptr(),
            top,
            top_ids.data_ptr(),
            top_logits.data_ptr(),
        )
        found = top > 0
        return LogSoftmax(
            logits,
            max_,
            argmax,
            logsum,
            top_ids if found else None,
            top_logits if found else None,
        )

    @staticmethod
    def given(logprobs: torch.Tensor) -> LogSoftmax:
        """An already normalised [N, V] float32 (max and logsum 0 leave its values as they
        are)."""
        zeros = logprobs.new_zeros(logprobs.shape[0])
        return LogSoftmax(logprobs, zeros, None, zeros)

    def at(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """logprobs [M] of token ids [M] in rows [M]."""
        rows, ids = rows.long(), ids.long()
        return (self.logits[rows, ids] - self.max[rows]) - self.logsum[rows]

    def at_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """logprobs [N] of token ids [N], one in each row: at(arange(N), ids), with four
        device calls instead of eight (a decode step's sampled tokens)."""
        chosen = self.logits.gather(1, ids.long()[:, None]).squeeze(1)
        return (chosen - self.max) - self.logsum

    def top(self, rows: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely ids [R, k] int32 of rows [R] (None: every row), and their
        logprobs [R, k]."""
        max_, logsum = (
            (self.max, self.logsum) if rows is None else (self.max[rows], self.logsum[rows])
        )
        found = self._found_top(rows, k, max_)
        if found is None:
            logits = self.logits if rows is None else self.logits[rows]
            top = logits.topk(k, dim=-1)
            found = top.indices.int(), top.values
        ids, values = found
        return ids, (values - max_[:, None]) - logsum[:, None]

    def _found_top(
        self, rows: torch.Tensor | None, k: int, max_: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The top k the kernel found for `rows`, if it did: not for rows with a NaN, which
        it leaves to torch (whose topk puts NaN first)."""
        if self.top_ids is None or self.top_logits is None or self.top_ids.shape[1] < k:
            return None
        if bool(max_.isnan().any()):
            return None
        ids, values = self.top_ids[:, :k], self.top_logits[:, :k]
        return (ids, values) if rows is None else (ids[rows], values[rows])


def default_chunk_size(vocab: int) -> int:
    return max(1, PROMPT_CHUNK_ELEMENTS // vocab)


def score_targets(scores: LogSoftmax, targets: torch.Tensor, num_top: int) -> ScoredPositions:
    """Rows' log-softmax, targets [N] -> their logprobs and the top-num_top of each row."""
    chosen = scores.at_rows(targets)
    if num_top == 0:
        return ScoredPositions(
            chosen, _empty_ids(len(targets), targets.device), chosen.new_empty(len(targets), 0)
        )
    top_ids, top_logprobs = scores.top(None, num_top)
    return ScoredPositions(chosen, top_ids, top_logprobs)


def score_prompt(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    logits_fn: Callable[[torch.Tensor, slice], torch.Tensor],
    num_top: int,
    chunk_size: int,
    cpu_kernel: bool,
    triton_rows: bool = False,
) -> ScoredPositions:
    """hidden [P, H] (each predicting targets [P]) -> scores, in chunks of chunk_size rows."""
    parts = []
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        logits = logits_fn(hidden[rows], rows)
        scores = LogSoftmax.of(logits, cpu_kernel, num_top, triton_rows)
        parts.append(score_targets(scores, targets[start : start + chunk_size], num_top))
        del logits, scores
    if not parts:
        return ScoredPositions(
            hidden.new_empty(0, dtype=torch.float32),
            _empty_ids(0, hidden.device, num_top),
            hidden.new_empty(0, num_top, dtype=torch.float32),
        )
    return ScoredPositions(
        torch.cat([p.logprobs for p in parts]),
        torch.cat([p.top_ids for p in parts]),
        torch.cat([p.top_logprobs for p in parts]),
    )


def _empty_ids(rows: int, device: torch.device, cols: int = 0) -> torch.Tensor:
    return torch.empty(rows, cols, dtype=torch.int32, device=device)
