"""Every socket has one typed decoder: a frame that does not decode is logged and dropped,
and the next good frame still arrives."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from tokenmill.controller.config import ControllerConfig
from tokenmill.controller.controller import ControllerSockets
from tokenmill.protocol.arrays import pack
from tokenmill.protocol.outputs import BatchOutput, RequestOutput
from tokenmill.protocol.requests import (
    AbortRequest,
    DetokenizeParams,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
)
from tokenmill.protocol.step import WorkerReady
from tokenmill.protocol.step_channel import FrameListener, FrameStream


def _controller_config(tmp_path: Path) -> ControllerConfig:
    """ZeroMQ for requests and reports, frame streams for the rest, as the launcher has it."""
    return ControllerConfig(
        f"ipc://{tmp_path / 'requests'}",
        (f"unix://{tmp_path / 'worker0'}",),
        f"unix://{tmp_path / 'results'}",
        f"unix://{tmp_path / 'outputs'}",
        f"ipc://{tmp_path / 'reports'}",
        max_running_requests=4,
        max_prefill_tokens=64,
    )


def test_controller_drops_frames_it_cannot_decode(tmp_path: Path) -> None:
    config = _controller_config(tmp_path)
    detokenizer = FrameListener(config.detokenizer_addr)  # NOTE: the controller connects
    sockets = ControllerSockets(config)
    context = zmq.Context()
    try:
        frontend = context.socket(zmq.PUSH)
        frontend.connect(config.request_addr)
        good = GenerateRequest(
            "r1",
            pack(np.array([1, 2], np.int32)),
            SamplingParams(max_tokens=2),
            LogprobParams(),
            DetokenizeParams(),
        )
        for frame in (
            b"garbage",
            msgspec.msgpack.encode({"type": "generate", "x": 1}),
            msgspec.msgpack.encode(good),
            msgspec.msgpack.encode(AbortRequest("r1")),
        ):
            frontend.send(frame)
        received = []
        for _ in range(50):
            received += sockets.receive_requests(timeout_ms=100)
            if len(received) == 2:
                break
        assert received == [good, AbortRequest("r1")]
        worker = FrameStream.connect(config.result_addr)
        batches = FrameStream.connect(config.worker_addrs[0])
        worker.send(b"\x00not a worker message")
        ready = WorkerReady(kv_cache_tokens=8, max_model_len=8, eos_token_ids=(1,))
        worker.send(msgspec.msgpack.encode(ready))
        assert sockets.receive_result() == ready
        sockets.send_batch(ready)  # NOTE: any message: the channel carries frames
        assert msgspec.msgpack.decode(batches.recv(), type=WorkerReady) == ready
        outputs = BatchOutput([RequestOutput("r1", pack(np.array([5], np.int32)))])
        sockets.send_outputs(outputs)  # NOTE: to the detokenizer, a frame stream too
        assert detokenizer.poll(5.0)
        assert msgspec.msgpack.decode(detokenizer.recv(), type=BatchOutput) == outputs
        assert not detokenizer.poll(0.05)
        worker.close()
        with pytest.raises(EOFError):
            sockets.receive_result()  # NOTE: rank 0 gone: the controller fails, not hangs
    finally:
        context.destroy(linger=0)
        sockets.context.destroy(linger=0)
        detokenizer.close()


def test_a_rank_s_step_input_is_a_frame_stream_or_tcp(tmp_path: Path) -> None:
    config = replace(_controller_config(tmp_path), worker_addrs=(f"ipc://{tmp_path / 'w'}",))
    detokenizer = FrameListener(config.detokenizer_addr)
    try:
        with pytest.raises(ValueError, match="unix:// or tcp://"):
            ControllerSockets(config)
    finally:
        detokenizer.close()


@pytest.mark.parametrize("size", [0, 1, 7, 8, 4096, 3 << 20])
def test_step_channel_carries_whole_frames_in_order(tmp_path: Path, size: int) -> None:
    addr = f"unix://{tmp_path / 'channel'}"
    frames = [bytes(range(256)) * (size // 256) + bytes(size % 256), b"next", b""]
    got: list[bytes] = []

    def rank() -> None:
        # NOTE: it may come first: it retries until the controller has bound
        stream = FrameStream.connect(addr)
        got.extend(bytes(stream.recv()) for _ in frames)
        stream.send(b"back" * size)
        stream.close()

    thread = threading.Thread(target=rank)
    thread.start()
    time.sleep(0.05)
    listener = FrameListener(addr)
    try:
        for frame in frames:
            listener.send(frame)
        assert bytes(listener.recv()) == b"back" * size
        thread.join(timeout=10)
        assert got == frames
        with pytest.raises(EOFError):
            listener.recv()
    finally:
        listener.close()
    assert not Path(addr[len("unix://") :]).exists()
