"""Chooses each step's rows: decode rows, prefill chunks, admissions, preemptions
(controller process).

Admission never over-commits the KV pool: a request is admitted only when slots for all of
its known tokens not in the prefix cache are available (free, or cached and evictable)
beyond one decode step's headroom for the running set; if decode
still runs out, the latest-admitted request is preempted (its slots freed, its tokens kept)
and requeued at the front, to be recomputed when it fits again.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.controller.kv_allocator import KvAllocator
from tokenmill.controller.radix_cache import Match
from tokenmill.controller.request import PromptScores, Request
from tokenmill.controller.slot_pool import IndexPool
from tokenmill.controller.speculation import Speculator

logger = logging.getLogger(__name__)

# NOTE: a decoding request takes its next slots this many at a time while the pool has them
# free, so that a row's keys lie together in the cache (the attention kernels read runs of
# memory instead of one scattered slot per position); unused ones are freed with the rest.
DECODE_SLOT_RUN = 16


@dataclass(frozen=True)
class ScheduledRow:
    request: Request
    start: int  # first position computed this step (= num_computed_tokens)
    num_new: int  # positions computed this step
    is_prefill: bool
    samples: bool  # the row reaches the request's last token: its sampled token is kept
    num_outputs: int  # outputs before this step's (including those of a step in flight)
    drafts: tuple[int, ...] = ()  # tokens after the last one, verified in this step

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @staticmethod
    def of(
        request: Request, num_new: int, is_prefill: bool, drafts: tuple[int, ...] = ()
    ) -> ScheduledRow:
        start = request.num_computed_tokens
        samples = start + num_new - len(drafts) == request.num_tokens_ahead
        return ScheduledRow(
            request, start, num_new, is_prefill, samples, request.num_outputs_ahead, drafts
        )


class Scheduler:
    def __init__(
        self,
        kv: KvAllocator,
        rows: IndexPool,
        max_running: int,
        max_prefill_tokens: int,
        max_model_len: int | None = None,
        decode_steps: int = 1,
        speculator: Speculator | None = None,
    ) -> None:
        self.kv = kv
        self.rows = rows
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.decode_steps = decode_steps
        self.speculator = speculator
        self.num_steps = 1  # decode iterations of the batch schedule() made last
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, ahead: bool = False) -> list[ScheduledRow] | None:
        """The next step's rows; `self.num_steps` says how many decode iterations it runs.
        The requests count the rows as computed and their samples as pending from here on.

        ahead: a step is in flight (overlap scheduling), so rows that sample in it do not
        know their last token yet and may stop with it. None (nothing changed) where the
        step needs that result first: a preemption (it recomputes known tokens only)."""
        self.num_steps = self._num_steps()
        decode = self._schedule_decode(self.num_steps, ahead)
        if decode is None:
            return None
        rows = self._schedule_prefill(decode)
        for row in rows:
            self._advance(row)
        return rows

    def _advance(self, row: ScheduledRow) -> None:
        request, steps = row.request, 1 if row.is_prefill else self.num_steps
        request.num_computed_tokens = row.end + steps - 1
        if row.samples:
            request.pending += steps + len(row.drafts)
        if row.drafts:
            request.verifying = True

    def _schedule_prefill(self, decode: list[ScheduledRow]) -> list[ScheduledRow]:
        budget = self.max_prefill_tokens
        prefill = []
        decoding = {id(row.request) for row in decode}
        for request in self.running:
            if request.is_prefill and budget > 0 and id(request) not in decoding:
                row = self._chunk(request, budget)
                budget -= row.num_new
                prefill.append(row)
        # NOTE: a request that waits for a running prefill to fill the cache lets the ones
        # behind it in, up to as many as could still run (each costs a cache lookup a step);
        # one that waits for room stops the queue (first come, first served).
        deferred: list[Request] = []
        while budget > 0 and self.waiting and self._has_room():
            if len(deferred) >= self.max_running - len(self.running):
                break
            request = self.waiting.popleft()
            match = self.kv.lookup(request)
            if match is not None and self._shares_a_running_prefill(request, len(match.slots)):
                deferred.append(request)
                continue
            if not self._admit(request, match):
                self.waiting.appendleft(request)
                break
            if request.is_prefill:  # else its cached prefix covers the prompt: it decodes
                row = self._chunk(request, budget)
                budget -= row.num_new
                prefill.append(row)
        self.waiting.extendleft(reversed(deferred))
        return decode + prefill

    def finish(self, request: Request) -> None:
        """Frees what a finished or aborted request holds (it may be waiting or running)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        # NOTE: a step in flight computes positions past a stop; the tree takes known ones.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
        self._release(request)

    def _num_steps(self) -> int:
        """--decode-steps when every row will decode (no prompt waits or is being prefilled),
        cut so that no row runs past its max_tokens or the model's length; else 1."""
        if self.decode_steps == 1 or self.waiting or not self.running:
            return 1
        if any(r.is_prefill or r.is_replaying for r in self.running):
            return 1  # NOTE: a replayed step feeds a known token, not the last sample
        if any(r.grammar is not None for r in self.running):
            return 1  # NOTE: each token's mask needs the one before, known to the controller
        if self._drafting():
            return 1  # NOTE: drafts are verified in a step of one iteration
        lefts = [self._outputs_left(r) for r in self.running]
        return max(1, min([self.decode_steps] + [n for n in lefts if n > 0]))

    def _outputs_left(self, request: Request) -> int:
        """Tokens it may still sample past those of the steps sent (0: a step in flight
        ends it by length; it gets no row)."""
        left = request.message.sampling.max_tokens - request.num_outputs_ahead
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - request.num_tokens_ahead + 1)
        return left

    def _drafting(self) -> bool:
        """Some running request drafts in its next step."""
        spec = self.speculator
        if spec is None:
            return False
        running = len(self.running)
        return any(not r.is_prefill and spec.wants_drafts(r, running) for r in self.running)

    def _schedule_decode(self, steps: int, ahead: bool) -> list[ScheduledRow] | None:
        """Decode rows, each with slots for `steps` positions from its pending token (and
        for its drafts); preempts the latest-admitted requests while the pool cannot give
        them (None, when ahead: the caller waits for the step in flight first, as it does
        where a request drafts or verifies drafts in it: its tokens are needed)."""
        if ahead and (any(r.verifying for r in self.running) or self._drafting()):
            return None
        decoding = [r for r in self.running if not r.is_prefill and self._outputs_left(r) > 0]
        # NOTE: each request's count once (a step's scheduling is ~4 us of Python a row)
        missing = [max(0, r.num_tokens_ahead - 1 + steps - len(r.slots)) for r in decoding]
        needed = sum(missing)
        if ahead and needed > self.kv.num_available:
            return None
        while needed > self.kv.num_available:
            victim = max(self.running, key=lambda r: r.arrival)
            if victim in decoding:
                i = decoding.index(victim)
                needed -= missing.pop(i)
                decoding.pop(i)
            self._preempt(victim)
        spare = self.kv.pool.num_free - needed - DECODE_SLOT_RUN * len(decoding)
        for request, short in zip(decoding, missing, strict=True):
            if short:
                extra = min(DECODE_SLOT_RUN - 1, self._slots_left(request) - short)
                extra = max(0, min(extra, spare))
                spare -= extra
                request.slots += self.kv.alloc(short + extra)
        if steps == 1 and self.speculator is not None:
            return [self._with_drafts(r, self.speculator) for r in decoding]
        return [ScheduledRow.of(r, 1, False) for r in decoding]

    def _with_drafts(self, request: Request, spec: Speculator) -> ScheduledRow:
        """The request's decode row, with the drafts it proposes where slots allow: they are
        optional, so a short pool cuts them instead of preempting anyone."""
        if request.is_replaying or not spec.wants_drafts(request, len(self.running)):
            return ScheduledRow.of(request, 1, False)
        drafts = spec.propose(request, self._outputs_left(request) - 1, len(self.running))
        short = request.num_tokens + len(drafts) - len(request.slots)
        if short > 0:
            drafts = drafts[: len(drafts) - max(0, short - self.kv.num_available)]
            short = request.num_tokens + len(drafts) - len(request.slots)
            if short > 0:
                request.slots += self.kv.alloc(short)
        return ScheduledRow.of(request, 1 + len(drafts), False, tuple(drafts))

    def _slots_left(self, request: Request) -> int:
        """Slots the request can still use: one per position it may yet be fed (the last
        token it samples is never fed back)."""
        last = request.num_prompt_tokens + request.message.sampling.max_tokens - 1
        if self.max_model_len is not None:
            last = min(last, self.max_model_len)
        return max(0, last - len(request.slots))

    def _has_room(self) -> bool:
        return len(self.running) < self.max_running and self.rows.num_free > 0

    def _admit(self, request: Request, match: Match | None) -> bool:
        if not self.kv.admit(request, len(self.running), match):
            return False
        request.row = self.rows.alloc(1)[0]
        self.running.append(request)
        return True

    def _shares_a_running_prefill(self, request: Request, cached: int) -> bool:
        """True when a request still prefilling computes more than half of what this one
        would compute beyond its `cached` tokens, or all of the prefix it says it shares
        with requests sent alongside it. NOTE: a prefix already cached is no reason to wait,
        nor are a few shared tokens past it: scoring items after a cached query go in
        together, even where many of them begin with the same word."""
        prefills = [o for o in self.running if o.is_prefill]
        if not prefills:
            return False
        tokens = request.tokens(0, request.max_cached_prefix)
        need = cached + (len(tokens) - cached) // 2 + 1
        shared = min(request.message.shared_prefix_len, len(tokens))
        if shared > cached:
            need = min(need, shared)
        if need > len(tokens):
            return False
        # NOTE: this runs for every request admitted while others prefill, against each of
        # them (256 scoring items: ~8,000 pairs a request): one token compared first, the
        # prefix (as one slice, in C) only where that token agrees.
        last, head = tokens[need - 1], tokens[:need]
        return any(
            o.cache_space == request.cache_space
            and len(o.prompt_ids) >= need
            and o.prompt_ids[need - 1] == last
            and o.prompt_ids[:need] == head
            for o in prefills
        )

    def _chunk(self, request: Request, budget: int) -> ScheduledRow:
        num_new = min(budget, request.num_prompt_tokens - request.num_computed_tokens)
        return ScheduledRow.of(request, num_new, True)

    def retract_all(self) -> int:
        """Every running request back to the queue, its KV released (computed tokens to the
        prefix cache), to be recomputed; how many. NOTE: no step may be in flight."""
        retracted = list(reversed(self.running))
        for request in retracted:
            self._preempt(request)
        return len(retracted)

    def retract_where(self, chosen: Callable[[Request], bool]) -> int:
        """retract_all for the running requests `chosen` picks; how many."""
        retracted = [r for r in reversed(self.running) if chosen(r)]
        for request in retracted:
            self._preempt(request)
        return len(retracted)

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
        self.kv.release(request)
        if request.row >= 0:
            self.rows.free([request.row])
            request.row = -1
