"""Where a decode step's wall time goes, measured when the server runs with --step-timing
(controller process).

The period of a step is the time from the result of the step before to its own: one cycle
of the workers, whatever this process does while they compute (overlap scheduling) or
between their steps (one step at a time). The worker says how long it was busy and how much
of that was the model forward. What is not forward is overhead: the controller, IPC, and
any stall the detokenizer or frontend cause. Totals are reported, so that a benchmark can
difference two readings around its own workload.
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
    # NOTE: rows x decode steps: a multi-step batch (--decode-steps) computes several tokens a
    # row, so a token's share of a step is the step over tokens / rows.
    row_tokens: int = 0
    _last: tuple[int, float, bool] | None = None  # the last result: (step id, when, decode only)

    def on_result(
        self,
        step_id: int,
        decode_only: bool,
        busy_s: float,
        forward_s: float,
        num_rows: int,
        num_steps: int = 1,
    ) -> None:
        """A step's result is back: its period, from the result of the step before, counts
        when both steps decoded only."""
        if not self.enabled:
            return
        now = time.perf_counter()
        last, self._last = self._last, (step_id, now, decode_only)
        if last is None or last[0] != step_id - 1 or not (last[2] and decode_only):
            return
        self.num_steps += 1
        self.period_s += now - last[1]
        self.busy_s += busy_s
        self.forward_s += forward_s
        self.rows += num_rows
        self.row_tokens += num_rows * num_steps

    def totals(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        return {
            "step_timing_decode_steps": self.num_steps,
            "step_timing_period_seconds": self.period_s,
            "step_timing_worker_busy_seconds": self.busy_s,
            "step_timing_forward_seconds": self.forward_s,
            "step_timing_rows": self.rows,
            "step_timing_row_tokens": self.row_tokens,
        }
