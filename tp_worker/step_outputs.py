"""What a step sends back: sampled ids and the logprob arrays rows asked for (tp_worker).

Everything stays on the device until the step ends; one transfer packs it into a StepResult
(on a GPU one copy of every array the result needs, so the host waits for the device once a
step; on the CPU the tensors' own memory).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from tokenmill.protocol.arrays import Array, pack
from tokenmill.protocol.step import StepResult
from tokenmill.tp_worker.sample.logprobs import LogSoftmax, ScoredPositions
from tokenmill.tp_worker.sample.sampling import greedy_ids, processed_logprobs, sample
from tokenmill.tp_worker.step_inputs import StepInputs
from tokenmill.tp_worker.upload import NUMPY_OF


@dataclass(frozen=True)
class SampledScores:
    """NOTE: None where no row reads it: the result's arrays are then NaN or empty, made on
    the host without a device tensor (a greedy step without logprobs is most steps)."""

    next_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32
    top_ids: torch.Tensor | None = None  # [R, K] int32
    top_logprobs: torch.Tensor | None = None  # [R, K] float32
    token_ids_logprobs: torch.Tensor | None = None  # [M] float32


def score_sampled(
    logits: torch.Tensor,
    inputs: StepInputs,
    adjusted: torch.Tensor | None = None,
    processed: bool = False,
    cpu_kernel: bool = False,
    triton_rows: bool = False,
) -> SampledScores:
    """logits [B, V] float32 of each row's last position, and the same after the stop ban,
    bias and penalties (`adjusted`, None = unchanged) -> the ids sampled from `adjusted` and
    their scores: from the raw logits, or (`processed`) from the distribution sampled from.
    cpu_kernel: the raw log-softmax, the greedy ids and (raw mode) the random rows' sampling
    through csrc/ (LogSoftmax.of, sampling.greedy_ids, sampling.sample); triton_rows: the
    log-softmax's row sums through cuda/rowwise.py on CUDA. Where no row reads
    them (inputs.sampled_logprobs), no log-softmax runs and the scores are NaN."""
    adjusted = logits if adjusted is None else adjusted
    scores = None
    if inputs.sampled_logprobs:
        scores = (
            LogSoftmax.given(processed_logprobs(adjusted, inputs.sampling))
            if processed
            else LogSoftmax.of(logits, cpu_kernel, inputs.max_top, triton_rows)
        )
    # NOTE: the argmax the log-softmax found where it read these logits, else the kernel's
    # max pass alone (torch's answers either way, so a row's tokens do not depend on whether
    # a row beside it reads logprobs).
    found = scores.argmax if scores is not None and adjusted is logits else None
    greedy = greedy_ids(adjusted, cpu_kernel) if found is None else found
    # NOTE: processed mode samples with torch, whose kept set is processed_logprobs' to the
    # last rounding: the kernel's could differ at a top-p boundary, and a sampled token would
    # read -inf.
    # NOTE: positions only where a row draws noise (a position keys its draw).
    positions = inputs.prefix_lens + inputs.extend_lens if inputs.sampling.any_random else None
    next_ids = sample(adjusted, inputs.sampling, positions, greedy, cpu_kernel and not processed)
    some = None if processed else inputs.processed_rows  # NOTE: rows of a request's own mode
    if some is not None:
        next_ids[some] = sample(
            adjusted[some],
            inputs.sampling.rows(some),
            None if positions is None else positions[some],
            greedy[some],
        )
    if scores is None:
        return SampledScores(next_ids)
    result = _scores_of(scores, inputs, next_ids)
    if some is None:
        return result
    theirs = _scores_of(LogSoftmax.given(processed_logprobs(adjusted, inputs.sampling)), inputs,
                        next_ids)  # fmt: skip
    return _per_row(result, theirs, some, inputs)


def _scores_of(scores: LogSoftmax, inputs: StepInputs, next_ids: torch.Tensor) -> SampledScores:
    top_ids, top_logprobs = None, None
    if inputs.max_top:
        # NOTE: None where every row asked: the top arrays need no row selection then.
        every = len(inputs.top_rows) == len(next_ids)
        top_ids, top_logprobs = scores.top(None if every else inputs.top_rows, inputs.max_top)
    return SampledScores(
        next_ids=next_ids,
        logprobs=scores.at_rows(next_ids),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        token_ids_logprobs=scores.at(inputs.token_id_rows, inputs.token_ids)
        if len(inputs.token_ids)
        else None,
    )


def _per_row(
    raw: SampledScores, processed: SampledScores, rows: torch.Tensor, inputs: StepInputs
) -> SampledScores:
    """Each row's scores in its own request's mode: `processed`'s for `rows`, else `raw`'s
    (a request's numbers do not depend on the modes of the rows beside it)."""
    mine = torch.zeros(len(raw.next_ids), dtype=torch.bool, device=raw.next_ids.device)
    mine[rows] = True

    def pick(a: torch.Tensor | None, b: torch.Tensor | None, at: torch.Tensor | None) -> Any:
        if a is None or b is None:
            return a
        which = mine if at is None else mine[at]
        return torch.where(which.view(-1, *([1] * (a.dim() - 1))), b, a)

    every = len(inputs.top_rows) == len(raw.next_ids)
    return SampledScores(
        next_ids=raw.next_ids,
        logprobs=pick(raw.logprobs, processed.logprobs, None),
        top_ids=pick(raw.top_ids, processed.top_ids, None if every else inputs.top_rows),
        top_logprobs=pick(
            raw.top_logprobs, processed.top_logprobs, None if every else inputs.top_rows
        ),
        token_ids_logprobs=pick(
            raw.token_ids_logprobs, processed.token_ids_logprobs, inputs.token_id_rows
        ),
    )


class StepOutputs:
    """Accumulates one SampledScores per decode iteration, and the prompt scores."""

    def __init__(self, inputs: StepInputs) -> None:
        self.inputs = inputs
        self.sampled: list[SampledScores] = []
        self.prompt: ScoredPositions | None = None
        # NOTE: --enable-return-routed-experts: [T, moe layers, k] int16 per forward pass
        self.routed: list[np.ndarray] = []

    @property
    def last_ids(self) -> torch.Tensor:
        return self.sampled[-1].next_ids

    def add(self, scores: SampledScores) -> None:
        self.sampled.append(scores)

    def sampled_ids(self) -> np.ndarray:
        """[N, B] int64 the ids of every iteration so far, on the host."""
        return np.stack(to_host([s.next_ids for s in self.sampled]))

    def to_result(self, step_id: int, num_accepted: np.ndarray | None = None) -> StepResult:
        steps, rows = len(self.sampled), len(self.sampled[0].next_ids)

        absent = _absent(steps, rows)
        prompt = self.prompt  # NOTE: None: no row scored a prompt position (offsets all 0)
        fields = [f for f in SAMPLED_FIELDS if getattr(self.sampled[0], f) is not None]
        device = [getattr(s, f) for f in fields for s in self.sampled]
        if prompt is not None:
            device += [prompt.logprobs, prompt.top_ids, prompt.top_logprobs]
        host = iter(to_host(device))

        def stacked(name: str) -> Array:
            """[N, ...]: the field of every iteration, or the absent one where none computed
            it."""
            if name not in fields:
                return getattr(absent, name)
            arrays = [next(host) for _ in range(steps)]
            # NOTE: [None] for one iteration (most steps): np.stack is ~10 Python-level calls
            array = arrays[0][None] if len(arrays) == 1 else np.stack(arrays)
            return pack(array.astype(np.int32) if name == "next_ids" else array)

        sampled = {name: stacked(name) for name in SAMPLED_FIELDS}
        if prompt is None:
            scored = absent.prompt_logprobs, absent.prompt_top_ids, absent.prompt_top_logprobs
            offsets = absent.prompt_offsets
        else:
            scored = pack(next(host)), pack(next(host)), pack(next(host))
            offsets = pack(self.inputs.prompt_offsets)
        return StepResult(
            step_id=step_id,
            **sampled,
            prompt_offsets=offsets,
            prompt_logprobs=scored[0],
            prompt_top_ids=scored[1],
            prompt_top_logprobs=scored[2],
            num_accepted=None if num_accepted is None else pack(num_accepted),
            routed_experts=pack(np.concatenate(self.routed)) if self.routed else None,
        )


class _Absent(NamedTuple):
    """A result's arrays for what no row of a step asked (most steps read no logprob and
    score no prompt position), packed once per (steps, rows). NOTE: every iteration
    samples, so next_ids is never absent."""

    logprobs: Array  # [N, B] NaN
    top_ids: Array  # [N, 0, 0]
    top_logprobs: Array  # [N, 0, 0]
    token_ids_logprobs: Array  # [N, 0]
    prompt_offsets: Array  # [B + 1] zeros
    prompt_logprobs: Array  # [0]
    prompt_top_ids: Array  # [0, 0]
    prompt_top_logprobs: Array  # [0, 0]


@functools.lru_cache(maxsize=64)
def _absent(steps: int, rows: int) -> _Absent:
    return _Absent(
        pack(np.full((steps, rows), np.nan, np.float32)),
        pack(np.zeros((steps, 0, 0), np.int32)),
        pack(np.zeros((steps, 0, 0), np.float32)),
        pack(np.zeros((steps, 0), np.float32)),
        pack(np.zeros(rows + 1, np.int32)),
        pack(np.zeros(0, np.float32)),
        pack(np.zeros((0, 0), np.int32)),
        pack(np.zeros((0, 0), np.float32)),
    )


SAMPLED_FIELDS = ("next_ids", "logprobs", "top_ids", "top_logprobs", "token_ids_logprobs")


def to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The tensors' values in host memory, in order: on the CPU their own memory, on a device
    one copy of them all (gathered)."""
    if all(t.device.type == "cpu" for t in tensors):
        return [t.numpy() for t in tensors]
    return gathered(tensors)


def gathered(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The tensors' bytes joined on their device, copied to the host once and cut back into
    arrays of their dtypes and shapes. NOTE: laid out by element size, largest first, so that
    each array starts aligned for its dtype."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    pieces = [tensors[i].contiguous().reshape(-1).view(torch.uint8) for i in order]
    joined = torch.cat(pieces).cpu().numpy() if pieces else np.zeros(0, np.uint8)
    arrays: list[np.ndarray] = [np.empty(0)] * len(tensors)
    at = 0
    for i, piece in zip(order, pieces, strict=True):
        t, size = tensors[i], piece.numel()
        arrays[i] = joined[at : at + size].view(NUMPY_OF[t.dtype]).reshape(t.shape)
        at += size
    return arrays
