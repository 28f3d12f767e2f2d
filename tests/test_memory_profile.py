"""A GPU's KV cache sized after a profiling step (tp_worker/cuda/memory_profile.py), its logic on
the CPU: the arithmetic, and a real runner sizing its cache through the profiling step with a
stand-in for the GPU's memory reader; the step leaves nothing behind (the same bits after)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_bits

from tokenmill.frontend.server_config import SchedulerArgs, ServerConfig, validate
from tokenmill.offline.engine import OfflineEngine, OfflineRequest
from tokenmill.protocol.arrays import unpack
from tokenmill.protocol.step import ForwardBatch, StepResult
from tokenmill.tp_worker.config import RunnerConfig
from tokenmill.tp_worker.cuda.memory_profile import KvBudget, MemoryUse
from tokenmill.tp_worker.model_runner import ModelRunner

GIB = 1 << 30


class StandInMemory:
    """Reports `use` and records what the runner asked of it."""

    def __init__(self, use: MemoryUse) -> None:
        self.use = use
        self.calls: list[str] = []

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def read(self) -> MemoryUse:
        self.calls.append("read")
        return self.use


class RecordingRunner(ModelRunner):
    """A runner that keeps every step it ran (the profiling step among them)."""

    steps: list[tuple[ForwardBatch, StepResult]]

    def step(self, batch: ForwardBatch) -> StepResult:
        result = super().step(batch)
        self.__dict__.setdefault("steps", []).append((batch, result))
        return result


def config(model: Path, kv_cache_tokens: int = 0) -> RunnerConfig:
    return RunnerConfig(
        model=str(model),
        kv_cache_tokens=kv_cache_tokens,
        max_running_requests=8,
        max_model_len=512,
        dtype="float32",
        device="cpu",
        gpu_memory_utilization=0.5,
        profile_tokens=300,
        max_logprobs=5,
    )


def use_leaving(kv_tokens: int, bytes_per_token: int) -> MemoryUse:
    """A 16 GiB device whose half, less 3 GiB of model and 1 GiB outside torch, holds
    `kv_tokens` tokens (and a little less than one more)."""
    scratch = 300 * bytes_per_token
    peak = 3 * GIB + scratch + (4 * GIB - kv_tokens * bytes_per_token - bytes_per_token // 2)
    return MemoryUse(total=16 * GIB, peak=peak, outside_torch=GIB)


def test_budget_is_the_share_less_model_peak_and_outside_torch() -> None:
    use = MemoryUse(total=80 * GIB, peak=20 * GIB, outside_torch=GIB)
    budget = KvBudget(use, 0.9, profile_tokens=2048, bytes_per_token=128 << 10)
    assert budget.scratch_kv_bytes == 256 << 20
    assert budget.model_bytes == 20 * GIB - (256 << 20)
    assert budget.kv_bytes == int(72 * GIB) - budget.model_bytes - GIB
    assert budget.kv_tokens == budget.kv_bytes // (128 << 10)
    assert "0.9 of 80.0 GiB" in budget.describe()
    over = KvBudget(MemoryUse(80 * GIB, 79 * GIB, 0), 0.5, 16, 1024)
    assert over.kv_bytes < 0 and over.kv_tokens == 0
    # NOTE: scratch that grows with the context (the Triton attention's partials) kept free
    kept = KvBudget(use, 0.9, profile_tokens=2048, bytes_per_token=128 << 10, reserve=GIB)
    assert kept.kv_bytes == budget.kv_bytes - GIB and "kept free 1.00 GiB" in kept.describe()


def test_runner_sizes_its_cache_after_a_scored_prefill(tiny_checkpoint) -> None:
    model = tiny_checkpoint()
    probe = ModelRunner(config(model, kv_cache_tokens=16))
    per_token = probe._kv_bytes_per_token()
    memory = StandInMemory(use_leaving(1000, per_token))
    runner = RecordingRunner(config(model), memory=memory)
    assert memory.calls == ["reset_peak", "read"]
    ((batch, result),) = runner.steps
    assert unpack(batch.extend_lens).tolist() == [300] and unpack(batch.is_prefill).all()
    scored = unpack(result.prompt_logprobs)
    assert scored.shape == (299,) and np.isfinite(scored).all()
    assert unpack(result.prompt_top_ids).shape == (299, 5)
    assert runner.kv_cache_tokens == 1000 and runner.max_model_len == 512
    assert runner.kv_cache[0][0].shape[1] == 1000 and runner.table.shape == (8, 512)
    # NOTE: the same bits as a runner that never profiled: the step left nothing behind
    plain = ModelRunner(config(model, kv_cache_tokens=1000))
    request = OfflineRequest(list(range(3, 60)), max_tokens=12, num_top=3, prompt_logprob_start=0)
    ours, theirs = (OfflineEngine(r).generate([request])[0] for r in (runner, plain))
    assert_same_bits(ours, theirs)


def test_too_little_memory_for_one_chunk_fails_naming_the_flags(tiny_checkpoint) -> None:
    model = tiny_checkpoint()
    per_token = ModelRunner(config(model, kv_cache_tokens=16))._kv_bytes_per_token()
    memory = StandInMemory(use_leaving(299, per_token))
    with pytest.raises(RuntimeError, match="--gpu-memory-utilization 0.5 leaves room for 299"):
        ModelRunner(config(model), memory=memory)


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5])
def test_gpu_memory_utilization_is_validated(value: float) -> None:
    validate(ServerConfig(scheduler=SchedulerArgs(gpu_memory_utilization=1.0)))
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        validate(ServerConfig(scheduler=SchedulerArgs(gpu_memory_utilization=value)))
