"""The CPU worker keeps the host memory it frees for the next step (tp_worker.cpu.host_memory)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# NOTE: a fresh process each, since the setting is for the whole process. Twelve calls of a
# gate_up layer with its SiLU epilogue on 8,192 rows, as a large prefill step runs it: its
# ~32 MiB output (glibc's automatic mmap threshold stops at 32 MiB) made and freed each time.
# With the setting the first calls may grow the heap (torch's aligned allocations ask for a
# little more than the block just freed, until freed blocks merge: up to 7 calls, by 4-8
# outputs, in 6 probes here), then none does.
PROBE = """
import resource, sys
import torch
from tokenmill.tp_worker.cpu.ops import PackedLinear
from tokenmill.tp_worker.cpu.host_memory import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
layer = PackedLinear(torch.randn(4096, 768).bfloat16(), None, glu=True)
x = torch.randn(8192, 768).bfloat16()
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    layer(x)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(took, *faults)
"""


def _faults(mode: str) -> tuple[str, list[int]]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], [int(n) for n in out[1:]]


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)
def test_a_freed_activation_is_reused_without_page_faults() -> None:
    took, faults = _faults("keep")
    assert took == "True"
    assert sum(faults[-3:]) < 100, faults  # its 8,192 pages come back from the heap
    _, default_faults = _faults("default")
    assert min(default_faults[-3:]) > 4_000, default_faults  # mapped afresh every time


def test_a_cpu_worker_keeps_its_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker process sets it up as it joins its group, for a CPU device only."""
    from tokenmill.tp_worker import worker_process
    from tokenmill.tp_worker.config import RunnerConfig, WorkerConfig

    calls: list[bool] = []
    monkeypatch.setattr(worker_process, "keep_freed_memory", lambda: calls.append(True))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # NOTE: leaves this process's threads alone
    runner = RunnerConfig(model="unused", device="cpu")
    config = WorkerConfig(runner, 0, 1, "tcp://127.0.0.1:1", "ipc:///unused", "ipc:///unused")
    assert worker_process.init_distributed(config).device == "cpu"
    assert calls == [True]
