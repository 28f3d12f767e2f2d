"""The frontend's view of the engine: submit a request, iterate its outputs, abort it.

The HTTP layer talks only to this interface; `ZmqEngineClient` (zmq_client.py) implements it
over the controller and detokenizer sockets, and tests can implement it with a fake.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.protocol.control import ControlCommand, ControlReply
from tokenmill.protocol.outputs import DetokenizedOutput
from tokenmill.protocol.requests import GenerateRequest


class EngineDeadError(RuntimeError):
    """The engine's processes stopped; requests in flight cannot complete."""


@dataclass
class EngineStats:
    """What /metrics and /health show of the engine; updated by the controller's reports."""

    alive: bool = True
    num_running: int = 0
    num_waiting: int = 0
    kv_slots_total: int = 0
    kv_slots_free: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    # speculative decoding (EngineReport.spec_*): rows that verified drafts, drafts, kept
    # drafts, and kept drafts by position; None while the engine does not speculate
    spec: tuple[int, int, int, tuple[int, ...]] | None = None
    weight_version: str = "default"  # the weights in force (the RL control plane's)
    # --enable-lora (EngineReport.max_loras, lora_*): slots, adapters running and waiting
    lora: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None
    # time.monotonic() of the controller's last report (it reports between steps)
    last_report: float = field(default_factory=time.monotonic)
    extra: dict[str, float] = field(default_factory=dict)
    # --data-parallel-size > 1: each replica's own; the fields above then hold only `alive`
    replicas: list[EngineStats] = field(default_factory=list)

    def healthy(self, stale_after_s: float = 120.0) -> bool:
        """Alive and stepping: a report came within `stale_after_s` (from every replica).
        NOTE: a CPU prefill step can take tens of seconds, so only a much longer silence
        counts as stuck."""
        now = time.monotonic()
        reports = [r.last_report for r in self.replicas] or [self.last_report]
        return self.alive and all(now - t < stale_after_s for t in reports)

    def per_replica(self) -> list[EngineStats]:
        return self.replicas or [self]


class EngineClient(Protocol):
    stats: EngineStats
    draining: bool  # SIGTERM came: new requests are refused, those in flight finish

    def generate(self, request: GenerateRequest) -> AsyncIterator[DetokenizedOutput]:
        """Submits `request` and yields its outputs until one has a finish_reason.
        Raises EngineDeadError if the engine dies. Closing the iterator early (a client
        that went away) aborts the request."""
        ...

    async def abort(self, req_id: str) -> None: ...

    async def control(self, make: Callable[[str], ControlCommand]) -> ControlReply:
        """One control command (`make(ctl_id)`) carried out by every engine replica; their
        reply (the worst status of them). Raises EngineDeadError if the engine dies."""
        ...
