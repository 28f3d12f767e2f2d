"""/metrics (main process), through prometheus_client: the HTTP layer's counters and
histograms, and the engine's gauges (`EngineStats`, updated by the controllers' reports),
read at scrape time. Every series lives in this one process (the engine's numbers arrive
as reports), so prometheus_client's multiprocess mode is not needed; each app has its own
registry, so that several apps in one process (tests) do not share counters.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.frontend.engine.client import EngineStats
from tokenmill.protocol.outputs import DetokenizedOutput

PREFIX = "tokenmill_"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# NOTE: no `_created` sample beside each counter: the names stay those scrapers already know.
disable_created_metrics()


class ApiMetrics:
    def __init__(
        self, stats: Callable[[], EngineStats] | None = None, model_name: str = ""
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX
        self.requests_started = Counter(
            p + "requests_started", "Requests submitted to the engine.", registry=r
        )
        self.finished = Counter(
            p + "requests_finished", "Requests finished, by finish reason.", ["finish_reason"],
            registry=r,
        )  # fmt: skip
        self.http_errors = Counter(
            p + "http_errors", "Error responses, by HTTP status.", ["status"], registry=r
        )
        self.logprob_requests = Counter(
            p + "logprob_requests", "Requests that asked for logprobs.", registry=r
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Time to first token.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            p + "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "Request latency.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        if stats is not None:
            self.registry.register(EngineCollector(stats))
            self.registry.register(VllmGauges(stats, model_name))

    def on_start(self, num_requests: int, wants_logprobs: bool) -> None:
        self.requests_started.inc(num_requests)
        if wants_logprobs:
            self.logprob_requests.inc(num_requests)

    def on_output(self, out: DetokenizedOutput, elapsed: float, first: bool) -> None:
        self.generation_tokens.inc(len(out.token_ids))
        if first and out.token_ids:
            self.ttft.observe(elapsed)
        if out.finish_reason is None:
            return
        self.finished.labels(out.finish_reason).inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.e2e.observe(elapsed)

    def on_tpot(self, seconds_per_token: float) -> None:
        self.tpot.observe(seconds_per_token)

    def on_aborted(self, num_requests: int) -> None:
        if num_requests:
            self.finished.labels("abort").inc(num_requests)

    def on_error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """The engine's reported numbers at scrape time; with replicas (--data-parallel-size >
    1) one sample per replica, labelled replica="d"."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        yield _gauge("engine_alive", "1 while the engine runs.", {"": int(stats.alive)})
        replicas = stats.per_replica()

        def each(value: Callable[[EngineStats], float]) -> dict[str, float]:
            if not stats.replicas:
                return {"": value(stats)}
            return {str(d): value(r) for d, r in enumerate(replicas)}

        yield _gauge("num_requests_running", "Requests being decoded.", each(_running))
        yield _gauge("num_requests_waiting", "Requests in the waiting queue.", each(_waiting))
        yield _gauge(
            "kv_slots_used",
            "KV cache slots held by requests (cached prefixes that can be evicted are free).",
            each(_used),
        )
        yield _gauge("kv_slots_total", "KV cache slots.", each(_total))
        yield _gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache slots held by requests, 0 to 1 (as vLLM's).",
            each(_usage),
        )
        yield _counter(
            "prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache.",
            each(_queried),
        )
        yield _counter(
            "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", each(_hits)
        )
        yield from _spec_metrics(stats, replicas)
        for key in sorted({key for r in replicas for key in r.extra}):
            name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
            values = each(lambda s, key=key: s.extra.get(key, 0.0))  # type: ignore[misc]
            yield _gauge(name, f"Engine report field {key}.", values)


class VllmGauges(Collector):
    """The gauges a gateway's endpoint picker reads under vLLM's names (the Gateway API
    Inference Extension, llm-d): the same values as tokenmill_num_requests_waiting,
    _running and _kv_cache_usage_perc, labelled as vLLM labels them (model_name, and
    engine per replica)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        replicas: list[tuple[int | None, EngineStats]] = (
            list(enumerate(stats.per_replica())) if stats.replicas else [(None, stats)]
        )
        for name, help_text, value in (
            ("vllm:num_requests_running", "Requests being decoded.", _running),
            ("vllm:num_requests_waiting", "Requests waiting to be started.", _waiting),
            ("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1.", _usage),
        ):
            labels = ["model_name"] if not stats.replicas else ["model_name", "engine"]
            family = GaugeMetricFamily(name, help_text, labels=labels)
            for d, replica in replicas:
                engine = [] if d is None else [str(d)]
                family.add_metric([self.model_name, *engine], value(replica))
            yield family
        yield from _lora_info(replicas)


def _lora_info(replicas: list[tuple[int | None, EngineStats]]) -> Iterator[Metric]:
    """vLLM's lora_requests_info (--enable-lora): the adapters of running and of waiting
    requests, comma-separated in labels; its value the time of the engine's last report, so
    that a reader takes the newest sample (as vLLM's)."""
    if not any(r.lora for _, r in replicas):
        return
    labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
    if replicas[0][0] is not None:
        labels.append("engine")
    family = GaugeMetricFamily(
        "vllm:lora_requests_info", "Running stats on LoRA requests.", labels=labels
    )
    now = time.time()
    for d, replica in replicas:
        if replica.lora is not None:
            slots, running, waiting = replica.lora
            engine = [] if d is None else [str(d)]
            values = [str(slots), ",".join(running), ",".join(waiting), *engine]
            age = time.monotonic() - replica.last_report
            family.add_metric(values, now - age)
    yield family


def _spec_metrics(stats: EngineStats, replicas: list[EngineStats]) -> Iterator[Metric]:
    """vLLM's spec_decode_* counters, where the engine speculates (--speculative-config)."""
    if not any(r.spec for r in replicas):
        return
    names = (
        ("spec_decode_num_drafts", "Rows of steps that verified drafts."),
        ("spec_decode_num_draft_tokens", "Draft tokens verified."),
        ("spec_decode_num_accepted_tokens", "Draft tokens kept (each the model's own sample)."),
    )
    for i, (name, help_text) in enumerate(names):
        values = {
            ("" if not stats.replicas else str(d)): float(r.spec[i] if r.spec else 0)
            for d, r in enumerate(replicas)
        }
        yield _counter(name, help_text, values)
    labels = ["position"] if not stats.replicas else ["replica", "position"]
    family = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens kept, by their place among a step's drafts (0 = the first).",
        labels=labels,
    )
    for d, r in enumerate(replicas):
        for position, count in enumerate(r.spec[3] if r.spec else ()):
            replica = [str(d)] if stats.replicas else []
            family.add_metric([*replica, str(position)], count)
    yield family


def _running(s: EngineStats) -> float:
    return s.num_running


def _waiting(s: EngineStats) -> float:
    return s.num_waiting


def _used(s: EngineStats) -> float:
    return s.kv_slots_total - s.kv_slots_free


def _total(s: EngineStats) -> float:
    return s.kv_slots_total


def _usage(s: EngineStats) -> float:
    return _used(s) / s.kv_slots_total if s.kv_slots_total else 0.0


def _queried(s: EngineStats) -> float:
    return s.prefix_queried_tokens


def _hits(s: EngineStats) -> float:
    return s.prefix_hit_tokens


def _gauge(name: str, help_text: str, values: dict[str, float]) -> Metric:
    return _family(GaugeMetricFamily, name, help_text, values)


def _counter(name: str, help_text: str, values: dict[str, float]) -> Metric:
    return _family(CounterMetricFamily, name, help_text, values)


def _family(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    help_text: str,
    values: dict[str, float],
) -> Metric:
    """`values` maps a replica ("" without replicas) to its sample."""
    labels = [] if "" in values else ["replica"]
    family = kind(PREFIX + name, help_text, labels=labels)
    for replica, value in values.items():
        family.add_metric([replica] if replica else [], value)
    return family
