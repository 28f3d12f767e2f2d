"""How many KV slots a GPU can hold, measured by a profiling step before the cache exists
(tp_worker, at start).

vLLM's rule, by vLLM's flag: this rank may use --gpu-memory-utilization of the device's
total memory. A prefill of the largest chunk (--max-prefill-tokens, with prompt logprobs
scored, so the lm_head's largest logits chunk is in it) runs once over a scratch KV cache of
that many slots; torch's peak allocation over it, less the scratch cache, is what the
weights and the activations take; what the device holds outside torch's allocator (the CUDA
context, NCCL's buffers, other processes) is taken off too; the KV cache gets the rest.
Sizing from free memory before any forward pass (as the CPU still does) leaves the
activations' peak to chance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tokenmill.protocol.arrays import pack
from tokenmill.protocol.step import ForwardBatch, LogprobAsks, SamplingBatch, StepResult


@dataclass(frozen=True)
class MemoryUse:
    """The device's memory around the profiling step, in bytes."""

    total: int  # the device's memory
    peak: int  # torch's largest allocation during the step (weights and scratch KV included)
    outside_torch: int  # in use on the device but not by torch's allocator


class DeviceMemory(Protocol):
    """Reads a device's memory (CudaMemory; tests pass their own)."""

    def reset_peak(self) -> None: ...

    def read(self) -> MemoryUse: ...


class CudaMemory:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> MemoryUse:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        return MemoryUse(
            total=total,
            peak=torch.cuda.max_memory_allocated(self.device),
            outside_torch=max(0, total - free - reserved),
        )


@dataclass(frozen=True)
class KvBudget:
    """What the profiling step found, and the KV slots it leaves room for."""

    use: MemoryUse
    utilization: float
    profile_tokens: int  # the profiling step's prefill (and its scratch cache's slots)
    bytes_per_token: int  # of the KV cache, every layer's keys and values (the draft's too)
    # NOTE: kept free besides the profile's peak: scratch whose size follows the context,
    # which the profiling step's short one does not reach (the Triton attention's partials)
    reserve: int = 0

    @property
    def scratch_kv_bytes(self) -> int:
        return self.profile_tokens * self.bytes_per_token

    @property
    def model_bytes(self) -> int:
        """The weights and the largest step's activations (the peak less the scratch KV)."""
        return self.use.peak - self.scratch_kv_bytes

    @property
    def kv_bytes(self) -> int:
        allowed = int(self.use.total * self.utilization)
        return allowed - self.model_bytes - self.use.outside_torch - self.reserve

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_bytes) // self.bytes_per_token

    def describe(self) -> str:
        gib = 1 << 30
        return (
            f"{self.utilization:g} of {self.use.total / gib:.1f} GiB; weights and the largest "
            f"step's activations {self.model_bytes / gib:.2f} GiB, outside torch "
            f"{self.use.outside_torch / gib:.2f} GiB, kept free {self.reserve / gib:.2f} GiB; "
            "the KV cache "
            f"{max(0, self.kv_bytes) / gib:.2f} GiB = {self.kv_tokens} tokens"
        )


def profile_kv_budget(
    run_step: Callable[[ForwardBatch], StepResult],
    memory: DeviceMemory,
    tokens: int,
    num_top: int,
    utilization: float,
    bytes_per_token: int,
    reserve: int = 0,
) -> KvBudget:
    """Runs `run_step` (over a scratch cache of `tokens` slots, set up by the caller) on a
    prefill of `tokens` prompt tokens scoring every prompt position's top `num_top`, and
    returns what that leaves for the KV cache."""
    memory.reset_peak()
    run_step(profile_batch(tokens, num_top))
    return KvBudget(memory.read(), utilization, tokens, bytes_per_token, reserve)


def profile_batch(tokens: int, num_top: int) -> ForwardBatch:
    """One request in table row 0: `tokens` prompt tokens (id 0) into slots 0.., the whole
    chunk scored as prompt logprobs with `num_top` top ids, its next token sampled greedily."""
    one = np.ones(1, np.int32)
    none = np.zeros(0, np.int32)
    return ForwardBatch(
        step_id=-1,
        input_ids=pack(np.zeros(tokens, np.int32)),
        out_slots=pack(np.arange(tokens, dtype=np.int32)),
        req_rows=pack(np.zeros(1, np.int32)),
        prefix_lens=pack(np.zeros(1, np.int32)),
        extend_lens=pack(np.full(1, tokens, np.int32)),
        is_prefill=pack(np.ones(1, np.bool_)),
        fill_rows=pack(none),
        fill_lens=pack(none),
        fill_slots=pack(none),
        sampling=SamplingBatch(
            temperature=pack(np.zeros(1, np.float32)),
            top_k=pack(np.zeros(1, np.int32)),
            top_p=pack(np.ones(1, np.float32)),
            min_p=pack(np.zeros(1, np.float32)),
            seed=pack(np.zeros(1, np.int64)),
        ),
        logprobs=LogprobAsks(
            num_top=pack(np.full(1, num_top, np.int32)),
            token_ids_offsets=pack(np.zeros(2, np.int32)),
            token_ids=pack(none),
            prompt_start=pack(one),
            prompt_next_id=pack(np.full(1, -1, np.int32)),
        ),
    )
