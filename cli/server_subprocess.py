"""`tokenmill serve` as a child of another program (tests, benchmarks, notebooks): start it on
a free loopback port, wait until /health answers, stop it with the SIGTERM systemd sends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tokenmill.frontend.engine.cluster_layout import free_port


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=1.0) as response:
            return response.status == 200
    except OSError:
        return False


# NOTE: a free port is free only when it is looked at: the server's own ranks take free
# ports of their own (torch.distributed's store) and once took the one chosen here first
# (address already in use, a TP=2 test, 2026-12-05). Another port is tried then.
PORT_TRIES = 3


def launch(
    model: Path | str | None,
    server_args: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
) -> tuple[subprocess.Popen, str]:
    """Starts `tokenmill serve --model MODEL *server_args` (no --model: the default model;
    output to `log_path`) and returns it with its base URL once healthy; raises with the
    log's tail if it dies or hangs."""
    for attempt in range(PORT_TRIES):
        try:
            return _launch_once(model, server_args, log_path, env, timeout)
        except _PortTaken:
            if attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


class _PortTaken(RuntimeError):
    pass


def _launch_once(
    model: Path | str | None,
    server_args: list[str],
    log_path: Path,
    env: dict[str, str] | None,
    timeout: float,
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    model_args = [] if model is None else ["--model", str(model)]
    argv = [
        sys.executable,
        "-m",
        "tokenmill.cli.main",
        "serve",
        *model_args,
        "--port",
        str(port),
        *server_args,
    ]
    log = open(log_path, "wb")  # noqa: SIM115 (the server writes it until it stops)
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = _tail(log_path)
            if f"'127.0.0.1', {port}): address already in use" in tail:
                raise _PortTaken(tail)
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail}")
        if healthy(base_url):
            return proc, base_url
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"server not healthy after {timeout} s:\n{_tail(log_path)}")


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM (the server drains), then SIGKILL after `timeout`; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:]
