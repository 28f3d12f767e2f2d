"""Frames from a ZeroMQ PULL socket into a callback, from the event loop's reader on the
socket's file descriptor (main process: the detokenized outputs' input).

zmq.asyncio makes a future for every receive and reads the socket's state through Enum
flags: on a one-user stream that was ~0.1 ms of the frontend's CPU a token (py-spy: Flag
arithmetic and _AsyncSocket._handle_events a quarter of its samples), on the two cores the
model's threads use. Here a readable descriptor drains every frame waiting, each handed to
the callback at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)


class FrameReader:
    def __init__(self, sock: zmq.Socket, on_frame: Callable[[bytes], None]) -> None:
        self._sock = sock
        self._on_frame = on_frame
        self._fd = int(sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._fd, self._drain)
        # NOTE: the descriptor is edge-triggered: frames that came before it was watched
        # raise no new edge, so look once now.
        loop.call_soon(self._drain)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None

    def _drain(self) -> None:
        # NOTE: until EAGAIN: the descriptor signals again only after the socket's queue
        # has been read empty.
        while self._loop is not None:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            # NOTE: a callback that raised must not end the drain: the frames left behind
            # would raise no new edge, and the outputs would stop.
            try:
                self._on_frame(frame)
            except Exception:
                logger.exception("the outputs' handler failed on a frame; it is dropped")
