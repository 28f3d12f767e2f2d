"""Shared by the benchmarks: start and stop one `tokenmill serve`, read its /metrics.

Benchmarks are scripts (python benchmarks/NAME.py); this module sits next to them.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def demo_model(preset: str) -> Path:
    """The llama demo checkpoint of `preset`, built once into ~/.cache/tokenmill."""
    from tokenmill.frontend.demo_checkpoint import demo_checkpoint

    return demo_checkpoint("llama", preset)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=1.0) as response:
            return response.status == 200
    except OSError:
        return False


def start_server(
    model: Path, server_args: list[str], log_path: Path, timeout: float = 600.0
) -> tuple[subprocess.Popen, str]:
    """`tokenmill serve --model MODEL *server_args` on a free port, once /health answers."""
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "tokenmill.frontend.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        *server_args,
    ]
    log = open(log_path, "wb")  # noqa: SIM115 (the server writes it until it stops)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log_path}")
        if _healthy(base_url):
            return proc, base_url
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server not healthy after {timeout} s; log: {log_path}")


def stop_server(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def read_metrics(base_url: str) -> dict[str, float]:
    """The server's Prometheus samples, name (with labels) -> value."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
