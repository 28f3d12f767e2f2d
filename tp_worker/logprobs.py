"""Logprobs of sampled tokens, top-k, caller-given ids, and prompt positions (tp_worker).

Values are log-softmax of the float32 logits. Prompt positions are scored chunk by chunk
(lm_head -> float32 log-softmax -> gather -> top-k), so that peak extra memory is bounded by
chunk_size x vocab, never by prompt length x vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# NOTE: 2**24 floats (64 MiB) per [chunk, vocab] buffer; a few such buffers live at once.
PROMPT_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ScoredPositions:
    logprobs: torch.Tensor  # [P] float32 logprob of each target token
    top_ids: torch.Tensor  # [P, K] int32
    top_logprobs: torch.Tensor  # [P, K] float32


def default_chunk_size(vocab: int) -> int:
    return max(1, PROMPT_CHUNK_ELEMENTS // vocab)


def score_targets(logprobs: torch.Tensor, targets: torch.Tensor, num_top: int) -> ScoredPositions:
    """logprobs [N, V] float32, targets [N] -> their logprobs and the top-num_top of each row."""
    chosen = logprobs.gather(1, targets.long()[:, None]).squeeze(1)
    if num_top == 0:
        return ScoredPositions(
            chosen, _empty_ids(len(targets), logprobs.device), logprobs.new_empty(len(targets), 0)
        )
    top = logprobs.topk(num_top, dim=-1)
    return ScoredPositions(chosen, top.indices.int(), top.values)


def score_prompt(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    num_top: int,
    chunk_size: int,
) -> ScoredPositions:
    """hidden [P, H] (each predicting targets [P]) -> scores, in chunks of chunk_size rows."""
    parts = []
    for start in range(0, hidden.shape[0], chunk_size):
        logprobs = torch.log_softmax(logits_fn(hidden[start : start + chunk_size]), dim=-1)
        parts.append(score_targets(logprobs, targets[start : start + chunk_size], num_top))
        del logprobs
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
