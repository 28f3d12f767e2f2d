"""The controller process: receives requests, schedules steps, sends them to the tp_workers,
turns their results into per-request outputs for the detokenizer.

Its loop reads as a table of contents: receive, schedule, step, emit, report.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import get_args

import msgspec
import numpy as np
import zmq

from tokenmill.controller.batch_builder import BatchBuilder
from tokenmill.controller.config import ControllerConfig
from tokenmill.controller.control import ControlPlane
from tokenmill.controller.grammar import GrammarEngine
from tokenmill.controller.kv_allocator import KvAllocator
from tokenmill.controller.lora_registry import LoraRegistry
from tokenmill.controller.output_processor import OutputProcessor
from tokenmill.controller.request import Request
from tokenmill.controller.routed_experts import RoutedExperts
from tokenmill.controller.scheduler import ScheduledRow, Scheduler
from tokenmill.controller.slot_pool import IndexPool
from tokenmill.controller.speculation import DraftState, SpeculativeConfig, Speculator
from tokenmill.controller.step_timing import StepTiming
from tokenmill.protocol.arrays import empty, pack, unpack
from tokenmill.protocol.cluster import Authenticator, ClusterKey
from tokenmill.protocol.control import ControlCommand, ControlReply
from tokenmill.protocol.outputs import NO_ADAPTER, BatchOutput, RequestOutput
from tokenmill.protocol.process import exit_with_parent, setup_process
from tokenmill.protocol.requests import AbortRequest, FrontendMessage, GenerateRequest
from tokenmill.protocol.stats import EngineReport
from tokenmill.protocol.step import (
    GrammarMask,
    StepResult,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
)
from tokenmill.protocol.step_channel import FrameListener, FrameStream, is_step_channel

logger = logging.getLogger(__name__)


class Controller:
    def __init__(
        self,
        config: ControllerConfig,
        ready: WorkerReady,
        sockets: ControllerSockets,
        grammar: GrammarEngine | None = None,
    ) -> None:
        self.config = config
        self.sockets = sockets
        self.grammar = grammar
        self.slots = IndexPool(ready.kv_cache_tokens, "kv slots")
        self.rows = IndexPool(config.max_running_requests, "table rows")
        self.kv = KvAllocator(self.slots, config.enable_prefix_cache)
        self.timing = StepTiming(enabled=config.step_timing)
        spec = SpeculativeConfig.parse(config.speculative_config)
        self.speculator = None if spec is None else Speculator(spec)
        # (step id, when sent) of a one-iteration step sent with none in flight
        self.timed_step = (0, 0.0)
        self.scheduler = Scheduler(
            self.kv,
            self.rows,
            config.max_running_requests,
            config.max_prefill_tokens,
            max_model_len=ready.max_model_len,
            decode_steps=config.decode_steps,
            speculator=self.speculator,
        )
        # NOTE: --enable-return-routed-experts: each slot's experts, and the slots of each
        # step in flight (in the order its result logs them)
        self.routing = (
            None if ready.routing is None else RoutedExperts(ready.routing, ready.kv_cache_tokens)
        )
        self.routed_slots: dict[int, np.ndarray] = {}
        self.outputs = OutputProcessor(
            ready.eos_token_ids, ready.max_model_len, self.speculator, self.routing
        )
        self.batches = BatchBuilder()
        self.max_model_len = ready.max_model_len
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_arrivals = 0
        self.last_report = 0.0
        self.checked_at_step = -1  # num_steps when the pool and tree were last checked
        self.last_busy = 0.0  # when the last step was sent
        self.next_expiry_check = 0.0
        self.lora = (
            LoraRegistry(config.max_loras, config.lora_modules) if config.max_loras else None
        )
        self.control = ControlPlane(self, config.model_dir)
        self.handlers: dict[type, Callable] = {
            GenerateRequest: self.handle_generate,
            AbortRequest: self.handle_abort,
        }
        self.handlers.update(dict.fromkeys(get_args(ControlCommand), self.handle_control))
        self.pending_outputs: list[RequestOutput] = []  # emitted, not yet sent (flush_outputs)
        self.in_flight: deque[tuple[int, list[ScheduledRow]]] = deque()  # sent, not back
        # NOTE: steps in flight whose grammar masks are not sent yet, with the constrained
        # rows of each (in the batch's GrammarRows order)
        self.masks_due: dict[int, list[ScheduledRow]] = {}

    def run(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        """With overlap scheduling the next step goes out before the result of the one in
        flight is back, so the workers never wait for this process: its scheduling, batch
        building and output processing run while they compute. The rows of requests that
        the step in flight stops are wasted (one position each); no step waits for them."""
        self.receive(block=not self.has_work())
        self.expire_waiting()
        if self.control.holds:  # NOTE: paused, or memory given back: no step runs
            self.report()
            return
        rows = self.scheduler.schedule(ahead=bool(self.in_flight))
        if rows is None:  # NOTE: the scheduler needs the step in flight back first
            self.complete_steps(keep=0)
            rows = self.scheduler.schedule()
            assert rows is not None, "scheduling with no step in flight always decides"
        if rows:
            self.send_step(rows)
        self.complete_steps(keep=1 if rows and self.config.overlap_schedule else 0)
        if not rows or not self.has_work():
            self.flush_outputs()  # NOTE: no step will carry them out
        self.report()

    def has_work(self) -> bool:
        return (self.scheduler.has_work() and not self.control.holds) or bool(self.in_flight)

    def receive(self, block: bool) -> None:
        for message in self.sockets.receive_requests(timeout_ms=100 if block else 0):
            self.handlers[type(message)](message)

    def send_step(self, rows: list[ScheduledRow]) -> None:
        self.num_steps += 1
        self.last_busy = time.monotonic()
        if self.speculator is not None and not self.in_flight and self.scheduler.num_steps == 1:
            self.timed_step = (self.num_steps, time.perf_counter())
        batch = self.batches.build(self.num_steps, rows, self.scheduler.num_steps)
        self.sockets.send_batch(batch)
        self.in_flight.append((self.num_steps, rows))
        if self.routing is not None:
            self.routed_slots[self.num_steps] = RoutedExperts.step_slots(batch)
        grammar = batch.sampling.grammar
        if grammar is not None:
            self.masks_due[self.num_steps] = [rows[b] for b in unpack(grammar.rows).tolist()]
            self.send_due_masks()
        self.flush_outputs()
        self.cache_finished_prefills(rows)

    def cache_finished_prefills(self, rows: list[ScheduledRow]) -> None:
        """NOTE: at once, not when the step is back: every later step runs after it."""
        for row in rows:
            request = row.request
            if row.is_prefill and not request.is_prefill and not request.finished:
                self.kv.cache_computed(request)

    def complete_steps(self, keep: int) -> None:
        """Applies the results of the steps in flight, all but the `keep` newest."""
        while len(self.in_flight) > keep:
            step_id, rows = self.in_flight.popleft()
            result = self.receive_result(step_id)
            decode_only = not any(row.is_prefill for row in rows)
            self.timing.on_result(
                step_id,
                decode_only,
                result.busy_s,
                result.forward_s,
                len(rows),
                result.next_ids.shape[0],
            )
            if decode_only:
                self.time_decode_step(step_id, rows)
            if self.routing is not None:
                self.routing.record(self.routed_slots.pop(step_id), result.routed_experts)
            self.emit(self.outputs.apply(rows, result))
            self.send_due_masks()
            if keep:
                self.flush_outputs()  # NOTE: while the workers run the next step

    def time_decode_step(self, step_id: int, rows: list[ScheduledRow]) -> None:
        """Speculation's cost model learns from decode steps the workers ran alone."""
        if self.speculator is None or self.timed_step[0] != step_id:
            return
        seconds = time.perf_counter() - self.timed_step[1]
        self.speculator.cost.observe(sum(row.num_new for row in rows), seconds)

    def send_due_masks(self) -> None:
        """The grammar masks of the oldest step in flight, once every step before it is back:
        its constrained rows' grammars have then consumed every token before the one it
        samples. NOTE: sent while the workers run that step's forward pass, which does not
        need them; they read them just before sampling."""
        if not self.in_flight:
            return
        step_id = self.in_flight[0][0]
        rows = self.masks_due.pop(step_id, None)
        if rows is None:
            return
        assert self.grammar is not None, "a constrained request needs the grammar engine"
        # NOTE: a request stopped by the step before has no mask: its sample is dropped.
        matchers = [None if row.request.finished else row.request.grammar for row in rows]
        # NOTE: the step's iterations count every row's drafts: a constrained row with fewer
        # (or none) still needs a mask for each iteration the worker samples.
        steps = 1 + max(len(row.drafts) for row in self.in_flight[0][1])
        if steps > 1:
            masks = self.grammar.masks_along(matchers, [row.drafts for row in rows], steps)
        else:
            masks = self.grammar.masks(matchers)
        self.sockets.send_mask(GrammarMask(step_id, pack(masks)))

    def receive_result(self, step_id: int) -> StepResult:
        result = self.sockets.receive_result()
        if isinstance(result, WorkerFailed):
            raise RuntimeError(f"tp_worker failed step {result.step_id}: {result.message}")
        if not isinstance(result, StepResult) or result.step_id != step_id:
            raise RuntimeError(f"expected StepResult {step_id}, got {result!r:.200}")
        return result

    def emit(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finish_reason is not None:
                self._drop(self.requests[output.req_id])
        self.pending_outputs += outputs

    def flush_outputs(self) -> None:
        """Sends the outputs emitted so far to the detokenizer, in order. Called right after
        a step goes to the workers (or when no step follows), so that the detokenizer and the
        frontend turn a step's tokens into text while the next one runs, not while this
        process builds it."""
        if self.pending_outputs:
            self.sockets.send_outputs(BatchOutput(self.pending_outputs))
            self.pending_outputs = []

    def handle_generate(self, message: GenerateRequest) -> None:
        if message.req_id in self.requests:
            logger.error("duplicate req_id %s dropped", message.req_id)
            return
        request = Request.from_message(message, self.num_arrivals)
        if len(self.scheduler.waiting) >= self.config.max_queued_requests:
            detail = f"{len(self.scheduler.waiting)} requests wait already (--max-queued-requests)"
            self.end(request, "rejected", detail)  # NOTE: never queued, nothing to free
            return
        if message.lora_name and not self._bind_adapter(request):
            return
        if message.constraint is not None and not self._start_grammar(request):
            return
        if self.speculator is not None and message.speculative:
            request.drafts = DraftState()
        self.num_arrivals += 1
        self.requests[message.req_id] = request
        self.scheduler.waiting.append(request)

    def _bind_adapter(self, request: Request) -> bool:
        """The request's adapter slot and cache space; False (the request ended) where its
        adapter is not loaded (unloaded since the frontend checked the name)."""
        name = request.message.lora_name
        adapter = None if self.lora is None else self.lora.get(name)
        if adapter is None:
            self.end(request, NO_ADAPTER, f"the LoRA adapter `{name}` is not loaded")
            return False
        request.lora_slot, request.cache_space = adapter.slot, adapter.space
        return True

    def _start_grammar(self, request: Request) -> bool:
        """The request's matcher; False (the request ended with an error) where it cannot be
        built. NOTE: the frontend validated the grammar with the same tokenizer and limits,
        so this is a server without the engine (a fake model) or a bug, not bad input."""
        constraint = request.message.constraint
        assert constraint is not None
        if self.grammar is None:
            self.end(request, "error", "this engine runs no grammar constraints")
            return False
        matcher = self.grammar.matcher(constraint)
        if matcher.is_error():
            logger.error("grammar of %s does not compile: %s", request.req_id, matcher.get_error())
            self.end(request, "error", f"the {constraint.kind} constraint does not compile")
            return False
        request.grammar = matcher
        return True

    def handle_control(self, command: ControlCommand) -> None:
        reply = self.control.handle(command)
        self.flush_outputs()  # NOTE: the ends a pause or an update made, before the reply
        self.sockets.send_report(reply)

    def handle_abort(self, message: AbortRequest) -> None:
        request = self.requests.get(message.req_id)
        if request is not None:
            self.end(request, "abort")

    def expire_waiting(self) -> None:
        """Fails the requests that have waited past --queue-timeout without ever starting."""
        timeout = self.config.queue_timeout_s
        now = time.monotonic()
        if timeout <= 0 or not self.scheduler.waiting or now < self.next_expiry_check:
            return
        self.next_expiry_check = now + EXPIRY_CHECK_S
        for request in list(self.scheduler.waiting):
            if not request.admitted_before and now - request.queued_at > timeout:
                self.end(request, "queue_timeout", f"not started within {timeout:g} s")

    def end(self, request: Request, reason: str, detail: str | None = None) -> None:
        """Ends `request` outside a step: frees what it holds and tells the detokenizer (with
        its detokenize params, if it never had an output)."""
        request.finish_reason = reason
        # NOTE: before its slots are freed (the detokenizer's stop strings end requests so)
        routed = self.outputs.routed_experts(request)
        if request.req_id in self.requests:
            self._drop(request)
        output = RequestOutput(
            req_id=request.req_id,
            new_ids=_EMPTY_IDS,
            finish_reason=reason,
            finish_detail=detail,
            num_prompt_tokens=request.num_prompt_tokens,
            detokenize=request.announce(),
            routed_experts=routed,
        )
        self.pending_outputs.append(output)  # NOTE: after the request's earlier outputs

    def _drop(self, request: Request) -> None:
        self.scheduler.finish(request)
        del self.requests[request.req_id]

    def report(self) -> None:
        now = time.monotonic()
        if now - self.last_report < self.config.report_interval_s:
            return
        self.last_report = now
        # NOTE: the leak check walks the whole slot pool and prefix tree (~35 ms for the
        # ~480,000 slots of a default CPU server here), so it waits for a real pause
        # (integrity_idle_s): run in the gap between back-to-back requests (one user at a
        # time), it delayed the next one's first token by as much (256-token prompts,
        # max_tokens 1: median latency 75-100 ms with it, 50 ms without).
        idle = not self.has_work() and now - self.last_busy >= self.config.integrity_idle_s
        if idle and self.num_steps != self.checked_at_step:
            self.checked_at_step = self.num_steps
            # NOTE: idle includes a pause in place, whose running requests keep their slots
            self.kv.check_integrity(self.scheduler.running)
            self.rows.check_integrity()
        self.sockets.send_report(
            EngineReport(
                ready=True,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                kv_slots_total=self.slots.size,
                kv_slots_free=self.kv.num_available,
                num_steps=self.num_steps,
                num_preemptions=self.scheduler.num_preemptions,
                max_model_len=self.max_model_len,
                prefix_queried_tokens=self.kv.queried_tokens,
                prefix_hit_tokens=self.kv.hit_tokens,
                prefix_cached_tokens=self.kv.cache.num_cached if self.kv.cache else 0,
                step_timing=self.timing.totals(),
                replica=self.config.replica,
                weight_version=self.control.weight_version,
                **self._spec_counts(),
                **self._lora_counts(),
            )
        )

    def _lora_counts(self) -> dict[str, object]:
        """The adapters in use, for vLLM's lora_requests_info (a gateway routes by them)."""
        if self.lora is None:
            return {}
        running = {r.message.lora_name for r in self.scheduler.running}
        waiting = {r.message.lora_name for r in self.scheduler.waiting}
        return {
            "max_loras": self.lora.max_loras,
            "lora_running": tuple(sorted(running - {""})),
            "lora_waiting": tuple(sorted(waiting - {""})),
        }

    def _spec_counts(self) -> dict[str, object]:
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return {
            "spec_num_drafts": c.num_drafts,
            "spec_num_draft_tokens": c.num_draft_tokens,
            "spec_num_accepted_tokens": c.num_accepted_tokens,
            "spec_accepted_per_pos": tuple(c.accepted_per_pos),
        }


_EMPTY_IDS = empty("int32", 0)
EXPIRY_CHECK_S = 0.1  # how often waiting requests are checked against --queue-timeout


class ControllerSockets:
    """The controller's five sockets, each with one typed decoder. The step channel's ends
    (each rank's batches, rank 0's results) are Unix-domain streams on the controller's node
    (protocol/step_channel.py) and ZeroMQ over TCP to a rank on another node."""

    def __init__(self, config: ControllerConfig) -> None:
        self.context = zmq.Context()
        self.authenticator: Authenticator | None = None
        self.requests = self._socket(zmq.PULL, config.request_addr, bind=True)
        self.workers = [self._worker_socket(a, config) for a in config.worker_addrs]
        self.results = FrameListener(config.result_addr)  # NOTE: rank 0 is on this node
        # NOTE: a frame stream, not ZeroMQ: no I/O thread to wake for every step's outputs
        self.detokenizer = FrameStream.connect(config.detokenizer_addr)
        self.reports = self._socket(zmq.PUSH, config.report_addr, bind=False)
        self.request_decoder = msgspec.msgpack.Decoder(FrontendMessage)
        self.result_decoder = msgspec.msgpack.Decoder(WorkerMessage)
        self.encoder = msgspec.msgpack.Encoder()
        self.poller = zmq.Poller()
        self.poller.register(self.requests, zmq.POLLIN)

    def _socket(self, kind: int, addr: str, bind: bool) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        (sock.bind if bind else sock.connect)(addr)
        return sock

    def _worker_socket(self, addr: str, config: ControllerConfig) -> zmq.Socket | FrameListener:
        """A rank's step input: the step channel on this node; over TCP (a rank on another
        node) only for the key's holders."""
        if is_step_channel(addr):
            return FrameListener(addr)
        if not addr.startswith("tcp://"):
            raise ValueError(f"a rank's step input is unix:// or tcp://, not {addr!r}")
        key = ClusterKey.load(config.cluster_key_file)
        if self.authenticator is None:
            self.authenticator = key.start_authenticator(self.context)
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        key.serve_on(sock)
        sock.bind(addr)
        return sock

    def receive_requests(self, timeout_ms: int) -> list[FrontendMessage]:
        messages: list[FrontendMessage] = []
        if not self.poller.poll(timeout_ms):
            return messages
        while True:
            try:
                frame = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                messages.append(self.request_decoder.decode(frame))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("dropped a frame that is not a frontend message: %s", e)

    def receive_result(self) -> WorkerMessage:
        while True:
            frame = self.results.recv()
            try:
                return self.result_decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("dropped a frame that is not a worker message: %s", e)

    def send_batch(self, batch: object) -> None:
        frame = self.encoder.encode(batch)
        for sock in self.workers:
            sock.send(frame)

    def send_mask(self, mask: GrammarMask) -> None:
        frame = self.encoder.encode(mask)
        for sock in self.workers:
            sock.send(frame)

    def send_outputs(self, batch: BatchOutput) -> None:
        self.detokenizer.send(self.encoder.encode(batch))

    def send_report(self, report: EngineReport | ControlReply) -> None:
        self.reports.send(self.encoder.encode(report), copy=False)


def run_controller(config: ControllerConfig) -> None:
    """The controller process's entry point."""
    setup_process("tokenmill::controller")
    exit_with_parent(config.parent_pid)
    sockets = ControllerSockets(config)
    ready = sockets.receive_result()
    if not isinstance(ready, WorkerReady):
        raise RuntimeError(f"expected WorkerReady from rank 0, got {type(ready).__name__}")
    logger.info(
        "KV cache: %d tokens; max model len %d; max running requests %d",
        ready.kv_cache_tokens,
        ready.max_model_len,
        config.max_running_requests,
    )
    grammar = None
    if config.model_dir:
        started = time.monotonic()
        try:
            grammar = GrammarEngine.for_checkpoint(config.model_dir, ready.eos_token_ids)
            logger.info("grammar engine ready in %.2f s", time.monotonic() - started)
        except (OSError, ValueError, KeyError) as e:
            # NOTE: the frontend's validator fails alike and answers constraints with a 400
            logger.error("grammar constraints are off: %s: %s", type(e).__name__, e)
    controller = Controller(config, ready, sockets, grammar)
    try:
        controller.run()
    except Exception:
        logger.exception("controller failed")
        os._exit(1)
