"""The RL control plane's controller half (controller process, `--enable-rl-control`):
generation paused and resumed, the prefix cache flushed, new weights and memory commands
passed to the ranks once no step is in flight, and the weight version kept.

Every command first completes the steps in flight, so it acts between two steps. New
weights retract the requests that hold KV (they are recomputed with the new weights,
keeping the tokens they had) and empty the prefix cache: nothing computed with the old
weights is reused with the new ones.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokenmill.controller import lora_control
from tokenmill.controller.refused import Refused
from tokenmill.protocol.control import (
    MEMORY_TAGS,
    PAUSE_MODES,
    ContinueGeneration,
    ControlCommand,
    ControlReply,
    FlushCache,
    GetWeightVersion,
    JoinWeightsGroup,
    LeaveWeightsGroup,
    LoadLoraAdapter,
    LoadWeights,
    PauseGeneration,
    ReceiveWeights,
    ReleaseMemory,
    ResumeMemory,
    UnloadLoraAdapter,
    WorkerAction,
    WorkerCommand,
    WorkerCommandDone,
)

if TYPE_CHECKING:
    from tokenmill.controller.controller import Controller

logger = logging.getLogger(__name__)

INITIAL_WEIGHT_VERSION = "default"  # SGLang's name for the weights a server started with
PAUSED_DETAIL = "aborted by /pause_generation (mode abort)"
UPDATE_ABORT_DETAIL = "aborted by a weight update (abort_all_requests)"


class ControlPlane:
    def __init__(self, controller: Controller, model_dir: str) -> None:
        self.controller = controller
        self.paused: str | None = None  # the pause mode in force
        self.released: set[str] = set()  # memory tags given back
        self.weight_version = INITIAL_WEIGHT_VERSION
        self.weights_path = model_dir  # the last checkpoint on disk the weights came from
        self.num_retracted = 0

    @property
    def holds(self) -> bool:
        """No step may run: paused, or memory given back."""
        return self.paused is not None or bool(self.released)

    def handle(self, command: ControlCommand) -> ControlReply:
        self.num_retracted = 0
        try:
            message = self._dispatch(command)
            status = 200
        except Refused as e:
            status, message = e.status, str(e)
        if status != 200:
            logger.warning("%s refused (%d): %s", type(command).__name__, status, message)
        return ControlReply(
            command.ctl_id,
            status,
            message,
            self.weight_version,
            self.paused,
            self.num_retracted,
        )

    def _dispatch(self, command: ControlCommand) -> str:
        self.controller.complete_steps(keep=0)
        match command:
            case PauseGeneration():
                return self.pause(command.mode)
            case ContinueGeneration():
                self.paused = None
                return "generation continues"
            case FlushCache():
                return self.flush_cache()
            case GetWeightVersion():
                return self.weight_version
            case ReceiveWeights() if command.lora_name:
                return lora_control.from_trainer(self, command)
            case LoadWeights() | ReceiveWeights():
                return self.update_weights(command)
            case ReleaseMemory() | ResumeMemory():
                return self.memory(command)
            case LoadLoraAdapter() | UnloadLoraAdapter():
                return lora_control.carry_out(self, command)
            case JoinWeightsGroup() | LeaveWeightsGroup():
                self.run_on_ranks(command)
                return "ok"
            case _:
                raise Refused(400, f"unknown command {type(command).__name__}")

    def pause(self, mode: str) -> str:
        if mode not in PAUSE_MODES:
            raise Refused(400, f"mode {mode!r}: use one of {', '.join(PAUSE_MODES)}")
        if mode == "abort":
            for request in list(self.controller.requests.values()):
                self.controller.end(request, "paused", PAUSED_DETAIL)
        elif mode == "retract":
            self.num_retracted = self.controller.scheduler.retract_all()
        self.paused = mode
        return f"generation paused ({mode})"

    def flush_cache(self) -> str:
        cache = self.controller.kv.cache
        if cache is None:
            return "no prefix cache (--disable-prefix-cache)"
        if cache.num_evictable < cache.num_cached:
            raise Refused(
                409, "requests hold prefix-cache entries; pause with mode retract or abort first"
            )
        cache.evict(cache.num_cached)
        return "prefix cache flushed"

    def update_weights(self, command: LoadWeights | ReceiveWeights) -> str:
        """Requests that hold KV go back to the queue first (nothing computed with the old
        weights is used again); on success the cache is emptied and the version moves on."""
        if "weights" in self.released:
            raise Refused(409, "the weights are released: POST /resume_memory_occupation first")
        if command.abort_all:
            for request in list(self.controller.requests.values()):
                self.controller.end(request, "paused", UPDATE_ABORT_DETAIL)
        self.num_retracted = self.controller.scheduler.retract_all()
        self.run_on_ranks(command)
        cache = self.controller.kv.cache
        if cache is not None:
            cache.evict(cache.num_cached)
        if isinstance(command, LoadWeights):
            self.weights_path = command.model_path
        previous = self.weight_version
        if command.weight_version is not None:
            self.weight_version = command.weight_version
        logger.info("weights updated: version %s -> %s", previous, self.weight_version)
        return f"weights updated to version {self.weight_version}"

    def memory(self, command: ReleaseMemory | ResumeMemory) -> str:
        tags = tuple(command.tags)
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown or not tags:
            raise Refused(400, f"tags {list(unknown or tags)}: use {list(MEMORY_TAGS)}")
        if isinstance(command, ResumeMemory):
            gone = tuple(t for t in tags if t in self.released)
            if gone:
                self.run_on_ranks(ResumeMemory(command.ctl_id, gone, self.weights_path))
            self.released -= set(tags)
            return f"memory resumed: {', '.join(tags)}"
        if self.controller.scheduler.running:
            raise Refused(409, "requests hold KV; pause with mode retract or abort first")
        cache = self.controller.kv.cache
        if cache is not None and "kv_cache" in tags:
            cache.evict(cache.num_cached)
        self.run_on_ranks(command)
        self.released |= set(tags)
        return f"memory released: {', '.join(tags)}"

    def run_on_ranks(self, action: WorkerAction) -> None:
        """Every rank carries `action` out; a refusal is a 400, a failure a 500."""
        controller = self.controller
        controller.num_steps += 1
        controller.sockets.send_batch(WorkerCommand(controller.num_steps, action))
        done = controller.sockets.receive_result()
        if not isinstance(done, WorkerCommandDone) or done.step_id != controller.num_steps:
            raise RuntimeError(f"expected the ranks' answer to a command, got {done!r:.200}")
        if not done.ok:
            raise Refused(400 if done.bad_input else 500, done.message)
