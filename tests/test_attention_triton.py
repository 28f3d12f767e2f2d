"""The Triton paged attention (the CUDA backend's kernel) run on the CPU by Triton's
interpreter (slow: ~25 s): against float64 attention in float32 and bfloat16, with and
without a sliding window, decode rows and prompt chunks after a prefix, across splits;
every row alone bit for bit as in its batch; the whole model on it against the torch path.

    pip install triton && pytest -m slow tests/test_attention_triton.py   (make test-all)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHECK = Path(__file__).with_name("triton_attention_check.py")


def test_triton_attention_under_the_interpreter(tiny_checkpoint) -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.fail("Triton is not installed: pip install triton (make test-all does)")
    model = tiny_checkpoint("mistral", "sentencepiece")
    result = subprocess.run(
        [sys.executable, str(CHECK), str(model)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "model on Triton = on SDPA" in result.stdout
