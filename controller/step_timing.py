"""Where a decode step's wall time goes, measured when the server runs with --step-timing
(controller process).

The period of a step is the time from sending it to sending the next; the worker says how
long it was busy and how much of that was the model forward. What is not forward is
overhead: the controller, IPC, and any stall the detokenizer or frontend cause. Totals are
reported, so that a benchmark can difference two readings around its own workload.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class StepTiming:
    enabled: bool = False
    num_steps: int = 0
    period_s: float = 0.0
    busy_s: float = 0.0
    forward_s: float = 0.0
    rows: int = 0
    _last_send: float | None = None  # when the last decode-only step was sent
    _pending: tuple[float, float, int] | None = None  # its worker figures, once back

    def on_send(self, decode_only: bool) -> None:
        """A step goes out: the previous decode-only step's period ends here."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._pending is not None and self._last_send is not None and decode_only:
            busy, forward, rows = self._pending
            self.num_steps += 1
            self.period_s += now - self._last_send
            self.busy_s += busy
            self.forward_s += forward
            self.rows += rows
        self._pending = None
        self._last_send = now if decode_only else None

    def on_result(self, busy_s: float, forward_s: float, num_rows: int) -> None:
        if self.enabled and self._last_send is not None:
            self._pending = (busy_s, forward_s, num_rows)

    def totals(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        return {
            "step_timing_decode_steps": self.num_steps,
            "step_timing_period_seconds": self.period_s,
            "step_timing_worker_busy_seconds": self.busy_s,
            "step_timing_forward_seconds": self.forward_s,
            "step_timing_rows": self.rows,
        }
