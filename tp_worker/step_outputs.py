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
    cpu_kernel: the raw log-softmax, the greedy ids and (raw mode) the random rows' sampling
    through csrc/ (LogSoftmax.of, sampling.greedy_ids, sampling.sample). Where no row reads
    them (inputs.sampled_logprobs), no log-softmax runs and the scores are NaN."""
    positions = inputs.prefix_lens + inputs.extend_lens
    adjusted = logits if adjusted is None else adjusted
    scores = None
    if inputs.sampled_logprobs:
        scores = (
            LogSoftmax.given(processed_logprobs(adjusted, inputs.sampling))
            if processed
            else LogSoftmax.of(logits, cpu_kernel, inputs.max_top)
        )
    # NOTE: the argmax the log-softmax found where it read these logits, else the kernel's
    # max pass alone (torch's answers either way, so a row's tokens do not depend on whether
    # a row beside it reads logprobs).
    found = scores.argmax if scores is not None and adjusted is logits else None
    greedy = greedy_ids(adjusted, cpu_kernel) if found is None else found
    # NOTE: processed mode samples with torch, whose kept set is processed_logprobs' to the
    # last rounding: the kernel's could differ at a top-p boundary, and a sampled token would
    # read -inf.
    next_ids = sample(adjusted, inputs.sampling, positions, greedy, cpu_kernel and not processed)
    device = logits.device
    if scores is None:
        top_ids, top_logprobs = _no_top(device)
        return SampledScores(
            next_ids=next_ids,
            logprobs=torch.full(next_ids.shape, float("nan"), device=device),
            top_ids=top_ids,
            top_logprobs=top_logprobs,
            token_ids_logprobs=torch.empty(0, device=device),
        )
    top_ids, top_logprobs = (
        scores.top(inputs.top_rows, inputs.max_top) if inputs.max_top else _no_top(device)
    )
    rows = torch.arange(len(next_ids), device=device)
    return SampledScores(
        next_ids=next_ids,
        logprobs=scores.at(rows, next_ids),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        token_ids_logprobs=scores.at(inputs.token_id_rows, inputs.token_ids),
    )


def _no_top(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ids [0, 0] int32 and logprobs [0, 0]: no row of the step asked for any."""
    return torch.empty(0, 0, dtype=torch.int32, device=device), torch.empty(0, 0, device=device)


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
