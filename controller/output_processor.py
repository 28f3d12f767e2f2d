"""Applies a StepResult to the requests and says what each produced (controller process).

Appends sampled tokens, gathers prompt logprobs chunk by chunk, applies stop conditions,
and slices the step's arrays into one RequestOutput per request that has news.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from tokenmill.controller.request import Request
from tokenmill.controller.routed_experts import RoutedExperts
from tokenmill.controller.scheduler import ScheduledRow
from tokenmill.controller.speculation import Speculator
from tokenmill.protocol.arrays import Array, pack, pack_each, unpack
from tokenmill.protocol.outputs import PromptLogprobs, RequestOutput
from tokenmill.protocol.step import StepResult


class StepArrays:
    """A StepResult's arrays, each unpacked (a view of the message's bytes) when first read:
    most steps read only the sampled ids."""

    def __init__(self, result: StepResult, rows: list[ScheduledRow]) -> None:
        self.result = result
        self.rows = rows
        self._arrays: dict[str, np.ndarray] = {}
        self._packed: dict[str, list[Array]] = {}

    def array(self, name: str) -> np.ndarray:
        """The StepResult's field `name` ([N, ...] for the sampled arrays)."""
        got = self._arrays.get(name)
        if got is None:
            got = self._arrays[name] = unpack(getattr(self.result, name))
        return got

    @cached_property
    def ids_by_row(self) -> list[list[int]]:
        """Each batch row's sampled ids, one per iteration, as Python ints."""
        return self.array("next_ids").T.tolist()

    @cached_property
    def top_row(self) -> list[int]:
        """Each batch row's row in the top arrays, -1 = none."""
        top_row, seen = [], 0
        for row in self.rows:
            wants = row.request.message.logprobs.num_top > 0
            top_row.append(seen if wants else -1)
            seen += wants
        return top_row

    @cached_property
    def token_ids_offsets(self) -> list[int]:
        """[B + 1]: each batch row's first column in token_ids_logprobs."""
        offsets = [0]
        for row in self.rows:
            offsets.append(offsets[-1] + len(row.request.message.logprobs.token_ids))
        return offsets

    def share(self, name: str, index: int, n: int, k: int | None = None) -> Array:
        """pack(array[:n, index, ..., :k]) of the [N, ...] array `name`. NOTE: where a
        request takes all N iterations (and all K), its share comes from one pack_each
        of the whole array a step instead of one conversion per request."""
        array = self.array(name)
        if n == len(array) and (k is None or k == array.shape[-1]):
            if name not in self._packed:
                self._packed[name] = pack_each(array, axis=1)
            return self._packed[name][index]
        return pack(array[:n, index] if k is None else array[:n, index, :k])


class OutputProcessor:
    def __init__(
        self,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        speculator: Speculator | None = None,
        routing: RoutedExperts | None = None,
    ) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.speculator = speculator
        self.routing = routing

    def apply(self, rows: list[ScheduledRow], result: StepResult) -> list[RequestOutput]:
        arrays = StepArrays(result, rows)
        accepted = None if result.num_accepted is None else unpack(result.num_accepted).tolist()
        outputs = []
        for b, row in enumerate(rows):
            request = row.request
            request.verifying = False
            if request.finished:
                continue  # NOTE: stopped (or aborted) after this step was sent: nothing to say
            self._gather_prompt_scores(request, arrays, b)
            if row.samples:
                sampled = arrays.ids_by_row[b]
                if accepted is None:
                    request.pending -= len(sampled)
                else:
                    request.pending -= 1 + len(row.drafts)
                    sampled = self._kept(request, row, sampled, accepted[b])
                if not self._ends_at_prompt(request):
                    self._append_sampled(request, sampled)
            if row.samples or request.finished:
                outputs.append(self._output(request, arrays, b))
        return outputs

    def _kept(
        self, request: Request, row: ScheduledRow, sampled: list[int], kept: int
    ) -> list[int]:
        """A verifying step's samples for the row: those up to and including the one after
        its last kept draft. The positions of the drafts it did not keep are computed no
        more (their slots stay the request's, to be written again)."""
        if row.drafts:
            request.num_computed_tokens -= len(row.drafts) - kept
            assert self.speculator is not None, "drafts come from the speculator"
            self.speculator.record(request, len(row.drafts), kept)
        return sampled[: kept + 1]

    def _ends_at_prompt(self, request: Request) -> bool:
        """max_tokens 0 scores the prompt (lm-evaluation-harness' echo) and samples nothing."""
        if request.message.sampling.max_tokens == 0 and not request.output_ids:
            request.finish_reason = "length"
            return True
        return False

    def _gather_prompt_scores(self, request: Request, arrays: StepArrays, b: int) -> None:
        scores = request.prompt_scores
        if scores is None:
            return
        offsets = arrays.array("prompt_offsets")
        lo, hi = offsets[b], offsets[b + 1]
        if hi == lo:
            return
        k = request.message.logprobs.num_top
        scores.logprobs.append(arrays.array("prompt_logprobs")[lo:hi])
        scores.top_ids.append(arrays.array("prompt_top_ids")[lo:hi, :k])
        scores.top_logprobs.append(arrays.array("prompt_top_logprobs")[lo:hi, :k])

    def _append_sampled(self, request: Request, sampled: list[int]) -> None:
        """Appends one sampled token per decode iteration until the request stops; tokens
        past a stop are dropped (and the positions computed from them, when it is freed)."""
        for token in sampled:
            self._append(request, token)
            if request.finished:
                break

    def _append(self, request: Request, token: int) -> None:
        request.output_ids.append(token)
        params = request.message.sampling
        num_out = len(request.output_ids)
        is_eos = not params.ignore_eos and token in self.eos_token_ids
        # NOTE: as in vLLM, outputs [0, min_tokens) cannot stop (the worker masks stop ids
        # there): the first that can is output min_tokens, after min_tokens others.
        if num_out > params.min_tokens and (is_eos or token in params.stop_token_ids):
            request.finish_reason, request.finish_detail = "stop", str(token)
        elif request.grammar is not None and self._grammar_ends(request, token):
            pass
        elif num_out >= params.max_tokens or request.num_tokens >= self.max_model_len:
            request.finish_reason = "length"

    @staticmethod
    def _grammar_ends(request: Request, token: int) -> bool:
        """Advances the request's grammar by its new token; True when that ends the request:
        the grammar is complete and allows nothing more (as in vLLM, no eos is sampled
        then), or (never expected: the token was drawn under its mask) it rejects it."""
        grammar = request.grammar
        if not grammar.consume_token(token):
            request.finish_reason = "error"
            request.finish_detail = f"the grammar rejected token {token}: {grammar.get_error()}"
            return True
        if grammar.is_stopped():
            request.finish_reason = "stop"
            return True
        return False

    def _output(self, request: Request, arrays: StepArrays, b: int) -> RequestOutput:
        new_ids = request.output_ids[request.num_sent_outputs :]
        asks = request.message.logprobs
        n, k = len(new_ids), asks.num_top
        request.num_sent_outputs = len(request.output_ids)
        row = arrays.top_row[b] if k else -1
        # NOTE: the chosen tokens' logprobs come with any per-position logprobs (top or
        # token_ids): the detokenizer's entries are built around them.
        positions = asks.reads_samples
        return RequestOutput(
            req_id=request.req_id,
            new_ids=arrays.share("next_ids", b, n),  # NOTE: the step's first n samples
            logprobs=arrays.share("logprobs", b, n) if positions else None,
            top_ids=arrays.share("top_ids", row, n, k) if k else None,
            top_logprobs=arrays.share("top_logprobs", row, n, k) if k else None,
            token_ids_logprobs=self._token_ids_share(arrays, b, n) if asks.token_ids else None,
            prompt=self._prompt_output(request),
            finish_reason=request.finish_reason,
            finish_detail=request.finish_detail,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            detokenize=request.announce(),
            routed_experts=self.routed_experts(request),
        )

    def routed_experts(self, request: Request) -> Array | None:
        """With the last output, where asked: the experts of positions [start, prompt +
        output - 1), every one computed (the last sampled token never is), as SGLang
        counts them; read through the request's slots before they are freed (None where
        it holds none: preempted, or never started)."""
        start, end = request.message.routed_experts_start, request.num_tokens - 1
        if start < 0 or not request.finished or self.routing is None:
            return None
        if len(request.slots) < end or request.num_computed_tokens < end:
            return None
        return pack(self.routing.gather(request.slots[start:end]))

    @staticmethod
    def _token_ids_share(arrays: StepArrays, b: int, n: int) -> Array:
        lo, hi = arrays.token_ids_offsets[b], arrays.token_ids_offsets[b + 1]
        return pack(arrays.array("token_ids_logprobs")[:n, lo:hi])

    def _prompt_output(self, request: Request) -> PromptLogprobs | None:
        scores = request.prompt_scores
        if scores is None or request.prompt_scores_sent:
            return None
        request.prompt_scores_sent = True
        start = request.message.logprobs.prompt_start
        k = request.message.logprobs.num_top
        return PromptLogprobs(
            start=start,
            token_ids=pack(np.asarray(request.prompt_ids[start:], np.int32)),
            logprobs=pack(_cat(scores.logprobs, (0,), np.float32)),
            top_ids=pack(_cat(scores.top_ids, (0, k), np.int32)),
            top_logprobs=pack(_cat(scores.top_logprobs, (0, k), np.float32)),
        )


def _cat(parts: list[np.ndarray], empty: tuple[int, ...], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(empty, dtype)
