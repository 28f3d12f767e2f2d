"""Shared by the Triton checks run under TRITON_INTERPRET=1 (tests/triton_*_check.py) and the
slow tests that run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_check(name: str, *args: str) -> str:
    """tests/NAME in a subprocess under Triton's interpreter (TRITON_INTERPRET=1, which must be
    set before Triton is imported); its output, once it has exited 0."""
    import pytest

    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.fail("Triton is not installed: pip install triton (make test-all does)")
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(name)), *args],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def rowwise_interpreted_dot() -> None:
    """NOTE: the interpreter runs tl.dot as one numpy (BLAS) product of the two tiles, whose
    bits for a row depend on its place in the tile (BLAS treats the rows of a panel in groups
    of unequal code), and leaves bfloat16 operands as raw bits; a GPU's tensor cores compute
    every row of a tile alike, from bfloat16 into float32. Here each slice's product is taken
    in float64 from the operands' values and rounded once to the accumulator's dtype (BLAS's
    float32 order for a column can follow the panel's width), so what is checked is the
    kernel's own part: its tiles, its masks and its K order do not depend on the number of
    rows nor on the tile's shape."""
    import numpy as np
    from triton.runtime import interpreter

    def operand(t) -> np.ndarray:
        """bfloat16 is kept as its uint16 bits there (and its dot is left undone)."""
        if t.data.dtype == np.uint16:
            return (t.data.astype(np.uint32) << 16).view(np.float32)
        return t.data

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ARG001
        x, w = operand(a), operand(b)
        exact = np.matmul(x.astype(np.float64), w.astype(np.float64))
        return interpreter.TensorHandle(exact.astype(d.data.dtype) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = dot
