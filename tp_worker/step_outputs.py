"""What a step sends back: sampled ids and the logprob arrays rows asked for (tp_worker).

Everything stays on the device until the step ends; one transfer packs it into a StepResult.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.protocol.arrays import pack
from tokenmill.protocol.step import StepResult
from tokenmill.tp_worker.logprobs import LogSoftmax, ScoredPositions
from tokenmill.tp_worker.sampling import greedy_ids, processed_logprobs, sample
from tokenmill.tp_worker.step_inputs import StepInputs


@dataclass(frozen=True)
class SampledScores:
    next_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top_ids: torch.Tensor  # [R, K] int32
    top_logprobs: torch.Tensor  # [R, K] float32
    token_ids_logprobs: torch.Tensor  # [M] float32


def score_sampled(
    logits: torch.Tensor,
    inputs: StepInputs,
    adjusted: torch.Tensor | None = None,
    processed: bool = False,
    cpu_kernel: bool = False,
) -> SampledScores:
    """logits [B, V] float32 of each row's last position, and the same after the stop ban,
    bias and penalties (`adjusted`, None = unchanged) -> the ids sampled from `adjusted` and
    their scores: from the raw logits, or (`processed`) from the distribution sampled from.
    cpu_kernel: the raw log-softmax and (raw mode) the random rows' sampling through csrc/
    (LogSoftmax.of, sampling.sample). Where no row reads them (inputs.sampled_logprobs), no
    log-softmax runs and the scores are NaN."""
    positions = inputs.prefix_lens + inputs.extend_lens
    adjusted = logits if adjusted is None else adjusted
    if not inputs.sampled_logprobs:
        # NOTE: each mode's sampler below, so that a row's tokens do not depend on whether
        # a row beside it reads logprobs (greedy_ids: the log-softmax pass's argmax).
        greedy = greedy_ids(adjusted, cpu_kernel)
        kernel = cpu_kernel and not processed
        return _unscored(sample(adjusted, inputs.sampling, positions, greedy, kernel))
    if processed:
        scores = LogSoftmax.given(processed_logprobs(adjusted, inputs.sampling))
        # NOTE: the torch sampler, whose kept set is processed_logprobs' to the last rounding:
        # the kernel's could differ at a top-p boundary, and a sampled token would read -inf.
        # (Its greedy rows' argmax through the kernel: torch's answers, ~1 ms sooner.)
        next_ids = sample(adjusted, inputs.sampling, positions, greedy_ids(adjusted, cpu_kernel))
    else:
        scores = LogSoftmax.of(logits, cpu_kernel, inputs.max_top)
        # NOTE: with nothing adjusted, the greedy ids are the argmax the log-softmax found.
        greedy = scores.argmax if adjusted is logits else None
        next_ids = sample(adjusted, inputs.sampling, positions, greedy, cpu_kernel)
    if inputs.max_top:
        top_ids, top_logprobs = scores.top(inputs.top_rows, inputs.max_top)
    else:
        top_ids = torch.empty(0, 0, dtype=torch.int32, device=logits.device)
        top_logprobs = torch.empty(0, 0, device=logits.device)
    rows = torch.arange(len(next_ids), device=logits.device)
    return SampledScores(
        next_ids=next_ids,
        logprobs=scores.at(rows, next_ids),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        token_ids_logprobs=scores.at(inputs.token_id_rows, inputs.token_ids),
    )


def _unscored(next_ids: torch.Tensor) -> SampledScores:
    """Samples whose logprobs no row reads: NaN in their place, and no top or given ids."""
    assert next_ids.dim() == 1
    device = next_ids.device
    return SampledScores(
        next_ids=next_ids,
        logprobs=torch.full(next_ids.shape, float("nan"), device=device),
        top_ids=torch.empty(0, 0, dtype=torch.int32, device=device),
        top_logprobs=torch.empty(0, 0, device=device),
        token_ids_logprobs=torch.empty(0, device=device),
    )


class StepOutputs:
    """Accumulates one SampledScores per decode iteration, and the prompt scores."""

    def __init__(self, inputs: StepInputs) -> None:
        self.inputs = inputs
        self.sampled: list[SampledScores] = []
        self.prompt: ScoredPositions | None = None

    @property
    def last_ids(self) -> torch.Tensor:
        return self.sampled[-1].next_ids

    def add(self, scores: SampledScores) -> None:
        self.sampled.append(scores)

    def to_result(self, step_id: int) -> StepResult:
        def stacked(name: str) -> np.ndarray:
            return torch.stack([getattr(s, name) for s in self.sampled]).cpu().numpy()

        prompt = self.prompt
        counts = self.inputs.prompt_counts.numpy()
        return StepResult(
            step_id=step_id,
            next_ids=pack(stacked("next_ids").astype(np.int32)),
            logprobs=pack(stacked("logprobs")),
            top_ids=pack(stacked("top_ids")),
            top_logprobs=pack(stacked("top_logprobs")),
            token_ids_logprobs=pack(stacked("token_ids_logprobs")),
            prompt_offsets=pack(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)),
            prompt_logprobs=pack(_numpy(prompt.logprobs if prompt else None, np.float32, (0,))),
            prompt_top_ids=pack(_numpy(prompt.top_ids if prompt else None, np.int32, (0, 0))),
            prompt_top_logprobs=pack(
                _numpy(prompt.top_logprobs if prompt else None, np.float32, (0, 0))
            ),
        )


def _numpy(t: torch.Tensor | None, dtype: type, empty_shape: tuple[int, ...]) -> np.ndarray:
    if t is None:
        return np.zeros(empty_shape, dtype)
    return t.cpu().numpy().astype(dtype, copy=False)
