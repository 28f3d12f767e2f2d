"""The frontend's outputs reader (frontend/engine/frame_reader.py) on real ZeroMQ sockets:
frames that came before it started, bursts drained in one wake-up, the frames after one its
handler failed on, nothing after stop."""

from __future__ import annotations

import asyncio

import zmq

from tokenmill.frontend.engine.frame_reader import FrameReader


async def _wait_for(frames: list[bytes], count: int) -> None:
    for _ in range(200):
        if len(frames) >= count:
            return
        await asyncio.sleep(0.01)


def test_reader_takes_early_frames_bursts_and_stops(tmp_path) -> None:
    async def main() -> None:
        context = zmq.Context()
        pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        addr = f"ipc://{tmp_path}/outputs"
        pull.bind(addr)
        push.connect(addr)
        frames: list[bytes] = []
        reader = FrameReader(pull, frames.append)
        for i in range(3):  # NOTE: queued before the reader watches the descriptor
            push.send(b"early %d" % i)
        await asyncio.sleep(0.05)
        reader.start(asyncio.get_running_loop())
        await _wait_for(frames, 3)
        assert frames == [b"early 0", b"early 1", b"early 2"]
        for i in range(500):
            push.send(b"burst %d" % i)
        await _wait_for(frames, 503)
        assert frames[3:] == [b"burst %d" % i for i in range(500)]
        push.send(b"one more")
        await _wait_for(frames, 504)
        assert frames[-1] == b"one more"

        def fail_once(frame: bytes) -> None:
            if frame == b"bad":
                raise ValueError("a handler that fails")
            frames.append(frame)

        reader.stop()
        reader = FrameReader(pull, fail_once)
        reader.start(asyncio.get_running_loop())
        for frame in (b"bad", b"good 1", b"good 2"):
            push.send(frame)
        await _wait_for(frames, 506)
        assert frames[-2:] == [b"good 1", b"good 2"]
        reader.stop()
        push.send(b"after stop")
        await asyncio.sleep(0.1)
        assert len(frames) == 506
        pull.close(linger=0)
        push.close(linger=0)
        context.term()

    asyncio.run(main())
