"""The detokenizer process: BatchOutput arrays in, DetokenizedBatch text and entries out.

Sits between the controller (a frame stream it listens on: protocol/step_channel.py) and the
frontend (ZeroMQ PUSH, connected). Holds one incremental decoder per running request,
created by the request's first output (which carries its DetokenizeParams) and dropped when
the request finishes.
"""

from __future__ import annotations

import base64
import logging
import os
import sys
import time
from dataclasses import dataclass

import msgspec
import zmq

from tokenmill.detokenizer.config import DetokenizerConfig
from tokenmill.detokenizer.incremental import IncrementalDetokenizer
from tokenmill.detokenizer.logprob_format import LogprobFormatter
from tokenmill.detokenizer.token_table import TokenTable
from tokenmill.protocol.arrays import Array, unpack, unpack_list
from tokenmill.protocol.outputs import (
    BatchOutput,
    DetokenizedBatch,
    DetokenizedOutput,
    RequestOutput,
)
from tokenmill.protocol.process import ServingPriority, setup_process
from tokenmill.protocol.requests import AbortRequest, DetokenizeParams
from tokenmill.protocol.step_channel import FrameListener

logger = logging.getLogger(__name__)

_POLL_S = 0.5


@dataclass
class _RequestState:
    decoder: IncrementalDetokenizer
    formatter: LogprobFormatter
    wants_routing: bool = False  # DetokenizeParams.routed_experts
    num_output_tokens: int = 0  # kept: up to a stop string
    num_received: int = 0  # output ids the controller sent, past a stop string too
    # NOTE: ended by a stop string while the controller ran it, and asking for its routed
    # experts: its last output waits for the controller's, which carries them
    held: DetokenizedOutput | None = None


class Detokenizer:
    """Per-request decoding state and the handler of BatchOutput messages."""

    def __init__(self, table: TokenTable) -> None:
        self.table = table
        self._states: dict[str, _RequestState] = {}
        # Requests we ended on a stop string while the controller still runs them: their
        # further outputs are dropped until the controller's own final output arrives.
        self._stopped: set[str] = set()
        # Ended by a stop string in the last batch while the controller still runs them.
        self.stopped_req_ids: list[str] = []

    @property
    def num_running(self) -> int:
        return len(self._states)

    def handle_batch_output(self, msg: BatchOutput) -> DetokenizedBatch:
        """Detokenize one batch; `stopped_req_ids` then lists requests to abort upstream."""
        self.stopped_req_ids = []
        outputs = [self._handle_request_output(out) for out in msg.outputs]
        return DetokenizedBatch([out for out in outputs if out is not None])

    def _state(self, out: RequestOutput) -> _RequestState:
        state = self._states.get(out.req_id)
        if state is not None:
            return state
        params = out.detokenize
        if params is None:
            # NOTE: the controller sends them with every request's first output; a bug there
            # must cost this request its text, not the server its detokenizer.
            logger.error("first output of %s has no detokenize params", out.req_id)
            params = DetokenizeParams()
        state = _RequestState(
            IncrementalDetokenizer(self.table, params),
            LogprobFormatter(self.table, _num_top(params), params.text_in_logprobs),
            params.routed_experts,
        )
        self._states[out.req_id] = state
        return state

    def _handle_request_output(self, out: RequestOutput) -> DetokenizedOutput | None:
        if out.req_id in self._stopped:
            return self._after_stop(out)
        state = self._state(out)
        ids = unpack_list(out.new_ids)
        state.num_received += len(ids)
        delta = state.decoder.feed(ids)
        kept = ids[: delta.num_ids]
        text, reason, detail = delta.text, out.finish_reason, out.finish_detail
        if delta.stop is None and reason is not None:
            flushed = state.decoder.finish()
            text += flushed.text
            delta = flushed
        if delta.stop is not None:
            reason, detail = "stop", delta.stop
            if out.finish_reason is None:  # the controller still runs it
                self.stopped_req_ids.append(out.req_id)
                self._stopped.add(out.req_id)
        state.num_output_tokens += len(kept)
        result = DetokenizedOutput(
            out.req_id,
            text,
            kept,
            state.formatter.output(out, kept),
            state.formatter.prompt(out.prompt) if out.prompt is not None else [],
            reason,
            detail,
            out.num_prompt_tokens,
            state.num_output_tokens,
            out.num_cached_tokens,
            _routed_experts(state, out.routed_experts),
        )
        if reason is not None:
            if out.req_id in self._stopped and state.wants_routing:
                state.held = result
                return None
            del self._states[out.req_id]
        return result

    def _after_stop(self, out: RequestOutput) -> DetokenizedOutput | None:
        """An output of a request a stop string ended while the controller ran it: dropped,
        but for the controller's last, which brings a held output its routed experts."""
        state = self._states.get(out.req_id)
        if state is not None:
            state.num_received += out.new_ids.shape[0]
        if out.finish_reason is None:
            return None
        self._stopped.discard(out.req_id)
        self._states.pop(out.req_id, None)
        if state is None or state.held is None:
            return None
        routed = _routed_experts(state, out.routed_experts)
        return msgspec.structs.replace(state.held, routed_experts=routed)


def _routed_experts(state: _RequestState, routed: Array | None) -> str | None:
    """SGLang's encoding: base64 of the int32 array's little-endian bytes (flat, in C order:
    position, layer, k). NOTE: the controller's rows run to its last output id; those past
    a stop string (ids the response leaves out) are cut."""
    if routed is None:
        return None
    experts = unpack(routed)
    extra = state.num_received - state.num_output_tokens
    if extra > 0:
        experts = experts[: max(0, len(experts) - extra)]
    return base64.b64encode(experts.astype("<i4").tobytes()).decode("ascii")


def _num_top(params: DetokenizeParams) -> int | None:
    # NOTE: DetokenizeParams has no num_top yet; until it does, top-k entries are as wide
    # as the controller's arrays (the controller should cut them per request).
    num_top = getattr(params, "num_top", None)
    return num_top if isinstance(num_top, int) else None


class _ParentWatch:
    """Says when our parent process is gone (checked at most every `period_s`)."""

    def __init__(self, parent_pid: int | None, period_s: float) -> None:
        self._parent_pid = parent_pid
        self._period_s = period_s
        self._next = time.monotonic() + period_s

    def parent_gone(self) -> bool:
        if self._parent_pid is None or time.monotonic() < self._next:
            return False
        self._next = time.monotonic() + self._period_s
        return os.getppid() != self._parent_pid


def decode_frame(decoder: msgspec.msgpack.Decoder, frame: bytes | bytearray) -> BatchOutput | None:
    """The frame as a BatchOutput, or None (logged) when it is not one."""
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError as exc:
        logger.error("dropped a %s-byte frame that is not a BatchOutput: %s", len(frame), exc)
        return None


def serve(detokenizer: Detokenizer, config: DetokenizerConfig, ctx: zmq.Context) -> None:
    """The loop: receive a BatchOutput, detokenize it, send the DetokenizedBatch; until the
    parent is gone or the controller has closed its end."""
    inputs = FrameListener(config.input_addr)
    try:
        _serve(detokenizer, config, ctx, inputs)
    except EOFError:
        logger.info("the controller closed its outputs; detokenizer exits")
    finally:
        inputs.close()


def _serve(
    detokenizer: Detokenizer, config: DetokenizerConfig, ctx: zmq.Context, inputs: FrameListener
) -> None:
    push = ctx.socket(zmq.PUSH)
    push.connect(config.output_addr)
    aborts = None
    if config.abort_addr is not None:
        aborts = ctx.socket(zmq.PUSH)
        aborts.connect(config.abort_addr)
    decoder = msgspec.msgpack.Decoder(BatchOutput)
    encoder = msgspec.msgpack.Encoder()
    watch = _ParentWatch(config.parent_pid, config.parent_check_s)
    priority = ServingPriority(config.niceness)
    logger.info("detokenizer ready: in %s, out %s", config.input_addr, config.output_addr)
    while not watch.parent_gone():
        if not inputs.poll(_POLL_S):
            continue
        msg = decode_frame(decoder, inputs.recv())
        if msg is None:
            continue
        batch = detokenizer.handle_batch_output(msg)
        priority.update(detokenizer.num_running)
        if batch.outputs:
            push.send(encoder.encode(batch))
        if aborts is not None:
            for req_id in detokenizer.stopped_req_ids:
                aborts.send(encoder.encode(AbortRequest(req_id)))
    logger.error("parent process %s is gone; detokenizer exits", config.parent_pid)


def run_detokenizer(config: DetokenizerConfig) -> None:
    """Entry point of the detokenizer process; exits non-zero on any internal error."""
    setup_process("tokenmill::detokenizer")
    ctx = zmq.Context()
    try:
        detokenizer = Detokenizer(TokenTable.from_file(config.tokenizer_path))
        serve(detokenizer, config, ctx)
    except KeyboardInterrupt:
        logger.info("detokenizer interrupted")
    except Exception:
        logger.exception("detokenizer failed")
        sys.exit(1)
    finally:
        ctx.destroy(linger=0)
