"""The step channel between the controller and the ranks on its node, and the controller's
outputs to its detokenizer: length-prefixed frames over a Unix-domain stream socket
(`unix://PATH`), written and read by the threads that use them.

A ZeroMQ socket hands every frame to an I/O thread on each side, so one step's batch and its
result cost six thread wake-ups between two processes; on a CPU server whose cores the model's
threads fill, each waits for a core. An 800-byte round trip between two processes on the
2-core EPYC here: median 131-161 us through ZeroMQ's ipc://, 27-30 us through this channel
(benchmarks/step_channel.py at c8228a0). The other channels (requests, detokenized outputs,
reports) stay ZeroMQ: their ends poll several sockets or run in an event loop. Ranks on other
nodes keep ZeroMQ over TCP with CURVE (`tcp://`).

The listening end (the controller for each rank's batches and rank 0's results, the
detokenizer for the controller's outputs) takes its peer's connection when it first sends,
receives or polls; the other end connects, retrying until the listener has bound. The
runtime directory the paths live in is private (mode 0700).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import time

SCHEME = "unix://"
_HEADER = struct.Struct("<Q")  # NOTE: the frame's length in bytes, before the frame


def is_step_channel(addr: str) -> bool:
    return addr.startswith(SCHEME)


def _path(addr: str) -> str:
    if not is_step_channel(addr):
        raise ValueError(f"not a {SCHEME} address: {addr!r}")
    return addr[len(SCHEME) :]


class FrameStream:
    """One connected end: whole frames in, whole frames out, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._header = bytearray(_HEADER.size)

    @staticmethod
    def connect(addr: str, timeout_s: float = 120.0) -> FrameStream:
        """Connects to the listener at `addr`, retrying while it is not there yet."""
        path = _path(addr)
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                return FrameStream(sock)
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def send(self, frame: bytes) -> None:
        # NOTE: header and frame in one system call (the frame is not copied to join them)
        header = _HEADER.pack(len(frame))
        sent = self._sock.sendmsg([header, frame])
        if sent < len(header) + len(frame):
            rest = memoryview(header + bytes(frame))[sent:]  # NOTE: large frames only
            self._sock.sendall(rest)

    def recv(self) -> bytearray:
        """The next frame; EOFError when the other end has closed."""
        self._read_into(memoryview(self._header))
        (length,) = _HEADER.unpack(self._header)
        frame = bytearray(length)
        self._read_into(memoryview(frame))
        return frame

    def _read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise EOFError("the step channel's other end closed")
            got += n

    def readable(self, timeout_s: float) -> bool:
        """Whether a frame (or the other end's close) has begun to arrive within timeout_s."""
        return bool(select.select([self._sock], [], [], timeout_s)[0])

    def close(self) -> None:
        self._sock.close()


class FrameListener:
    """The listening end of one channel (the controller's for a rank's batches or rank 0's
    results, the detokenizer's for the outputs): bound at once, connected at first use."""

    def __init__(self, addr: str) -> None:
        self._path = _path(addr)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self._path)
        self._sock.listen(1)
        self._stream: FrameStream | None = None

    def _connected(self) -> FrameStream:
        if self._stream is None:
            conn, _ = self._sock.accept()
            self._stream = FrameStream(conn)
        return self._stream

    def send(self, frame: bytes) -> None:
        self._connected().send(frame)

    def recv(self) -> bytearray:
        return self._connected().recv()

    def poll(self, timeout_s: float) -> bool:
        """Whether recv() has something to read within timeout_s (the connection, when it has
        not come yet, taken first if it comes in that time)."""
        if self._stream is None:
            if not select.select([self._sock], [], [], timeout_s)[0]:
                return False
            self._connected()
        assert self._stream is not None
        return self._stream.readable(timeout_s)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
