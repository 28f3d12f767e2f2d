"""Logprobs of sampled tokens, top-k, caller-given ids, and prompt positions (tp_worker).

Values are log-softmax of the float32 logits, computed only where asked: each row's max and
logsum come from one read of its logits (csrc/log_softmax.cpp on the CPU, which fixes the
sum's order; torch elsewhere), and logprob_j = (x_j - max) - logsum for the ids wanted. The
top-k are the top-k logits. Prompt positions are scored chunk by chunk (lm_head -> logits ->
gather -> top-k), so that peak extra memory is bounded by chunk_size x vocab, never by prompt
length x vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.tp_worker.cpu_kernels import library

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
    argmax: torch.Tensor  # [N] int64, the first index of the max (torch's argmax)
    logsum: torch.Tensor  # [N] float32

    @staticmethod
    def of(logits: torch.Tensor, cpu_kernel: bool) -> LogSoftmax:
        """cpu_kernel: through csrc/log_softmax.cpp (float32 logits in CPU memory)."""
        if not cpu_kernel:
            top = logits.max(dim=-1)
            shifted = logits - top.values[:, None]
            logsum = torch.log(torch.exp(shifted).sum(dim=-1))
            return LogSoftmax(logits, top.values, top.indices, logsum)
        assert logits.dtype == torch.float32 and logits.device.type == "cpu"
        assert logits.dim() == 2 and logits.stride(1) == 1
        rows = logits.shape[0]
        max_, logsum = logits.new_empty(rows), logits.new_empty(rows)
        argmax = torch.empty(rows, dtype=torch.int64)
        library().tm_log_softmax_stats(
            logits.data_ptr(),
            rows,
            logits.shape[1],
            logits.stride(0),
            max_.data_ptr(),
            argmax.data_ptr(),
            logsum.data_ptr(),
        )
        return LogSoftmax(logits, max_, argmax, logsum)

    @staticmethod
    def given(logprobs: torch.Tensor) -> LogSoftmax:
        """An already normalised [N, V] float32 (max and logsum 0 leave its values as they
        are)."""
        zeros = logprobs.new_zeros(logprobs.shape[0])
        return LogSoftmax(logprobs, zeros, logprobs.argmax(dim=-1), zeros)

    def at(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """logprobs [M] of token ids [M] in rows [M]."""
        rows, ids = rows.long(), ids.long()
        return (self.logits[rows, ids] - self.max[rows]) - self.logsum[rows]

    def top(self, rows: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely ids [R, k] int32 of rows [R] (None: every row), and their
        logprobs [R, k]."""
        logits, max_, logsum = self.logits, self.max, self.logsum
        if rows is not None:
            logits, max_, logsum = logits[rows], max_[rows], logsum[rows]
        top = logits.topk(k, dim=-1)
        return top.indices.int(), (top.values - max_[:, None]) - logsum[:, None]


def default_chunk_size(vocab: int) -> int:
    return max(1, PROMPT_CHUNK_ELEMENTS // vocab)


def score_targets(scores: LogSoftmax, targets: torch.Tensor, num_top: int) -> ScoredPositions:
    """Rows' log-softmax, targets [N] -> their logprobs and the top-num_top of each row."""
    rows = torch.arange(len(targets), device=targets.device)
    chosen = scores.at(rows, targets)
    if num_top == 0:
        return ScoredPositions(
            chosen, _empty_ids(len(targets), targets.device), chosen.new_empty(len(targets), 0)
        )
    top_ids, top_logprobs = scores.top(None, num_top)
    return ScoredPositions(chosen, top_ids, top_logprobs)


def score_prompt(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    num_top: int,
    chunk_size: int,
    cpu_kernel: bool,
) -> ScoredPositions:
    """hidden [P, H] (each predicting targets [P]) -> scores, in chunks of chunk_size rows."""
    parts = []
    for start in range(0, hidden.shape[0], chunk_size):
        scores = LogSoftmax.of(logits_fn(hidden[start : start + chunk_size]), cpu_kernel)
        parts.append(score_targets(scores, targets[start : start + chunk_size], num_top))
        del scores
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
