"""Prometheus text for /metrics (main process): the HTTP layer's counters and the engine's
gauges (`EngineStats`, updated by the controller's reports), in exposition format 0.0.4.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tokenmill.frontend.engine.client import EngineStats
from tokenmill.protocol.outputs import DetokenizedOutput

PREFIX = "tokenmill_"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        i = bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        counts = self.counts or [0] * len(self.buckets)
        for bound, n in zip(self.buckets, counts, strict=True):
            cumulative += n
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return out


def _metric(name: str, kind: str, help_text: str, samples: Mapping[str, float]) -> list[str]:
    """`samples` maps a label string ("" or '{k="v"}') to a value."""
    full = PREFIX + name
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    lines += [f"{full}{labels} {value}" for labels, value in samples.items()]
    return lines


@dataclass
class ApiMetrics:
    """Counters the HTTP layer keeps, per engine request (one per prompt and choice)."""

    requests_started: int = 0
    logprob_requests: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    http_errors: Counter[int] = field(default_factory=Counter)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))

    def on_start(self, num_requests: int, wants_logprobs: bool) -> None:
        self.requests_started += num_requests
        if wants_logprobs:
            self.logprob_requests += num_requests

    def on_output(self, out: DetokenizedOutput, elapsed: float, first: bool) -> None:
        self.generation_tokens += len(out.token_ids)
        if first and out.token_ids:
            self.ttft.observe(elapsed)
        if out.finish_reason is None:
            return
        self.finished[out.finish_reason] += 1
        self.prompt_tokens += out.num_prompt_tokens
        self.e2e.observe(elapsed)

    def on_tpot(self, seconds_per_token: float) -> None:
        self.tpot.observe(seconds_per_token)

    def render(self, stats: EngineStats) -> str:
        finished = {f'{{finish_reason="{k}"}}': v for k, v in sorted(self.finished.items())}
        errors = {f'{{status="{k}"}}': v for k, v in sorted(self.http_errors.items())}
        table: list[tuple[str, str, str, Mapping[str, float]]] = [
            ("requests_started_total", "counter", "Requests submitted to the engine.",
             {"": self.requests_started}),
            ("requests_finished_total", "counter", "Requests finished, by finish reason.",
             finished),
            ("http_errors_total", "counter", "Error responses, by HTTP status.", errors),
            ("logprob_requests_total", "counter", "Requests that asked for logprobs.",
             {"": self.logprob_requests}),
            ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
             {"": self.prompt_tokens}),
            ("generation_tokens_total", "counter", "Generated tokens.",
             {"": self.generation_tokens}),
            ("engine_alive", "gauge", "1 while the engine runs.", {"": int(stats.alive)}),
        ]  # fmt: skip
        table += _engine_rows(stats)
        lines = [line for row in table for line in _metric(*row)]
        lines += self.ttft.lines(PREFIX + "time_to_first_token_seconds", "Time to first token.")
        lines += self.tpot.lines(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
        )
        lines += self.e2e.lines(PREFIX + "e2e_request_latency_seconds", "Request latency.")
        return "\n".join(lines) + "\n"


def _engine_rows(stats: EngineStats) -> list[tuple[str, str, str, Mapping[str, float]]]:
    """The engine's reported gauges and counters; with replicas (--data-parallel-size > 1)
    one sample per replica, labelled replica="d"."""
    replicas = stats.per_replica()

    def each(value: Callable[[EngineStats], float]) -> dict[str, float]:
        if not stats.replicas:
            return {"": value(stats)}
        return {f'{{replica="{d}"}}': value(r) for d, r in enumerate(replicas)}

    rows: list[tuple[str, str, str, Mapping[str, float]]] = [
        ("num_requests_running", "gauge", "Requests being decoded.", each(lambda s: s.num_running)),
        ("num_requests_waiting", "gauge", "Requests in the waiting queue.",
         each(lambda s: s.num_waiting)),
        ("kv_slots_used", "gauge",
         "KV cache slots held by requests (cached prefixes that can be evicted are free).",
         each(lambda s: s.kv_slots_total - s.kv_slots_free)),
        ("kv_slots_total", "gauge", "KV cache slots.", each(lambda s: s.kv_slots_total)),
        ("prefix_cache_queried_tokens_total", "counter",
         "Prompt tokens looked up in the prefix cache.", each(lambda s: s.prefix_queried_tokens)),
        ("prefix_cache_hit_tokens_total", "counter",
         "Prompt tokens found in the prefix cache.", each(lambda s: s.prefix_hit_tokens)),
    ]  # fmt: skip
    keys = sorted({key for r in replicas for key in r.extra})
    for key in keys:
        name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
        samples = each(lambda s, key=key: s.extra.get(key, 0.0))  # type: ignore[misc]
        rows.append((name, "gauge", f"Engine report field {key}.", samples))
    return rows
