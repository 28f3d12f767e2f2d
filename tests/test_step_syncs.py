"""A step on the CUDA path (the Triton backend: prompt chunks with prompt logprobs, decode
steps with sampled rows) waits on the device once, for its result: counted on the CPU under
Triton's interpreter by the aten ops that would make a GPU's host wait
(tests/triton_sync_check.py). benchmarks/gpu/gpu_accept.py counts the same on a GPU with
torch's sync debug mode.

    pip install triton && pytest -m slow tests/test_step_syncs.py   (make test-all)
"""

from __future__ import annotations

import pytest
from triton_interpreter import run_check

pytestmark = pytest.mark.slow


def test_a_step_asks_the_device_nothing_before_its_result(tiny_checkpoint) -> None:
    output = run_check("triton_sync_check.py", str(tiny_checkpoint()))
    assert "none waits on the device before its result" in output, output
