"""The invariance tests again, in subprocesses, under dispatch settings this machine would
not pick by itself: the kernels an AVX2-only CPU gets (torch's own vectorised ops, MKL,
oneDNN), torch's unvectorised ops with oneDNN's AVX-512 kernels of a CPU without
avx512_bf16, and one thread instead of two. A guarantee that rests on one CPU's kernel
choice fails here, on any developer's machine. And once with every fresh allocation filled
with 0x7f bytes (huge floats, bfloat16s near the largest): the attention kernels' scratch is
never zeroed, so no result may depend on what it held."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SETTINGS = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "unvectorised-no-bf16": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "one-thread": {"OMP_NUM_THREADS": "1"},
    "scratch-filled": {"MALLOC_PERTURB_": "128"},  # NOTE: glibc fills with 128 ^ 0xff
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_invariance_under_other_dispatch(setting: str, tmp_path: Path) -> None:
    env = {**os.environ, **SETTINGS[setting]}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--basetemp={tmp_path}",
            str(TESTS / "test_invariance.py"),
            str(TESTS / "test_attention_cpu.py"),
            str(TESTS / "test_cpu_ops.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
