"""Faults: a child process that dies fails the requests in flight and takes the server down
with a non-zero exit, leaving no process and no runtime directory behind; SIGTERM drains."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import openai
import pytest
from server_process import start_server


def children_of(pid: int) -> dict[int, str]:
    """Processes whose parent is `pid`, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found[int(entry.name)] = cmdline
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def assert_gone(pids, timeout: float = 10.0) -> None:
    """Every process of `pids` exits within `timeout` (no orphan outlives the server)."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "orphan processes left"


def streaming_request(server, errors: list[BaseException], max_tokens: int) -> threading.Thread:
    """long_request in a thread, once its first token has arrived: the request is in flight.
    NOTE: its first token, not the running-requests gauge: the gauge is reported every 0.25 s,
    and the tiny model can stream much of 2,000 tokens in that time."""
    streaming = threading.Event()
    thread = threading.Thread(target=long_request, args=(server, errors, max_tokens, streaming))
    thread.start()
    assert streaming.wait(timeout=30), "the request never streamed"
    return thread


def long_request(
    server,
    errors: list[BaseException],
    max_tokens: int = 900,
    streaming: threading.Event | None = None,
    client: openai.OpenAI | None = None,
    together: threading.Barrier | None = None,
) -> None:
    """A stream long enough to be in flight when a test breaks the server; the error it
    must end in (not a hang, not a success) goes to `errors`. `streaming` is set when its
    first token arrives; `together`: the streams sharing it are sent at once (made with
    their clients beforehand, which take a while to build)."""
    client = client or openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    if together is not None:
        together.wait(30)
    try:
        for _ in client.completions.create(
            model=server.model,
            prompt="x",
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if streaming is not None:
                streaming.set()
    except Exception as e:
        errors.append(e)


def wait_running(server, timeout: float = 30.0) -> None:
    """Until the engine reports a request running (so a signal cannot beat the request)."""
    deadline = time.monotonic() + timeout
    while server.metrics().get("tokenmill_num_requests_running", 0) < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


@pytest.mark.parametrize("victim", ["tokenmill.tp_worker", "tokenmill.detokenizer"])
def test_a_dead_child_fails_requests_and_stops_the_server(
    tiny_checkpoint, tmp_path: Path, victim: str
) -> None:
    server = start_server(
        tiny_checkpoint("llama"),
        tmp_path / "log",
        "--kv-cache-tokens",
        "4096",
        "--max-model-len",
        "2048",
    )
    try:
        check_a_dead_child_stops_the_server(server, victim)
    finally:
        server.stop()


def check_a_dead_child_stops_the_server(server, victim: str) -> None:
    children = children_of(server.proc.pid)
    assert len(children) == 3, children
    runtime_dir = re.search(r"ipc://(/[^/\"]+/tokenmill-[^/\"]+)/", " ".join(children.values()))[1]
    assert Path(runtime_dir).stat().st_mode & 0o777 == 0o700
    errors: list[BaseException] = []
    thread = streaming_request(server, errors, 2000)
    (pid,) = [p for p, cmd in children.items() if victim in cmd]
    os.kill(pid, signal.SIGKILL)
    code = server.proc.wait(timeout=30)
    thread.join(timeout=30)
    assert code != 0
    assert errors, "the request in flight must fail"
    assert_gone(children)
    assert not Path(runtime_dir).exists()
    assert "exited with status" in server.log()


def test_sigterm_drains_in_flight_requests(tiny_checkpoint, tmp_path: Path) -> None:
    server = start_server(tiny_checkpoint("llama"), tmp_path / "log", "--kv-cache-tokens", "4096")
    results: list[object] = []

    # NOTE: long enough to be seen running: the engine reports every 0.25 s, and the tiny
    # model's 200 tokens could start and end between two reports (one CI run in five failed so).
    def request() -> None:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(
            model=server.model, prompt="drain me", max_tokens=1000, extra_body={"ignore_eos": True}
        )
        results.append(r.usage.completion_tokens)

    try:
        thread = threading.Thread(target=request)
        thread.start()
        wait_running(server)
        server.proc.send_signal(signal.SIGTERM)
        thread.join(timeout=60)
        assert server.proc.wait(timeout=60) == 0
        assert results == [1000]
    finally:
        server.stop()


def test_a_launch_whose_port_was_taken_meanwhile_takes_another(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tokenmill serve` as a child (server_subprocess.launch) tries another free port when
    the one it chose is taken before the server binds it (once by the server's own ranks)."""
    from tokenmill.cli import server_subprocess

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    ports = [taken_port]
    chosen = server_subprocess.free_port

    def first_the_taken_one() -> int:
        return ports.pop() if ports else chosen()

    monkeypatch.setattr(server_subprocess, "free_port", first_the_taken_one)
    try:
        server = start_server(
            tiny_checkpoint("llama"), tmp_path / "log", "--kv-cache-tokens", "512"
        )
    finally:
        taken.close()
    try:
        assert not ports and server.port != taken_port
        assert server_subprocess.healthy(server.base_url)
    finally:
        server.stop()
