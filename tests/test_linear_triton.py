"""The Triton linear kernel (the CUDA backend's linear layers and lm_head) run on the CPU by
Triton's interpreter: against float64 products in float32 and bfloat16, every row alone bit
for bit as in batches of any size, the output rounded once from float32.

    pip install triton && pytest -m slow tests/test_linear_triton.py   (make test-all)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHECK = Path(__file__).with_name("triton_linear_check.py")


def test_triton_linear_under_the_interpreter() -> None:
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
    assert "torch.bfloat16: float64 agreement and row invariance ok" in result.stdout
