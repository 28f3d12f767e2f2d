"""Speculative decoding's controller half: the config, n-gram drafts, and when a request
stops drafting (controller process).

A decode row with drafts computes its pending token and the drafts after it as one chunk;
the worker samples at each position exactly as plain decoding would there and keeps the
drafts up to the first one its own sample disagrees with (tp_worker/model_runner._verify).
So which drafts are proposed changes only the speed, never a token or a logprob. N-gram
drafts are found here; a draft model's are written by the workers
(tp_worker/model/draft.py), into placeholders the controller sends in their place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.controller.request import Request

DRAFT_PLACEHOLDER = 0  # a draft the worker's draft model writes
MAX_DRAFTS = 16  # num_speculative_tokens at most (a verify step's iterations, 1 + drafts)
# NOTE: drafts that are rarely kept cost time: verifying k drafts computes a chunk of k + 1
# tokens where plain decoding computes one. A request proposes as many drafts as pay: draft i
# only if the chance that it is kept (the product of DraftState.odds up to it) is above
# StepCost.break_even. One that would propose none drafts nothing for OFF_OUTPUTS << strikes
# outputs (strikes: how often in a row, up to 4), then starts again from the prior.
OFF_OUTPUTS = 16
KEEP_DECAY = 0.95  # NOTE: the estimates follow a request's last ~20 steps with drafts
# A decode step costs a + b * tokens; a / b in tokens before any step is timed (SmolLM2 on
# two Zen 5 cores measured 13: 9.4 ms a step at 1 row, 14.0 ms at 8). On a GPU it is far
# larger, and found by the fit within a few steps.
PRIOR_FIXED_TOKENS = 16.0
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
    # per draft position i, decayed counts of its steps whose drafts reached i (every draft
    # before it kept) and of those that kept draft i
    reached: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)
    off_until: int = 0  # drafts nothing until it has this many outputs
    strikes: int = 0

    def odds(self, i: int) -> float:
        """The estimated chance that draft i is kept once every draft before it is: kept /
        reached, with a prior of one try kept (a request with no record drafts all it may:
        a cautious prior cost the repeating workload of benchmarks/serving/speculative.py a
        third of its gain at 8 users; one whose drafts all fail falls to 1 / 21). A position never
        reached is taken to be as likely as the one before it."""
        if i >= len(self.reached):
            return self.odds(i - 1) if i else 1.0
        return (self.kept[i] + 1.0) / (self.reached[i] + 1.0)

    def learn(self, num_drafts: int, num_kept: int) -> None:
        reached = min(num_drafts, num_kept + 1)  # NOTE: drafts after the first miss say nothing
        if reached > len(self.reached):
            self.reached += [0.0] * (reached - len(self.reached))
            self.kept += [0.0] * (reached - len(self.kept))
        for i in range(reached):
            self.reached[i] = KEEP_DECAY * self.reached[i] + 1.0
            self.kept[i] = KEEP_DECAY * self.kept[i] + (1.0 if i < num_kept else 0.0)

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


class StepCost:
    """A decode step's time as a + b * tokens, fitted by least squares over the steps the
    controller times (each sent alone, every row decoding), the older ones weighing less:
    what a draft costs against what a kept one saves, on this machine and model."""

    DECAY = 0.98  # NOTE: a step's weight halves 34 steps later
    MIN_WEIGHT = 8.0

    def __init__(self, prior_fixed_tokens: float = PRIOR_FIXED_TOKENS) -> None:
        self.prior = prior_fixed_tokens
        self.sums = [0.0] * 5  # weight, x, y, x * x, x * y (x: tokens, y: seconds)

    def observe(self, num_tokens: int, seconds: float) -> None:
        x, y = float(num_tokens), seconds
        new = (1.0, x, y, x * x, x * y)
        self.sums = [self.DECAY * s + v for s, v in zip(self.sums, new, strict=True)]

    def fixed_tokens(self) -> float:
        """a / b: a step's cost before its tokens, in tokens' worth; the prior until the
        steps timed vary enough in size to fit a line (and where the fit makes no sense)."""
        w, x, y, xx, xy = self.sums
        if w < self.MIN_WEIGHT:
            return self.prior
        mean_x, mean_y = x / w, y / w
        spread = xx / w - mean_x * mean_x
        if spread < 1.0:
            return self.prior
        b = (xy / w - mean_x * mean_y) / spread
        a = mean_y - b * mean_x
        if b <= 0 or a <= 0:
            return self.prior
        return min(max(a / b, 1.0), 65536.0)

    def break_even(self, num_rows: int) -> float:
        """The share of its drafts a row must keep for drafting to pay, in a step of
        `num_rows` decoding rows: a draft adds b to the step, a kept one saves a row's share
        of a plain step, (a + b * num_rows) / num_rows."""
        return num_rows / (self.fixed_tokens() + num_rows)


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.cost = StepCost()

    def wants_drafts(self, request: Request, num_running: int) -> bool:
        """Whether the request drafts in its next step (which then needs its last token)."""
        by_batch = self.config.disable_by_batch_size
        state = request.drafts
        if state is None or (by_batch and num_running > by_batch):
            return False
        if self.config.method == "draft_model" and request.grammar is not None:
            return False  # NOTE: see propose
        return len(request.output_ids) >= state.off_until

    def propose(self, request: Request, limit: int, num_rows: int = 1) -> list[int]:
        """Up to `limit` drafts, num_speculative_tokens, and as many as pay in a step of
        `num_rows` decoding rows: what followed the latest earlier occurrence of the longest
        n-gram (prompt_lookup_max down to _min tokens) that ends its tokens, cut where its
        grammar would refuse one. With a draft model, placeholders for its drafts, and none
        for a constrained request (the worker that writes them cannot ask the grammar)."""
        state = request.drafts
        assert state is not None
        paying = self._paying(state, num_rows)
        if paying == 0:
            self._pause(request, state)
        limit = min(limit, paying)
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

    def _paying(self, state: DraftState, num_rows: int) -> int:
        """How many drafts pay: each while the chance that it is kept stays above what it
        costs (StepCost.break_even)."""
        need = self.cost.break_even(num_rows)
        chance, count = 1.0, 0
        while count < self.config.num_speculative_tokens:
            chance *= state.odds(count)
            if chance < need:
                break
            count += 1
        return count

    def _pause(self, request: Request, state: DraftState) -> None:
        """No draft pays: none for a while, then a fresh start from the prior."""
        state.off_until = len(request.output_ids) + (OFF_OUTPUTS << state.strikes)
        state.strikes = min(state.strikes + 1, 4)
        state.reached.clear()
        state.kept.clear()

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
        state.learn(num_drafts, num_accepted)
        if num_accepted and state.strikes:
            state.strikes -= 1


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
