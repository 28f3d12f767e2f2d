"""The controller process's configuration (addresses and scheduling limits)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ControllerConfig:
    request_addr: str
    """ZMQ address the controller binds to receive GenerateRequest / AbortRequest."""
    worker_addrs: tuple[str, ...]
    """One address per tensor-parallel rank, bound by the controller to push ForwardBatch:
    unix:// (protocol/step_channel.py) on this node, tcp:// (ZeroMQ, CURVE) on another."""
    result_addr: str
    """Address the controller binds to receive rank 0's WorkerReady / StepResult (unix://)."""
    detokenizer_addr: str
    """The detokenizer's input, a frame stream (unix://, protocol/step_channel.py) it listens
    on; the controller connects."""
    report_addr: str
    """Address of the frontend's report input (the controller connects)."""
    max_running_requests: int
    max_prefill_tokens: int
    model_dir: str = ""
    """The checkpoint (its tokenizer.json and config.json build the grammar engine); empty:
    no grammar constraints (tests with a fake model)."""
    decode_steps: int = 1
    """Decode iterations per step when every row decodes (multi-step decoding)."""
    speculative_config: str = ""
    """vLLM's --speculative-config JSON (controller/speculation.py); empty: no drafts."""
    overlap_schedule: bool = False
    """Send the next step before the result of the one in flight is back (see run_once)."""
    step_timing: bool = False
    """Measure decode steps (period, worker time, model forward) and report the means."""
    enable_prefix_cache: bool = True
    """Reuse the KV of cached prompt prefixes (the radix cache)."""
    parent_pid: int | None = None
    report_interval_s: float = 0.25
    integrity_idle_s: float = 1.0
    """Seconds without a step before the slot pool and prefix tree are checked for leaks."""
    cluster_key_file: str = ""
    """With ranks on other nodes: the CURVE keys that secure their tcp:// worker_addrs."""
    replica: int = 0
    """This engine's index among --data-parallel-size replicas (in its reports)."""
    max_queued_requests: int = 8192
    """Waiting requests at most: one more is turned away at once (finish_reason rejected)."""
    queue_timeout_s: float = 0.0
    """A request never started after this long is failed (finish_reason queue_timeout)."""
    max_loras: int = 0
    """--enable-lora: adapters held at once (the ranks' slots); 0: LoRA off."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """(name, path) of the adapters the ranks loaded at start, into slots 0, 1, ..."""
