"""Controller -> frontend channel: the engine's state, for /health and /metrics; and the
replies to control commands (protocol/control.py's ControlReply) on the same socket."""

from __future__ import annotations

import msgspec


class EngineReport(msgspec.Struct, frozen=True, tag="engine_report"):
    ready: bool  # the model is loaded and the controller is stepping
    num_running: int
    num_waiting: int
    kv_slots_total: int
    kv_slots_free: int  # free or held only by the prefix cache (evictable)
    num_steps: int  # steps run since start
    num_preemptions: int
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_cached_tokens: int = 0  # slots the prefix cache holds
    # --step-timing: means over decode-only steps (seconds, rows), keyed by name
    step_timing: dict[str, float] = {}
    max_model_len: int = 0
    replica: int = 0  # which engine replica (--data-parallel-size) reports
    # speculative decoding since start: rows that verified drafts, drafts, kept drafts, and
    # kept drafts by position (the first draft of a step, the second, ...)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    weight_version: str = "default"  # the weights in force (protocol/control.py)
    # --enable-lora: adapter slots, and the adapters of running and of waiting requests
    max_loras: int = 0
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
