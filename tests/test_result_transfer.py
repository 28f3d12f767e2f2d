"""A step's result arrays leave the device in one copy (tp_worker/step_outputs.py): the
gathered path a GPU takes, run on the CPU, gives every array's values, dtype and shape, and a
whole generation through it is bit for bit the one that reads the tensors' own memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_same_bits, make_engine

from tokenmill.offline.engine import OfflineRequest
from tokenmill.tp_worker import step_outputs


def test_gathered_arrays_are_the_tensors() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(0, 1000, (3,), generator=gen),  # int64
        torch.randn(5, generator=gen),  # float32, after an 8-byte array
        torch.randint(0, 9, (2, 3), generator=gen, dtype=torch.int32),
        torch.rand(7, generator=gen) > 0.5,  # bool: one byte each
        torch.zeros(0, 4),  # empty
        torch.randn(4, 6, generator=gen)[:, ::2],  # not contiguous
        torch.arange(5, dtype=torch.int64),  # 8 bytes again, after the 1-byte ones
    ]
    arrays = step_outputs.gathered(tensors)
    for t, a in zip(tensors, arrays, strict=True):
        expected = t.contiguous().numpy()
        assert a.dtype == expected.dtype and a.shape == expected.shape
        assert np.array_equal(a, expected)
        assert a.ctypes.data % a.dtype.itemsize == 0  # aligned for its dtype
    assert step_outputs.gathered([]) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_generation_through_the_gathered_copy_is_the_same(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    model = tiny_checkpoint()
    requests = [
        OfflineRequest(list(range(3, 50)), max_tokens=6, num_top=3, prompt_logprob_start=0),
        OfflineRequest(list(range(7, 30)), max_tokens=6, temperature=0.8, seed=5),
        OfflineRequest(list(range(9, 40)), max_tokens=6, token_ids=(4, 11)),
    ]
    plain = make_engine(model, dtype=dtype).generate(requests)
    monkeypatch.setattr(step_outputs, "to_host", step_outputs.gathered)
    through = make_engine(model, dtype=dtype, decode_steps=3).generate(requests)
    for a, b in zip(plain, through, strict=True):
        assert_same_bits(a, b)
    assert len(plain[0].top_ids) == 6 and len(plain[2].token_ids_logprobs) == 6
