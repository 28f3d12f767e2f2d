"""Operations: the server speaks systemd's notify protocol (READY, WATCHDOG, STOPPING), and the
unit and launch script in deploy/ are consistent with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from server_process import start_server

from tokenmill.frontend.systemd_notify import SystemdNotifier

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_notifier_sends_datagrams_and_computes_the_watchdog(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        notifier = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "3000000"})
        notifier.notify("READY=1")
        assert sock.recv(100) == b"READY=1"
    assert notifier.watchdog_interval_s == 1.5
    assert not SystemdNotifier({}).enabled  # outside systemd: a no-op
    other = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None  # the watchdog is some other process's


def test_server_reports_ready_watchdog_and_stopping(tiny_checkpoint, tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}
    server = start_server(
        tiny_checkpoint("llama"), tmp_path / "log", "--kv-cache-tokens", "1024", env=env
    )
    try:
        messages = [sock.recv(1000).decode() for _ in range(3)]
        assert messages[0].startswith("READY=1\nSTATUS=serving")
        assert messages[1:] == ["WATCHDOG=1", "WATCHDOG=1"]
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if sock.recv(1000) == b"STOPPING=1":
                break
        else:
            raise AssertionError("no STOPPING=1")
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
        sock.close()


def test_unit_and_launch_script_agree() -> None:
    unit = (DEPLOY / "tokenmill.service").read_text()
    for line in (
        "Type=notify",
        "Restart=on-failure",
        "KillSignal=SIGTERM",
        "ExecStart=/usr/local/bin/tokenmill-launch",
        "WatchdogSec=",
    ):
        assert line in unit
    script = DEPLOY / "tokenmill-launch"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = {
        **os.environ,
        "TOKENMILL_MODEL": "/srv/m",
        "TOKENMILL_TP": "2",
        "TOKENMILL_ARGS": "--decode-steps 4",
        "TOKENMILL_PORT": "9000",
    }
    out = subprocess.run(
        [str(script), "--dry-run"], env=env, check=True, capture_output=True, text=True
    ).stdout.split()
    assert out[:2] == ["tokenmill", "serve"]
    for flag, value in (
        ("--tensor-parallel-size", "2"),
        ("--model", "/srv/m"),
        ("--port", "9000"),
        ("--decode-steps", "4"),
    ):
        assert out[out.index(flag) + 1] == value


def test_launch_script_passes_the_multi_node_settings() -> None:
    env = {
        **os.environ,
        "TOKENMILL_NNODES": "2",
        "TOKENMILL_NODE_RANK": "1",
        "TOKENMILL_DIST_INIT_ADDR": "10.0.0.1:29500",
        "TOKENMILL_CLUSTER_KEY_FILE": "/etc/tokenmill/cluster.key",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    }
    env.pop("TOKENMILL_TP", None)
    script = str(DEPLOY / "tokenmill-launch")
    out = subprocess.run(
        [script, "--dry-run"], env=env, check=True, capture_output=True, text=True
    ).stdout.split()
    for flag, value in (
        ("--tensor-parallel-size", "8"),  # four GPUs here, times two nodes
        ("--nnodes", "2"),
        ("--node-rank", "1"),
        ("--dist-init-addr", "10.0.0.1:29500"),
        ("--cluster-key-file", "/etc/tokenmill/cluster.key"),
    ):
        assert out[out.index(flag) + 1] == value
    del env["TOKENMILL_DIST_INIT_ADDR"]
    missing = subprocess.run([script, "--dry-run"], env=env, capture_output=True, text=True)
    assert missing.returncode != 0 and "HOST:PORT of node 0" in missing.stderr


def test_health_means_alive_and_stepping() -> None:
    from tokenmill.frontend.engine.client import EngineStats

    stats = EngineStats()
    assert stats.healthy()
    stats.last_report -= 121  # the controller stopped reporting: stuck
    assert not stats.healthy()
    stats.last_report += 121
    stats.alive = False
    assert not stats.healthy()
