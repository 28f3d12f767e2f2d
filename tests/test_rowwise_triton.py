"""The row-local Triton kernels (RMSNorm, the log-softmax's max and log-sum: the CUDA path's
row reductions) run on the CPU by Triton's interpreter: against float64, every row alone bit
for bit as in batches of any size.

    pip install triton && pytest -m slow tests/test_rowwise_triton.py   (make test-all)
"""

from __future__ import annotations

import pytest
from triton_interpreter import run_check

pytestmark = pytest.mark.slow


def test_rowwise_kernels_under_the_interpreter() -> None:
    result = run_check("triton_rowwise_check.py")
    assert "log_softmax_stats: float64 agreement and row invariance ok" in result
