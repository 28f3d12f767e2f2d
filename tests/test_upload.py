"""A step's inputs through one copy (tp_worker/upload.py), the path a GPU takes, run on the
CPU: each array's values, dtype and shape once flushed, across several buffers; and whole
generations (plain, multi-step, prompt logprobs, n-gram drafts, penalties, sampling) bit for
bit the same as with the arrays used where they lie."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_same_bits, make_engine

from tokenmill.offline.engine import OfflineEngine, OfflineRequest
from tokenmill.tp_worker import upload
from tokenmill.tp_worker.step_inputs import StepInputsBuilder
from tokenmill.tp_worker.upload import Upload

CPU = torch.device("cpu")


def test_staged_arrays_arrive_with_the_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload, "ARENA_BYTES", 256)  # NOTE: several buffers in one step
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(0, 1 << 40, 5),  # int64
        rng.standard_normal(7).astype(np.float32),
        rng.integers(0, 99, (3, 4)).astype(np.int32),
        rng.random(9) > 0.5,  # bool
        np.zeros(0, np.int64),
        rng.integers(0, 9, 100),  # 800 bytes: larger than a buffer
        np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # not contiguous
    ]
    up = Upload(CPU, staged=True)
    tensors = [up(a) for a in arrays]
    up.flush()
    for a, t in zip(arrays, tensors, strict=True):
        assert t.shape == a.shape and t.numpy().dtype == a.dtype
        assert np.array_equal(t.numpy(), a)
        assert t.data_ptr() % 64 == 0 or t.numel() == 0
    direct = Upload(CPU)
    same = np.arange(4)
    assert direct(same).data_ptr() == same.ctypes.data  # NOTE: the CPU's own path: no copy


def _staged(engine: OfflineEngine) -> OfflineEngine:
    engine.runner.step_inputs = StepInputsBuilder(CPU, staged=True)
    return engine


REQUESTS = [
    OfflineRequest(list(range(3, 60)), max_tokens=8, num_top=3, prompt_logprob_start=0),
    OfflineRequest(list(range(7, 30)), max_tokens=8, temperature=0.8, top_p=0.9, seed=5),
    OfflineRequest([5, 6, 7, 8] * 6, max_tokens=8, token_ids=(4, 11), frequency_penalty=0.5),
    OfflineRequest(list(range(9, 40)), max_tokens=8, min_tokens=4, repetition_penalty=1.2),
]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"decode_steps": 3},
        {"dtype": "bfloat16"},
        {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}'},
        {"cpu_kernels": False},
    ],
)
def test_generations_through_the_staged_path_are_the_same(tiny_checkpoint, settings) -> None:
    model = tiny_checkpoint()
    plain = make_engine(model, **settings).generate(REQUESTS)
    staged = _staged(make_engine(model, **settings)).generate(REQUESTS)
    for a, b in zip(plain, staged, strict=True):
        assert_same_bits(a, b)
