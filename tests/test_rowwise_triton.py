"""The row-local Triton kernels (RMSNorm, the log-softmax's max and log-sum: the CUDA path's
row reductions) run on the CPU by Triton's interpreter: against float64, every row alone bit
for bit as in batches of any size.

    pip install triton && pytest -m slow tests/test_rowwise_triton.py   (make test-all)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHECK = Path(__file__).with_name("triton_rowwise_check.py")


def test_rowwise_kernels_under_the_interpreter() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.fail("Triton is not installed: pip install triton (make test-all does)")
    result = subprocess.run(
        [sys.executable, str(CHECK)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "log_softmax_stats: float64 agreement and row invariance ok" in result.stdout
