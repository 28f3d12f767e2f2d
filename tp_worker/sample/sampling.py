"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p (tp_worker).

The logits come in after the stop ban, logit bias and penalties (`penalties.py`).

Randomness is a counter-based hash of (seed, position, token id) turned into exponential
noise (the Gumbel-max trick in its exponential-race form). A request's samples therefore
depend only on its seed and its positions: not on the batch it shares, not on how many decode
steps run per round trip, not on the rank that computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.tp_worker.cpu.kernels import library

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Filters:
    """Which filters some of a set of rows use, found on the host where the rows are (asked
    of the device, each is an any() that makes a GPU's host wait: three syncs a step)."""

    top_k: bool
    top_p: bool
    min_p: bool

    @staticmethod
    def of(
        top_k: np.ndarray | torch.Tensor,
        top_p: np.ndarray | torch.Tensor,
        min_p: np.ndarray | torch.Tensor,
    ) -> Filters:
        """From the rows' parameters: host arrays, or device tensors (three syncs on a GPU)."""
        return Filters(bool((top_k > 0).any()), bool((top_p < 1).any()), bool((min_p > 0).any()))

    @staticmethod
    def on_device(params: SamplingTensors) -> Filters:
        return Filters.of(params.top_k, params.top_p, params.min_p)


@dataclass(frozen=True)
class SamplingTensors:
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32; 1 = off
    min_p: torch.Tensor  # [B] float32; 0 = off
    seed: torch.Tensor  # [B] int64
    # NOTE: [R] int64 rows with temperature > 0, where the caller found them on the host (a
    # device nonzero() per step is a sync on a GPU and ~40 us on a cold CPU); None: found here.
    random_rows: torch.Tensor | None = None
    # NOTE: the filters the random_rows use, found with them; None: asked of the device
    random_filters: Filters | None = None

    @property
    def any_random(self) -> bool:
        return len(self.sampled_rows()) > 0

    def sampled_rows(self) -> torch.Tensor:
        """The rows that draw noise (temperature > 0)."""
        if self.random_rows is None:
            return (self.temperature > 0).nonzero().squeeze(1)
        return self.random_rows

    def rows(self, index: torch.Tensor) -> SamplingTensors:
        return SamplingTensors(
            temperature=self.temperature[index],
            top_k=self.top_k[index],
            top_p=self.top_p[index],
            min_p=self.min_p[index],
            seed=self.seed[index],
        )


def sample(
    logits: torch.Tensor,
    params: SamplingTensors,
    positions: torch.Tensor | None,
    greedy: torch.Tensor | None = None,
    cpu_kernel: bool = False,
) -> torch.Tensor:
    """logits [B, V] float32, positions [B] (of the token being sampled; read only where a
    row has temperature > 0) -> ids [B] int64. `greedy`: logits.argmax(-1) where the caller
    already has it (returned as it is when every row is greedy). cpu_kernel: the random rows
    through csrc/sample.cpp (float32 logits in CPU memory): the same distribution and noise,
    without a sort of the vocabulary or any [B, V] temporary."""
    random_rows = params.sampled_rows()
    if len(random_rows) == 0:
        return greedy_ids(logits, cpu_kernel) if greedy is None else greedy
    assert positions is not None, "rows that draw noise need their positions"
    ids = greedy_ids(logits, cpu_kernel) if greedy is None else greedy.clone()
    sub = params.rows(random_rows)
    if cpu_kernel:
        ids[random_rows] = _sample_cpu(logits, random_rows, sub, positions[random_rows])
        return ids
    filters = params.random_filters if params.random_rows is not None else None
    probs = filtered_probs(logits[random_rows], sub, filters)
    noise = exponential_noise(sub.seed, positions[random_rows], logits.shape[1])
    ids[random_rows] = (probs / noise).argmax(dim=-1)
    return ids


def greedy_ids(logits: torch.Tensor, cpu_kernel: bool = False) -> torch.Tensor:
    """logits [B, V] -> argmax ids [B] int64 (the first of equal maxima; NaN counts as the
    max), through csrc/ (csrc/argmax.h: torch's answers) on float32 logits in CPU memory."""
    if not (cpu_kernel and logits.dtype == torch.float32 and logits.device.type == "cpu"):
        return logits.argmax(dim=-1)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows = logits.shape[0]
    max_, ids = logits.new_empty(rows), torch.empty(rows, dtype=torch.int64)
    library().tm_row_argmax(
        logits.data_ptr(), rows, logits.shape[1], logits.stride(0), max_.data_ptr(), ids.data_ptr()
    )
    return ids


def _sample_cpu(
    logits: torch.Tensor, rows: torch.Tensor, params: SamplingTensors, positions: torch.Tensor
) -> torch.Tensor:
    assert logits.dtype == torch.float32 and logits.device.type == "cpu"
    assert logits.dim() == 2 and logits.stride(1) == 1
    rows, positions = rows.long().contiguous(), positions.long().contiguous()
    columns = (
        params.temperature.float().contiguous(),
        params.top_k.long().contiguous(),
        params.top_p.float().contiguous(),
        params.min_p.float().contiguous(),
        params.seed.long().contiguous(),
    )
    out = torch.empty(len(rows), dtype=torch.int64)
    library().tm_sample(
        logits.data_ptr(),
        logits.shape[1],
        logits.stride(0),
        rows.data_ptr(),
        len(rows),
        *(c.data_ptr() for c in columns),
        positions.data_ptr(),
        out.data_ptr(),
    )
    return out


def filtered_probs(
    logits: torch.Tensor, params: SamplingTensors, filters: Filters | None = None
) -> torch.Tensor:
    """The distribution sampled from: softmax(logits / T), then top-k, top-p and min-p, each
    on the renormalised result of the one before. Removed tokens get probability 0.
    `filters`: which of them some row uses, where the caller knows (None: asked here)."""
    probs = torch.softmax(logits / params.temperature[:, None], dim=-1)
    filters = filters or Filters.on_device(params)
    if filters.top_k or filters.top_p:
        probs = _top_k_top_p(probs, params.top_k, params.top_p)
    if filters.min_p:
        floor = params.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def processed_logprobs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """logits [B, V] float32 -> [B, V] float32 log of the distribution sampled from
    (`--logprobs-mode processed`); tokens the filters remove get -inf.

    NOTE: greedy rows (temperature 0) get what vLLM gives them: the distribution at
    temperature 1 with the row's own top-k / top-p / min-p; their argmax is always kept."""
    temperature = torch.where(params.temperature > 0, params.temperature, 1.0)  # [B]
    scaled = logits / temperature[:, None]  # [B, V]
    kept = _kept(scaled, params)  # [B, V] bool
    return torch.log_softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)


def _kept(scaled: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """The tokens top-k, top-p and min-p keep, decided as `filtered_probs` decides but on
    ranks and log-probabilities: a kept token whose probability underflows float32 keeps its
    (tiny) logprob instead of showing as filtered."""
    kept = torch.ones_like(scaled, dtype=torch.bool)
    filters = Filters.on_device(params)
    if filters.top_k or filters.top_p:
        ordered, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
        keep = rank < torch.where(params.top_k > 0, params.top_k, scaled.shape[1])[:, None]
        probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= (mass_before < params.top_p[:, None]) | (params.top_p[:, None] >= 1)
        kept = torch.zeros_like(kept).scatter_(1, order, keep)
    if filters.min_p:
        logp = torch.log_softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
        floor = torch.log(params.min_p)[:, None] + logp.max(dim=-1, keepdim=True).values
        kept &= logp >= floor
    return kept


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[1])[:, None]
    sorted_probs = sorted_probs.masked_fill(rank >= k, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    # A token stays while the mass before it is below top_p: the first token always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def exponential_noise(seed: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, V] as a pure function of (seed[b], positions[b], token id)."""
    seed = seed.long()
    key = (seed & _MASK32) ^ _mix((seed >> 32) & _MASK32)
    key = _mix((key + positions.long() * 0x9E3779B1) & _MASK32)  # [B]
    token = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    bits = _mix(_mix(key[:, None] ^ ((token[None, :] * 0x85EBCA77) & _MASK32)))  # [B, V]
    # NOTE: (2^24 - 1) + 0.5 rounds to 2^24 in float32: u = 1, a noise of -0.0, and a race
    # of 0 / -0.0 = NaN that won the argmax for a token of probability 0 (~1 step in 500 at a
    # 32K vocabulary). That step takes the value below it instead (every other u as it was).
    raw = bits >> 8
    steps = raw - ((raw + 1) >> 24)  # NOTE: the top one down, as csrc/sample.cpp computes it
    uniform = (steps.float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(uniform)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)
