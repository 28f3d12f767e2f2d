"""Speculative decoding's controller half: the config, n-gram drafts, and when a request
stops drafting (controller process).

A decode row with drafts computes its pending token and the drafts after it as one chunk;
the worker samples at each position exactly as plain decoding would there and keeps the
drafts up to the first one its own sample disagrees with (tp_worker/model_runner._verify).
So which drafts are proposed changes only the speed, never a token or a logprob. N-gram
drafts are found here; a draft model's are written by the workers
(tp_worker/draft_model.py), into placeholders the controller sends in their place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.controller.request import Request

DRAFT_PLACEHOLDER = 0  # a draft the worker's draft model writes
MAX_DRAFTS = 16  # num_speculative_tokens at most (a verify step's iterations, 1 + drafts)
# NOTE: a request whose drafts are rarely kept stops drafting: verifying k drafts costs a
# chunk of k + 1 tokens where plain decoding computes one. Judged over its last WINDOW
# steps with drafts, it needs MIN_KEPT kept drafts a step on average; below that it drafts
# nothing for OFF_OUTPUTS << strikes outputs (strikes: how often it fell below, up to 4).
WINDOW = 8
MIN_KEPT = 0.5
OFF_OUTPUTS = 16
SPEC_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "disable_by_batch_size",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config, as far as tokenmill serves it."""

    method: str = "ngram"  # or draft_model
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 0  # 0 = never; else no drafts while more requests run
    model: str = ""  # the draft model's checkpoint (method draft_model)

    @staticmethod
    def parse(text: str) -> SpeculativeConfig | None:
        """The flag's JSON; None for an empty one. ValueError names what is wrong."""
        if not text.strip():
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        unknown = sorted(set(raw) - SPEC_KEYS)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown key(s) {unknown}; known: {sorted(SPEC_KEYS)}"
            )
        return SpeculativeConfig._from(raw)

    def with_model(self, model: str) -> str:
        """The flag's JSON with the draft model at `model` (a resolved directory)."""
        raw = {
            "model": model,
            "num_speculative_tokens": self.num_speculative_tokens,
            "disable_by_batch_size": self.disable_by_batch_size,
        }
        return json.dumps(raw)

    @staticmethod
    def _from(raw: dict[str, Any]) -> SpeculativeConfig:
        method = raw.get("method", "draft_model" if "model" in raw else "ngram")
        if method in ("eagle", "eagle3", "medusa", "mtp"):
            raise ValueError(
                f"--speculative-config: method {method!r} is not served; use ngram or "
                'draft_model ({"model": DIR, "num_speculative_tokens": K})'
            )
        if method == "draft_model":
            return SpeculativeConfig._draft_model(raw)
        if method != "ngram":
            raise ValueError(
                f"--speculative-config: unknown method {method!r}; use ngram or draft_model"
            )
        if "model" in raw:
            raise ValueError('--speculative-config: "model" goes with method draft_model')
        k = _int(raw, "num_speculative_tokens", 4, 1, MAX_DRAFTS)
        high = _int(raw, "prompt_lookup_max", 4, 1, 64)
        low = _int(raw, "prompt_lookup_min", min(2, high), 1, 64)
        if low > high:
            raise ValueError(
                f"--speculative-config: prompt_lookup_min {low} > prompt_lookup_max {high}"
            )
        by_batch = _int(raw, "disable_by_batch_size", 0, 0, 1 << 20)
        return SpeculativeConfig("ngram", k, high, low, by_batch)

    @staticmethod
    def _draft_model(raw: dict[str, Any]) -> SpeculativeConfig:
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(
                '--speculative-config: method draft_model needs "model": a checkpoint '
                "directory or GGUF file with the target's tokenizer"
            )
        lookup = sorted(k for k in raw if k.startswith("prompt_lookup"))
        if lookup:
            raise ValueError(f"--speculative-config: {lookup} apply to method ngram only")
        k = _int(raw, "num_speculative_tokens", 4, 1, MAX_DRAFTS)
        by_batch = _int(raw, "disable_by_batch_size", 0, 0, 1 << 20)
        return SpeculativeConfig("draft_model", k, disable_by_batch_size=by_batch, model=model)


def _int(raw: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"--speculative-config: {key} must be an integer in {low}..{high}")
    return value


@dataclass
class DraftState:
    """A request's n-gram index and its record of kept drafts."""

    history: bytearray = field(default_factory=bytearray)  # its tokens, 4 bytes each
    num_synced: int = 0  # tokens in `history`
    recent: list[int] = field(default_factory=list)  # kept drafts of its last steps with drafts
    off_until: int = 0  # drafts nothing until it has this many outputs
    strikes: int = 0

    def sync(self, request: Request) -> None:
        n = request.num_tokens
        if n > self.num_synced:
            tokens = request.tokens(self.num_synced, n)
            self.history += b"".join(t.to_bytes(4, "little") for t in tokens)
            self.num_synced = n


@dataclass
class SpecCounters:
    """Totals for /metrics, named as vLLM's spec_decode_* counters."""

    num_drafts: int = 0  # rows that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)

    def wants_drafts(self, request: Request, num_running: int) -> bool:
        """Whether the request drafts in its next step (which then needs its last token)."""
        by_batch = self.config.disable_by_batch_size
        state = request.drafts
        if state is None or (by_batch and num_running > by_batch):
            return False
        if self.config.method == "draft_model" and request.grammar is not None:
            return False  # NOTE: see propose
        return len(request.output_ids) >= state.off_until

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to `limit` drafts (and num_speculative_tokens): what followed the latest earlier
        occurrence of the longest n-gram (prompt_lookup_max down to _min tokens) that ends
        its tokens; cut where its grammar would refuse one. With a draft model,
        placeholders for its drafts, and none for a constrained request (the worker that
        writes them cannot ask the grammar)."""
        state = request.drafts
        assert state is not None
        limit = min(limit, self.config.num_speculative_tokens)
        if limit <= 0:
            return []
        if self.config.method == "draft_model":
            return [] if request.grammar is not None else [DRAFT_PLACEHOLDER] * limit
        state.sync(request)
        drafts = _lookup(
            state.history, self.config.prompt_lookup_min, self.config.prompt_lookup_max, limit
        )
        if drafts and request.grammar is not None:
            drafts = drafts[: request.grammar.validate_tokens(drafts)]
        return drafts

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` of the request's drafts and kept `num_accepted`."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            c.accepted_per_pos[i] += 1
        state = request.drafts
        assert state is not None
        state.recent.append(num_accepted)
        if len(state.recent) < WINDOW:
            return
        if sum(state.recent) < MIN_KEPT * WINDOW:
            state.off_until = len(request.output_ids) + (OFF_OUTPUTS << state.strikes)
            state.strikes = min(state.strikes + 1, 4)
        elif state.strikes:
            state.strikes -= 1
        state.recent.clear()


def _lookup(history: bytearray, low: int, high: int, limit: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix n-gram of
    `history` (int32 tokens as bytes), n from `high` down to `low`. NOTE: bytes.rfind runs
    the search in C; a hit not on a token boundary is skipped."""
    total = len(history) // 4
    for n in range(min(high, total - 1), low - 1, -1):
        pattern = bytes(history[-4 * n :])
        end = len(history) - 4  # NOTE: the occurrence must have a token after it
        while True:
            at = history.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at + 4 * n
                tail = history[start : start + 4 * limit]
                return [int.from_bytes(tail[i : i + 4], "little") for i in range(0, len(tail), 4)]
            end = at + len(pattern) - 1
    return []
