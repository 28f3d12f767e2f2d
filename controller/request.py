"""A request as the controller tracks it: counters, not phases (controller process).

"Prefill" and "decode" are derived from `num_computed_tokens` against the token count, which
makes chunked prefill, preemption-and-recompute and (later) prefix hits one mechanism.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.controller.radix_cache import Node
from tokenmill.protocol.arrays import unpack
from tokenmill.protocol.requests import DetokenizeParams, GenerateRequest

if TYPE_CHECKING:
    from tokenmill.controller.speculation import DraftState


@dataclass
class PromptScores:
    """Prompt logprobs gathered chunk by chunk until the prompt is done."""

    logprobs: list[np.ndarray] = field(default_factory=list)  # [p] float32 each
    top_ids: list[np.ndarray] = field(default_factory=list)  # [p, K] int32 each
    top_logprobs: list[np.ndarray] = field(default_factory=list)


@dataclass
class Request:
    message: GenerateRequest
    prompt_ids: list[int]
    arrival: int  # admission order, for preemption (latest first)
    output_ids: list[int] = field(default_factory=list)
    # NOTE: counts what the steps sent so far will have computed, also while one is in flight
    # (overlap scheduling); see `pending`.
    num_computed_tokens: int = 0
    slots: list[int] = field(default_factory=list)  # KV slot of each computed/allocated position
    row: int = -1  # row of the worker's request->slot table, -1 while waiting
    finish_reason: str | None = None
    finish_detail: str | None = None
    num_sent_outputs: int = 0  # output tokens already sent to the detokenizer
    announced: bool = False  # the detokenizer has this request's DetokenizeParams
    cache_node: Node | None = None  # locked end of the cached prefix this request reads
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    admitted_before: bool = False
    fill_table: bool = False  # the worker's table row needs slots[:num_computed_tokens]
    prompt_scores: PromptScores | None = None
    prompt_scores_sent: bool = False
    queued_at: float = 0.0  # time.monotonic() when it arrived
    pending: int = 0  # tokens the steps in flight sample for it (not in output_ids yet)
    # NOTE: an llguidance LLMatcher (controller/grammar.py) that has consumed output_ids;
    # typed Any so that this module does not import the grammar engine.
    grammar: Any = None
    drafts: DraftState | None = None  # None: it never drafts (no speculation, or opted out)
    verifying: bool = False  # a step in flight verifies its drafts (its length is unknown)
    # NOTE: its LoRA adapter (controller/lora_registry.py): the ranks' slot (-1: the base
    # model alone) and the prefix-cache space of that adapter's load (radix_cache.py)
    lora_slot: int = -1
    cache_space: int = 0

    @staticmethod
    def from_message(message: GenerateRequest, arrival: int) -> Request:
        prompt = unpack(message.input_ids).astype(np.int64).tolist()
        wants_prompt = message.logprobs.prompt_start >= 0
        return Request(
            message,
            prompt,
            arrival,
            prompt_scores=PromptScores() if wants_prompt else None,
            queued_at=time.monotonic(),
        )

    @property
    def req_id(self) -> str:
        return self.message.req_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens_ahead(self) -> int:
        """Tokens it will have once the steps in flight are back (unless one stops it)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def num_outputs_ahead(self) -> int:
        return len(self.output_ids) + self.pending

    @property
    def is_prefill(self) -> bool:
        """True until every prompt token is in the KV cache. Generated tokens are always
        computed one per step on the decode path, also when a preempted request recomputes
        them, so that their KV (and every later logprob) is bitwise what it was."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_replaying(self) -> bool:
        """After a preemption: generated tokens (not the pending last) still to recompute."""
        return self.num_prompt_tokens <= self.num_computed_tokens < self.num_tokens - 1

    def token_at(self, position: int) -> int:
        if position < len(self.prompt_ids):
            return self.prompt_ids[position]
        return self.output_ids[position - len(self.prompt_ids)]

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output (no copy of the rest: this
        runs for every row of every step)."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def max_cached_prefix(self) -> int:
        """How much of the prefix cache this request may use: all but its last token, and,
        when it scores prompt tokens from s, nothing from s - 1 on (the state at s - 1
        scores token s and must be computed)."""
        limit = self.num_tokens - 1
        if self.wants_prompt_scores:
            limit = min(limit, max(self.message.logprobs.prompt_start, 1) - 1)
        return limit

    @property
    def wants_prompt_scores(self) -> bool:
        return self.prompt_scores is not None and not self.prompt_scores_sent

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def announce(self) -> DetokenizeParams | None:
        """The detokenize params, with the first output the detokenizer gets, else None."""
        if self.announced:
            return None
        self.announced = True
        return self.message.detokenize
