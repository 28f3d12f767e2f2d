"""The real EngineClient: requests go to the controller, outputs come from the detokenizer,
engine reports from the controller, all over ZeroMQ with msgspec frames (main process).

With --data-parallel-size D there are D engines (controller, ranks, detokenizer each): a
request goes to the one replica_router.py picks, and its abort follows it there; every
detokenizer and controller sends to the same two inputs here. The outputs' socket is read
by the event loop's reader on it (frame_reader.py), the reports' by a task; both dispatch
to per-request queues. When the engine dies every open request gets
EngineDeadError; a request whose consumer goes away is aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from tokenmill.frontend.engine.client import EngineDeadError, EngineStats
from tokenmill.frontend.engine.frame_reader import FrameReader
from tokenmill.frontend.engine.replica_router import ReplicaRouter
from tokenmill.protocol.control import ControlCommand, ControlReply
from tokenmill.protocol.outputs import DetokenizedBatch, DetokenizedOutput
from tokenmill.protocol.process import ServingPriority
from tokenmill.protocol.requests import AbortRequest, GenerateRequest
from tokenmill.protocol.stats import EngineReport

logger = logging.getLogger(__name__)

_DEAD = object()


class ZmqEngineClient:
    def __init__(
        self,
        request_addrs: list[str],
        output_addr: str,
        report_addr: str,
        priority: ServingPriority | None = None,
    ) -> None:
        self.context = zmq.asyncio.Context()
        self.requests = [self._socket(zmq.PUSH, a, bind=False) for a in request_addrs]
        # NOTE: a plain socket on the same context, read by the event loop's reader
        self.outputs: zmq.Socket = zmq.Context.shadow(self.context.underlying).socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.bind(output_addr)
        self._output_decoder = msgspec.msgpack.Decoder(DetokenizedBatch)
        self._outputs_reader = FrameReader(self.outputs, self._handle_outputs)
        self.reports = self._socket(zmq.PULL, report_addr, bind=True)
        self.encoder = msgspec.msgpack.Encoder()
        replicas = len(request_addrs)
        self.stats = EngineStats(alive=True)
        if replicas > 1:
            self.stats.replicas = [EngineStats() for _ in range(replicas)]
        self.router = ReplicaRouter(replicas)
        self.ready = asyncio.Event()
        self._ready_replicas: set[int] = set()
        self.max_model_len = 0
        self.draining = False  # set on SIGTERM: the app refuses new requests with 503
        self._dead_why = ""
        self._queues: dict[str, asyncio.Queue] = {}
        # NOTE: this process's niceness follows the requests in flight (ServingPriority).
        self._priority = priority or ServingPriority(0)
        self._replica_of: dict[str, int] = {}
        self._tasks: list[asyncio.Task] = []
        self._controls: dict[str, asyncio.Future[ControlReply]] = {}  # by ctl_id

    def _socket(self, kind: int, addr: str, bind: bool) -> zmq.asyncio.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        (sock.bind if bind else sock.connect)(addr)
        return sock

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def start(self) -> None:
        self._outputs_reader.start(asyncio.get_running_loop())
        self._tasks = [asyncio.create_task(self._receive_reports())]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[DetokenizedOutput]:
        if not self.stats.alive:
            raise EngineDeadError("the engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.req_id] = queue
        self._priority.update(len(self._queues))
        replica = self._route(request)
        finished = False
        try:
            await self.requests[replica].send(self.encoder.encode(request))
            while not finished:
                item = await queue.get()
                if item is _DEAD:
                    raise EngineDeadError(self._dead_why)
                finished = item.finish_reason is not None
                yield item
        finally:
            self._queues.pop(request.req_id, None)
            self._priority.update(len(self._queues))
            if not finished and self.stats.alive:
                await self.abort(request.req_id)
            self._replica_of.pop(request.req_id, None)
            self.router.finished(replica)

    def _route(self, request: GenerateRequest) -> int:
        replica = self.router.pick(request.input_ids.data)
        self._replica_of[request.req_id] = replica
        return replica

    async def abort(self, req_id: str) -> None:
        replica = self._replica_of.get(req_id, 0)
        await self.requests[replica].send(self.encoder.encode(AbortRequest(req_id)))

    async def control(self, make: Callable[[str], ControlCommand]) -> ControlReply:
        if not self.stats.alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        waits = []
        for sock in self.requests:
            ctl_id = uuid.uuid4().hex
            future: asyncio.Future[ControlReply] = loop.create_future()
            self._controls[ctl_id] = future
            waits.append(future)
            await sock.send(self.encoder.encode(make(ctl_id)))
        try:
            replies = await asyncio.gather(*waits)
        finally:
            for future in waits:
                future.cancel()
        worst = max(replies, key=lambda r: r.status)
        self.stats.weight_version = worst.weight_version
        return worst

    def mark_dead(self, why: str = "the engine stopped while the request ran") -> None:
        """Fails every request in flight with EngineDeadError(why); no new one starts."""
        self.stats.alive = False
        self._dead_why = why
        for queue in self._queues.values():
            queue.put_nowait(_DEAD)
        for future in self._controls.values():
            if not future.done():
                future.set_exception(EngineDeadError(why))

    def _handle_outputs(self, frame: bytes) -> None:
        try:
            batch = self._output_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.error("dropped a frame that is not a DetokenizedBatch: %s", e)
            return
        for output in batch.outputs:
            queue = self._queues.get(output.req_id)
            if queue is not None:
                queue.put_nowait(output)

    async def _receive_reports(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineReport | ControlReply)
        while True:
            frame = await self.reports.recv()
            try:
                report = decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("dropped a frame that is not an EngineReport: %s", e)
                continue
            if isinstance(report, ControlReply):
                future = self._controls.pop(report.ctl_id, None)
                if future is not None and not future.done():
                    future.set_result(report)
                continue
            self._update_stats(report)

    def _update_stats(self, report: EngineReport) -> None:
        if not 0 <= report.replica < len(self.requests):
            logger.error("dropped a report from replica %d", report.replica)
            return
        s = self.stats.per_replica()[report.replica]
        s.num_running, s.num_waiting = report.num_running, report.num_waiting
        s.kv_slots_total, s.kv_slots_free = report.kv_slots_total, report.kv_slots_free
        s.prefix_queried_tokens = report.prefix_queried_tokens
        s.prefix_hit_tokens = report.prefix_hit_tokens
        if report.spec_accepted_per_pos:
            s.spec = (
                report.spec_num_drafts,
                report.spec_num_draft_tokens,
                report.spec_num_accepted_tokens,
                report.spec_accepted_per_pos,
            )
        s.extra["prefix_cache_tokens"] = report.prefix_cached_tokens
        if report.max_loras:
            s.lora = (report.max_loras, report.lora_running, report.lora_waiting)
        self.stats.weight_version = report.weight_version
        s.extra.update(report.step_timing)
        s.last_report = time.monotonic()
        s.extra["num_steps"] = report.num_steps
        s.extra["num_preemptions"] = report.num_preemptions
        self.max_model_len = report.max_model_len
        if report.ready:
            self._ready_replicas.add(report.replica)
            if len(self._ready_replicas) == len(self.requests):
                self.ready.set()

    def close(self) -> None:
        self._outputs_reader.stop()
        for task in self._tasks:
            task.cancel()
        self.outputs.close(linger=0)
        self.context.destroy(linger=0)
