"""The tp_worker process: one per tensor-parallel rank. Receives ForwardBatch messages,
runs them on its model shard, and (rank 0) sends each StepResult back to the controller.

Every rank receives every step; collectives inside the model keep the ranks in lockstep.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from dataclasses import replace
from datetime import timedelta

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import zmq

from tokenmill.protocol.arrays import unpack
from tokenmill.protocol.cluster import ClusterKey
from tokenmill.protocol.control import WorkerCommand, WorkerCommandDone
from tokenmill.protocol.process import exit_with_parent, setup_process
from tokenmill.protocol.step import (
    BatchMessage,
    ForwardBatch,
    GrammarMask,
    WorkerFailed,
    WorkerReady,
)
from tokenmill.protocol.step_channel import FrameStream, is_step_channel
from tokenmill.tp_worker.config import RunnerConfig, WorkerConfig
from tokenmill.tp_worker.cpu.host_memory import keep_freed_memory
from tokenmill.tp_worker.device import resolve_device
from tokenmill.tp_worker.model_runner import ModelRunner
from tokenmill.tp_worker.weight_update import BadWeights

logger = logging.getLogger(__name__)


def init_distributed(config: WorkerConfig) -> RunnerConfig:
    """Joins the tensor-parallel group; returns the runner config with this rank's device."""
    runner = config.runner
    device = resolve_device(runner.device)
    local = runner.cpu_sharers
    if device.type == "cuda":
        if device.index is None or local > 1:  # NOTE: an explicit cuda:N serves one rank
            local_rank = config.rank if config.local_rank < 0 else config.local_rank
            device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
        runner = replace(runner, device=str(device))
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    if config.world_size > 1:
        try:
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                init_method=config.dist_init_addr,
                rank=config.rank,
                world_size=config.world_size,
                timeout=timedelta(seconds=config.dist_timeout_s),
            )
        except (RuntimeError, TimeoutError, ValueError) as e:
            logger.error(
                "rank %d could not join the other %d ranks at %s within %.0f s: %s",
                config.rank,
                config.world_size - 1,
                config.dist_init_addr,
                config.dist_timeout_s,
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
            sys.exit(1)
    return runner


def connect_batches(context: zmq.Context, config: WorkerConfig) -> zmq.Socket | FrameStream:
    """The step input: the step channel on the controller's node; from another node over
    TCP, proving we hold the cluster key."""
    if is_step_channel(config.batch_addr):
        return FrameStream.connect(config.batch_addr)
    if not config.batch_addr.startswith("tcp://"):
        raise ValueError(f"a rank's step input is unix:// or tcp://, not {config.batch_addr!r}")
    batches = context.socket(zmq.PULL)
    ClusterKey.load(config.cluster_key_file).connect_with(batches)
    batches.connect(config.batch_addr)
    return batches


def run_tp_worker(config: WorkerConfig) -> None:
    """The tp_worker process's entry point."""
    setup_process(f"tokenmill::tp_worker{config.rank}")
    exit_with_parent(config.parent_pid)
    runner = ModelRunner(init_distributed(config))
    context = zmq.Context()
    batches = connect_batches(context, config)
    results = None
    if config.rank == 0:
        results = FrameStream.connect(config.result_addr)  # NOTE: on the controller's node
        results.send(
            msgspec.msgpack.encode(
                WorkerReady(
                    kv_cache_tokens=runner.kv_cache_tokens,
                    max_model_len=runner.max_model_len,
                    eos_token_ids=runner.model_config.eos_token_ids,
                    routing=runner.routing_shape,
                )
            )
        )
    logger.info(
        "rank %d ready: %s on %s, KV cache %d tokens",
        config.rank,
        runner.dtype,
        runner.device,
        runner.kv_cache_tokens,
    )
    runner.time_forward = config.step_timing
    # NOTE: the model's and tokenizer's long-lived objects leave the collector's generations,
    # so a step's short-lived ones are all it scans (full collections cost ~2 % of a step).
    gc.collect()
    gc.freeze()
    serve(runner, batches, results)


class BatchReader:
    """The rank's step input: batches, and the grammar masks a batch waits for."""

    def __init__(self, batches: zmq.Socket | FrameStream) -> None:
        self.batches = batches
        self.decoder = msgspec.msgpack.Decoder(BatchMessage)

    def receive(self) -> BatchMessage | None:
        """The next message, None once the controller is gone."""
        while True:
            try:
                frame = self.batches.recv()
            except EOFError:
                # NOTE: the controller is gone (the server stops, or it failed and the
                # server stops for it): no step can come any more.
                logger.info("the controller closed the step channel; rank exits")
                return None
            try:
                return self.decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("dropped a frame that is not a batch message: %s", e)

    def receive_work(self) -> ForwardBatch | WorkerCommand | None:
        """The next batch or control command (None once the controller is gone)."""
        while True:
            message = self.receive()
            if message is None or not isinstance(message, GrammarMask):
                return message
            logger.error("dropped the grammar masks of step %d: no batch waits", message.step_id)

    def receive_mask(self, step_id: int) -> np.ndarray:
        message = self.receive()
        if not isinstance(message, GrammarMask) or message.step_id != step_id:
            raise RuntimeError(f"expected step {step_id}'s grammar masks, got {message!r:.200}")
        return unpack(message.bitmask)


def serve(
    runner: ModelRunner,
    batches: zmq.Socket | FrameStream,
    results: FrameStream | None,
) -> None:
    reader = BatchReader(batches)
    encoder = msgspec.msgpack.Encoder()
    runner.receive_mask = reader.receive_mask
    while (batch := reader.receive_work()) is not None:
        if isinstance(batch, WorkerCommand):
            done = carry_out(runner, batch)
            if results is not None:
                results.send(encoder.encode(done))
            continue
        started = time.perf_counter()
        runner.forward_s = 0.0
        try:
            result = runner.step(batch)
        except Exception as e:
            logger.exception("step %d failed", batch.step_id)
            if results is not None:
                results.send(encoder.encode(WorkerFailed(batch.step_id, repr(e)[:1000])))
            os._exit(1)
        if results is None:
            continue
        if runner.time_forward:
            busy = time.perf_counter() - started
            result = msgspec.structs.replace(result, busy_s=busy, forward_s=runner.forward_s)
        results.send(encoder.encode(result))


def carry_out(runner: ModelRunner, command: WorkerCommand) -> WorkerCommandDone:
    """A control command on this rank; weights that do not fit are the caller's mistake (every
    rank refuses them alike, before any changes), anything else is logged and reported."""
    action = type(command.action).__name__
    try:
        runner.carry_out(command.action)
    except BadWeights as e:
        logger.warning("%s refused: %s", action, e)
        return WorkerCommandDone(command.step_id, False, str(e), bad_input=True)
    except Exception as e:
        logger.exception("%s failed", action)
        return WorkerCommandDone(command.step_id, False, f"{action} failed: {e!r}"[:1000])
    logger.info("%s done", action)
    return WorkerCommandDone(command.step_id, True, "")
