"""A step on the CUDA path (the Triton backend: prompt chunks with prompt logprobs, decode
steps with sampled rows) waits on the device once, for its result: counted on the CPU under
Triton's interpreter by the aten ops that would make a GPU's host wait
(tests/triton_sync_check.py). benchmarks/gpu/gpu_accept.py counts the same on a GPU with
torch's sync debug mode.

    pip install triton && pytest -m slow tests/test_step_syncs.py   (make test-all)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHECK = Path(__file__).with_name("triton_sync_check.py")


def test_a_step_asks_the_device_nothing_before_its_result(tiny_checkpoint) -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.fail("Triton is not installed: pip install triton (make test-all does)")
    result = subprocess.run(
        [sys.executable, str(CHECK), str(tiny_checkpoint())],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "none waits on the device before its result" in result.stdout, result.stdout
