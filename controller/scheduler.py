"""Chooses each step's rows: decode rows, prefill chunks, admissions, preemptions
(controller process).

Admission never over-commits the KV pool: a request is admitted only when slots for all of
its known tokens are free beyond one decode step's headroom for the running set; if decode
still runs out, the latest-admitted request is preempted (its slots freed, its tokens kept)
and requeued at the front, to be recomputed when it fits again.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from tokenmill.controller.request import PromptScores, Request
from tokenmill.controller.slot_pool import IndexPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledRow:
    request: Request
    start: int  # first position computed this step (= num_computed_tokens)
    num_new: int  # positions computed this step
    is_prefill: bool
    samples: bool  # the row reaches the request's last token: its sampled token is kept

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @staticmethod
    def of(request: Request, num_new: int, is_prefill: bool) -> ScheduledRow:
        start = request.num_computed_tokens
        return ScheduledRow(
            request, start, num_new, is_prefill, samples=start + num_new == request.num_tokens
        )


class Scheduler:
    def __init__(
        self, slots: IndexPool, rows: IndexPool, max_running: int, max_prefill_tokens: int
    ) -> None:
        self.slots = slots
        self.rows = rows
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRow]:
        decode = self._schedule_decode()
        budget = self.max_prefill_tokens
        prefill = []
        for request in self.running:
            if request.is_prefill and budget > 0 and request not in decode:
                row = self._chunk(request, budget)
                budget -= row.num_new
                prefill.append(row)
        while budget > 0 and self.waiting and self._admit(self.waiting[0]):
            row = self._chunk(self.waiting.popleft(), budget)
            budget -= row.num_new
            prefill.append(row)
        return [ScheduledRow.of(r, 1, False) for r in decode] + prefill

    def finish(self, request: Request) -> None:
        """Frees what a finished or aborted request holds (it may be waiting or running)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def _schedule_decode(self) -> list[Request]:
        decoding = [r for r in self.running if not r.is_prefill]
        needed = sum(1 for r in decoding if len(r.slots) < r.num_tokens)
        while needed > self.slots.num_free:
            victim = max(self.running, key=lambda r: r.arrival)
            if victim in decoding:
                decoding.remove(victim)
                needed -= len(victim.slots) < victim.num_tokens
            self._preempt(victim)
        for request in decoding:
            if len(request.slots) < request.num_tokens:
                request.slots += self.slots.alloc(request.num_tokens - len(request.slots))
        return decoding

    def _admit(self, request: Request) -> bool:
        needed = request.num_tokens - len(request.slots)
        headroom = len(self.running)
        if (
            len(self.running) >= self.max_running
            or self.rows.num_free == 0
            or needed + headroom > self.slots.num_free
        ):
            return False
        request.row = self.rows.alloc(1)[0]
        request.slots += self.slots.alloc(needed)
        self.running.append(request)
        return True

    def _chunk(self, request: Request, budget: int) -> ScheduledRow:
        num_new = min(budget, request.num_tokens - request.num_computed_tokens)
        return ScheduledRow.of(request, num_new, True)

    def _preempt(self, request: Request) -> None:
        logger.info(
            "preempting %s (%d tokens) to free KV slots", request.req_id, request.num_tokens
        )
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        if request.prompt_scores is not None and not request.prompt_scores_sent:
            request.prompt_scores = PromptScores()
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        if request.slots:
            self.slots.free(request.slots)
            request.slots = []
        if request.row >= 0:
            self.rows.free([request.row])
            request.row = -1
