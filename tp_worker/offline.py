"""In-process generation over a ModelRunner, with no server: the reference the tests, the
`tokenmill generate` demo and the benchmarks use.

It is a deliberately tiny scheduler: each request gets one table row and a contiguous range
of KV slots; prompts are prefilled in chunks of at most `max_prefill_tokens`, then all rows
decode together. The real controller (controller/) makes the same ForwardBatch messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenmill.protocol.arrays import pack, unpack
from tokenmill.protocol.step import ForwardBatch, LogprobAsks, SamplingBatch, StepResult
from tokenmill.tp_worker.model_runner import ModelRunner


@dataclass(frozen=True)
class OfflineRequest:
    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    num_top: int = 0
    token_ids: tuple[int, ...] = ()
    prompt_logprob_start: int = -1
    """Score prompt tokens from this position (-1 = none); position 0 is never scored."""
    stop_at_eos: bool = False


@dataclass
class OfflineOutput:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[np.ndarray] = field(default_factory=list)  # per token [num_top] int32
    top_logprobs: list[np.ndarray] = field(default_factory=list)
    token_ids_logprobs: list[np.ndarray] = field(default_factory=list)  # per token [M]
    prompt_logprobs: list[float] = field(default_factory=list)  # from max(start, 1)
    prompt_top_ids: list[np.ndarray] = field(default_factory=list)
    prompt_top_logprobs: list[np.ndarray] = field(default_factory=list)


@dataclass
class _Row:
    index: int
    request: OfflineRequest
    slot_base: int
    num_computed: int = 0
    output: OfflineOutput = field(default_factory=OfflineOutput)
    done: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output.output_ids


class OfflineEngine:
    def __init__(
        self, runner: ModelRunner, max_prefill_tokens: int = 4096, decode_steps: int = 1
    ) -> None:
        self.runner = runner
        self.max_prefill_tokens = max_prefill_tokens
        self.decode_steps = decode_steps
        self.eos_ids = set(runner.model_config.eos_token_ids)
        self.step_id = 0

    def generate(self, requests: list[OfflineRequest]) -> list[OfflineOutput]:
        cfg = self.runner.config
        per_row = cfg.kv_cache_tokens // max(1, len(requests))
        if len(requests) > cfg.max_running_requests:
            raise ValueError("more requests than table rows")
        rows = [_Row(i, r, i * per_row) for i, r in enumerate(requests)]
        for row in rows:
            if len(row.request.prompt_ids) + row.request.max_tokens + self.decode_steps > per_row:
                raise ValueError(f"request needs more than the {per_row} slots a row gets")
        while any(not r.done for r in rows):
            prefilling = [r for r in rows if r.num_computed < len(r.request.prompt_ids)]
            if prefilling:
                self._run(self._prefill_rows(prefilling), 1)
            else:
                self._run([(r, 1) for r in rows if not r.done], self.decode_steps)
        return [r.output for r in rows]

    def _prefill_rows(self, rows: list[_Row]) -> list[tuple[_Row, int]]:
        budget, chosen = self.max_prefill_tokens, []
        for row in rows:
            take = min(budget, len(row.request.prompt_ids) - row.num_computed)
            if take <= 0:
                break
            chosen.append((row, take))
            budget -= take
        return chosen

    def _run(self, plan: list[tuple[_Row, int]], steps: int) -> None:
        batch = self._batch(plan, steps)
        result = self.runner.step(batch)
        self._absorb(plan, batch, result)

    def _batch(self, plan: list[tuple[_Row, int]], steps: int) -> ForwardBatch:
        ids, slots, prompt_start, next_ids = [], [], [], []
        for row, take in plan:
            lo, hi = row.num_computed, row.num_computed + take
            ids += row.tokens[lo:hi]
            slots += list(range(row.slot_base + lo, row.slot_base + hi))
            prompt_len = len(row.request.prompt_ids)
            wants = row.request.prompt_logprob_start >= 0 and lo < prompt_len
            prompt_start.append(row.request.prompt_logprob_start if wants else -1)
            next_ids.append(row.request.prompt_ids[hi] if hi < prompt_len else -1)
        rq = [row.request for row, _ in plan]
        seq_ends = [row.num_computed + take for row, take in plan]
        return ForwardBatch(
            step_id=self._next_step_id(),
            input_ids=_i32(ids),
            out_slots=_i32(slots),
            req_rows=_i32([row.index for row, _ in plan]),
            prefix_lens=_i32([row.num_computed for row, _ in plan]),
            extend_lens=_i32([take for _, take in plan]),
            is_prefill=pack(
                np.array([r.num_computed < len(r.request.prompt_ids) for r, _ in plan], dtype=bool)
            ),
            fill_rows=_i32([]),
            fill_lens=_i32([]),
            fill_slots=_i32([]),
            sampling=SamplingBatch(
                temperature=pack(np.array([r.temperature for r in rq], np.float32)),
                top_k=_i32([r.top_k for r in rq]),
                top_p=pack(np.array([r.top_p for r in rq], np.float32)),
                min_p=pack(np.array([r.min_p for r in rq], np.float32)),
                seed=pack(np.array([r.seed for r in rq], np.int64)),
            ),
            logprobs=LogprobAsks(
                num_top=_i32([r.num_top for r in rq]),
                token_ids_offsets=_i32(np.cumsum([0] + [len(r.token_ids) for r in rq])),
                token_ids=_i32([t for r in rq for t in r.token_ids]),
                prompt_start=_i32(prompt_start),
                prompt_next_id=_i32(next_ids),
            ),
            num_steps=steps,
            decode_slots=_i32(
                [
                    [row.slot_base + end + i for (row, _), end in zip(plan, seq_ends, strict=True)]
                    for i in range(steps - 1)
                ]
            )
            if steps > 1
            else None,
        )

    def _absorb(
        self, plan: list[tuple[_Row, int]], batch: ForwardBatch, result: StepResult
    ) -> None:
        next_ids, logprobs = unpack(result.next_ids), unpack(result.logprobs)
        top_ids, top_lps = unpack(result.top_ids), unpack(result.top_logprobs)
        tid_lps = unpack(result.token_ids_logprobs)
        p_off = unpack(result.prompt_offsets)
        tid_off = unpack(batch.logprobs.token_ids_offsets)
        top_row = 0
        for b, (row, take) in enumerate(plan):
            out, req = row.output, row.request
            lo, hi = p_off[b], p_off[b + 1]
            out.prompt_logprobs += unpack(result.prompt_logprobs)[lo:hi].tolist()
            out.prompt_top_ids += list(unpack(result.prompt_top_ids)[lo:hi, : req.num_top])
            out.prompt_top_logprobs += list(
                unpack(result.prompt_top_logprobs)[lo:hi, : req.num_top]
            )
            row.num_computed += take
            if row.num_computed < len(req.prompt_ids):
                top_row += req.num_top > 0
                continue
            for n in range(next_ids.shape[0]):
                if row.done:
                    break
                if n > 0:
                    row.num_computed += 1
                token = int(next_ids[n, b])
                out.output_ids.append(token)
                out.logprobs.append(float(logprobs[n, b]))
                if req.num_top:
                    out.top_ids.append(top_ids[n, top_row, : req.num_top])
                    out.top_logprobs.append(top_lps[n, top_row, : req.num_top])
                out.token_ids_logprobs.append(tid_lps[n, tid_off[b] : tid_off[b + 1]])
                eos = req.stop_at_eos and token in self.eos_ids
                row.done = eos or len(out.output_ids) >= req.max_tokens
            top_row += req.num_top > 0

    def _next_step_id(self) -> int:
        self.step_id += 1
        return self.step_id


def _i32(values: object) -> object:
    return pack(np.asarray(values, dtype=np.int32))
