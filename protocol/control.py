"""The RL control plane's messages (`--enable-rl-control`): pause and resume generation, new
weights without a restart, memory released and taken back.

Frontend -> controller: a command with the HTTP request's `ctl_id`; controller -> frontend
(on the report channel): ControlReply with the same id. The commands that touch tensors go
on, as they are, to every rank in a WorkerCommand on the step channel, once no step is in
flight; rank 0 answers with WorkerCommandDone.
"""

from __future__ import annotations

import msgspec

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("kv_cache", "weights")


class PauseGeneration(msgspec.Struct, frozen=True, tag="pause_generation"):
    ctl_id: str
    # abort: requests in flight fail (a 503 naming the pause); retract: they go back to the
    # queue, their KV freed, to be recomputed; in_place: they keep their KV and wait
    mode: str = "abort"


class ContinueGeneration(msgspec.Struct, frozen=True, tag="continue_generation"):
    ctl_id: str


class FlushCache(msgspec.Struct, frozen=True, tag="flush_cache"):
    ctl_id: str


class GetWeightVersion(msgspec.Struct, frozen=True, tag="get_weight_version"):
    ctl_id: str


class LoadWeights(msgspec.Struct, frozen=True, tag="load_weights"):
    """New weights from a checkpoint directory (safetensors, the served checkpoint's names,
    shapes and dtypes)."""

    ctl_id: str
    model_path: str
    weight_version: str | None = None
    abort_all: bool = False  # requests in flight fail instead of going back to the queue


class JoinWeightsGroup(msgspec.Struct, frozen=True, tag="join_weights_group"):
    """Joins every rank to a torch.distributed group with a trainer (the trainer is rank 0;
    server rank r is rank_offset + r)."""

    ctl_id: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str  # gloo (CPU) or nccl (CUDA); "": the device's


class ReceiveWeights(msgspec.Struct, frozen=True, tag="receive_weights"):
    """The trainer broadcasts these tensors (Hugging Face names) in this order; each rank
    keeps its shard."""

    ctl_id: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtype names: bfloat16, float32, ...
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = ""
    weight_version: str | None = None
    abort_all: bool = False  # as LoadWeights'
    # --enable-lora: the tensors are LoRA adapter lora_name's (PEFT's names, the whole
    # adapter), its new weights; the controller fills its slot and its directory, whose
    # adapter_config.json gives their scaling
    lora_name: str = ""
    lora_slot: int = -1
    lora_path: str = ""


class LeaveWeightsGroup(msgspec.Struct, frozen=True, tag="leave_weights_group"):
    ctl_id: str
    group_name: str = ""


class ReleaseMemory(msgspec.Struct, frozen=True, tag="release_memory"):
    ctl_id: str
    tags: tuple[str, ...] = MEMORY_TAGS


class ResumeMemory(msgspec.Struct, frozen=True, tag="resume_memory"):
    ctl_id: str
    tags: tuple[str, ...] = MEMORY_TAGS
    # where the weights come back from: the last checkpoint loaded (the controller fills it)
    model_path: str = ""


class LoadLoraAdapter(msgspec.Struct, frozen=True, tag="load_lora_adapter"):
    """vLLM's /v1/load_lora_adapter: the PEFT adapter at lora_path served as lora_name. With
    load_inplace, an adapter of that name already loaded is replaced (its requests are
    recomputed with the new weights; its cached prefixes are dropped)."""

    ctl_id: str
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    slot: int = -1  # the ranks' slot to load it into (the controller fills it)


class UnloadLoraAdapter(msgspec.Struct, frozen=True, tag="unload_lora_adapter"):
    ctl_id: str
    lora_name: str
    slot: int = -1  # as LoadLoraAdapter's


ControlCommand = (
    PauseGeneration
    | ContinueGeneration
    | FlushCache
    | GetWeightVersion
    | LoadWeights
    | JoinWeightsGroup
    | ReceiveWeights
    | LeaveWeightsGroup
    | ReleaseMemory
    | ResumeMemory
    | LoadLoraAdapter
    | UnloadLoraAdapter
)
# NOTE: what the ranks carry out (the rest is the controller's own bookkeeping)
WorkerAction = (
    LoadWeights
    | JoinWeightsGroup
    | ReceiveWeights
    | LeaveWeightsGroup
    | ReleaseMemory
    | ResumeMemory
    | LoadLoraAdapter
    | UnloadLoraAdapter
)


class ControlReply(msgspec.Struct, frozen=True, tag="control_reply"):
    ctl_id: str
    status: int  # the HTTP status to answer with: 200, 400 (bad input), 409 (not now), 500
    message: str
    weight_version: str
    paused: str | None = None  # the pause mode in force, if any
    num_retracted: int = 0  # requests a pause or an update sent back to the queue


class WorkerCommand(msgspec.Struct, frozen=True, tag="worker_command"):
    step_id: int
    action: WorkerAction


class WorkerCommandDone(msgspec.Struct, frozen=True, tag="worker_command_done"):
    """Rank 0, once every rank carried out the action (ranks agree through a collective)."""

    step_id: int
    ok: bool
    message: str  # why not (a 400's text: the tensor that does not fit), or ""
    bad_input: bool = False  # a 400 (the caller's mistake) rather than a 500
