"""Aggregates of a `tokenmill bench` run (client process): throughput and latency percentiles.

From the per-request results of `client.run_requests`: counts, token throughput, and mean /
median / p99 of TTFT, TPOT (per request: time after the first token over the tokens after
it) and ITL (every gap between content chunks), in milliseconds; as a table and a JSON dict.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tokenmill.cli.bench.client import RequestResult

PERCENTILES = (50, 99)


@dataclass(frozen=True)
class Stats:
    """Mean, median and 99th percentile of one latency, in milliseconds (0 when no data)."""

    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Stats:
        if not seconds:
            return cls(0.0, 0.0, 0.0)
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        median, p99 = np.percentile(ms, PERCENTILES)
        return cls(float(ms.mean()), float(median), float(p99))


@dataclass(frozen=True)
class BenchMetrics:
    """What a run measured; `to_dict()` is the --json output."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    """Successful requests per second."""
    input_throughput: float
    """Prompt tokens of successful requests per second."""
    output_throughput: float
    """Generated tokens of successful requests per second."""
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    errors: dict[str, int] = field(default_factory=dict)
    """Error text -> how many requests failed with it."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tpot(result: RequestResult) -> float | None:
    """Seconds per output token after the first; None for fewer than 2 tokens."""
    if result.output_len < 2:
        return None
    return (result.latency - result.ttft) / (result.output_len - 1)


def compute_metrics(results: list[RequestResult], duration_s: float) -> BenchMetrics:
    """Aggregate `results` of a run that took `duration_s` seconds of wall time."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    tpots = [t for t in map(tpot, ok) if t is not None]
    return BenchMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) * per_s,
        input_throughput=input_tokens * per_s,
        output_throughput=output_tokens * per_s,
        ttft_ms=Stats.of([r.ttft for r in ok]),
        tpot_ms=Stats.of(tpots),
        itl_ms=Stats.of([gap for r in ok for gap in r.itl]),
        errors=dict(Counter(r.error for r in results if not r.success).most_common()),
    )


def _row(label: str, value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40}{text:>12}"


def format_table(metrics: BenchMetrics, title: str = "Serving Benchmark Result") -> str:
    """The human-readable report, in the layout of `vllm bench serve`."""
    m = metrics
    lines = [
        f"{f' {title} ':=^52}",
        _row("Successful requests:", m.completed),
        _row("Failed requests:", m.failed),
        _row("Benchmark duration (s):", m.duration_s),
        _row("Total input tokens:", m.total_input_tokens),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Input token throughput (tok/s):", m.input_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
    ]
    for name, long_name, stats in (
        ("TTFT", "Time to First Token", m.ttft_ms),
        ("TPOT", "Time per Output Token (excl. 1st token)", m.tpot_ms),
        ("ITL", "Inter-token Latency", m.itl_ms),
    ):
        lines.append(f"{f' {long_name} ':-^52}")
        lines.append(_row(f"Mean {name} (ms):", stats.mean))
        lines.append(_row(f"Median {name} (ms):", stats.median))
        lines.append(_row(f"P99 {name} (ms):", stats.p99))
    if m.errors:
        lines.append(f"{' Errors ':-^52}")
        lines.extend(f"{count:>6} x {text[:100]}" for text, count in m.errors.items())
    lines.append("=" * 52)
    return "\n".join(lines)
