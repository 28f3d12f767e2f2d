"""The Triton paged attention (the CUDA backend's kernel) run on the CPU by Triton's
interpreter (slow: ~25 s): against float64 attention in float32 and bfloat16, with and
without a sliding window, decode rows and prompt chunks after a prefix, across splits;
every row alone bit for bit as in its batch; the whole model on it against the torch path.

    pip install triton && pytest -m slow tests/test_attention_triton.py   (make test-all)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_interpreter import run_check

from tokenmill.tp_worker.cuda import attention as attention_triton
from tokenmill.tp_worker.cuda.attention import SPLIT, StepPlan, plan_triton


@pytest.mark.slow
def test_triton_attention_under_the_interpreter(tiny_checkpoint) -> None:
    model = tiny_checkpoint("mistral", "sentencepiece")
    assert "model on Triton = on SDPA" in run_check("triton_attention_check.py", str(model))


def test_a_steps_plan_tiles_runs_and_bounds_its_partials(monkeypatch) -> None:
    """The host side of a step (no Triton needed): tiles never cross a request or a gap in
    positions, decode-only steps take short tiles, the splits follow the longest context,
    and the launches cover every tile once within the partials' bound."""
    rows = np.array([0, 0, 0, 0, 0, 1, 2, 2, 2], np.int32)
    pos = np.array([5, 6, 7, 8, 9, 3 * SPLIT, 0, 1, 5], np.int32)
    plan = StepPlan.of(rows, pos, group_p=4, bytes_per_split=100, decode_block_m=16)
    assert plan.block_m == 64 and plan.splits == 4
    assert plan.tiles.tolist() == [
        [0, 1, 2, 2], [0, 5, 6, 8], [5, 3 * SPLIT, 0, 5], [5, 1, 2, 1]
    ]  # fmt: skip
    assert plan.launches == ((0, 9, 0, 4),)
    decode = StepPlan.of(np.arange(3, dtype=np.int32), np.array([1, 2, 700], np.int32), 4, 100, 16)
    assert decode.block_m == 16 and decode.splits == 700 // SPLIT + 1
    assert decode.tiles[3].tolist() == [1, 1, 1]
    monkeypatch.setattr(attention_triton, "PARTIAL_BYTES", 100 * 4 * 2)  # two tokens a launch
    small = StepPlan.of(rows, pos, group_p=4, bytes_per_split=100, decode_block_m=16)
    assert small.launches == ((0, 5, 0, 1), (5, 6, 1, 2), (6, 8, 2, 3), (8, 9, 3, 4))


def test_the_plan_copies_nothing_back_where_the_step_gives_its_rows() -> None:
    """With the rows on the host, the plan never reads the device's copies (on a GPU, a sync):
    here they are meta tensors, which cannot be read at all."""
    meta = torch.empty(3, dtype=torch.int32, device="meta")
    table = torch.empty(2, 16, dtype=torch.int32, device="meta")
    host = (np.array([0, 0, 1], np.int32), np.array([3, 4, 9], np.int32))
    slots = torch.empty(3, dtype=torch.int64, device="meta")
    plan = plan_triton(table, meta, meta, slots, host=host).plan(4, 100)
    assert plan.tiles.shape == (4, 2) and plan.splits == 1
