"""Every socket has one typed decoder: a frame that does not decode is logged and dropped,
and the next good frame still arrives."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import zmq

from tokenmill.controller.config import ControllerConfig
from tokenmill.controller.controller import ControllerSockets
from tokenmill.protocol.arrays import pack
from tokenmill.protocol.requests import (
    AbortRequest,
    DetokenizeParams,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
)
from tokenmill.protocol.step import WorkerReady


def test_controller_drops_frames_it_cannot_decode(tmp_path: Path) -> None:
    def ipc(name: str) -> str:
        return f"ipc://{tmp_path / name}"

    config = ControllerConfig(
        ipc("requests"),
        (ipc("worker0"),),
        ipc("results"),
        ipc("outputs"),
        ipc("reports"),
        max_running_requests=4,
        max_prefill_tokens=64,
    )
    sockets = ControllerSockets(config)
    context = zmq.Context()
    try:
        frontend = context.socket(zmq.PUSH)
        frontend.connect(config.request_addr)
        worker = context.socket(zmq.PUSH)
        worker.connect(config.result_addr)
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
        worker.send(b"\x00not a worker message")
        ready = WorkerReady(kv_cache_tokens=8, max_model_len=8, eos_token_ids=(1,))
        worker.send(msgspec.msgpack.encode(ready))
        assert sockets.receive_result() == ready
    finally:
        context.destroy(linger=0)
        sockets.context.destroy(linger=0)
