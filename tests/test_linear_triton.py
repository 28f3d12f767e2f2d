"""The Triton linear kernel (the CUDA backend's linear layers and lm_head) run on the CPU by
Triton's interpreter: against float64 products in float32 and bfloat16, every row alone bit
for bit as in batches of any size, the output rounded once from float32.

    pip install triton && pytest -m slow tests/test_linear_triton.py   (make test-all)
"""

from __future__ import annotations

import pytest
from triton_interpreter import run_check

pytestmark = pytest.mark.slow


def test_triton_linear_under_the_interpreter() -> None:
    result = run_check("triton_linear_check.py")
    assert "torch.bfloat16: float64 agreement and row invariance ok" in result
