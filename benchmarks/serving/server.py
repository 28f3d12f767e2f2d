"""Shared by the serving benchmarks: start and stop one `tokenmill serve`, drive it with
random prompts, read its /metrics and its processes' CPU time, count a layer's multiply-adds,
name the CPU.

The benchmarks are scripts (python benchmarks/serving/NAME.py); this module sits next to
them. The checkpoint arguments (--model, --preset) are benchmarks/checkpoints.py's.
"""

from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from tokenmill.cli.bench.client import BenchOptions, RequestResult, fetch_model_id, run_requests
from tokenmill.cli.bench.datasets import random_requests
from tokenmill.cli.bench.metrics import tpot
from tokenmill.cli.server_subprocess import launch, stop
from tokenmill.tp_worker.model.config import ModelConfig


def start_server(
    model: Path,
    server_args: list[str],
    log_path: Path,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """`tokenmill serve --model MODEL *server_args` on a free port (`env` added to this
    process's environment), once /health answers."""
    return launch(model, server_args, log_path, env=env, timeout=timeout)


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """A benchmark's server variant as written on its command line, "GOMP_SPINCOUNT=0
    --decode-steps 4": the leading NAME=VALUE words (the server's environment) and the
    `tokenmill serve` flags after them."""
    env: dict[str, str] = {}
    words = list(words)
    while words and "=" in words[0] and words[0].split("=")[0].isupper():
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def start_variant(
    model: Path,
    variant: str,
    flags: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """start_server with `flags` and a variant as written on a benchmark's command line
    ("GOMP_SPINCOUNT=0 --decode-steps 4"): its environment words added to `env`, its flags
    after `flags`."""
    more_env, words = split_env(shlex.split(variant))
    return start_server(model, [*flags, *words], log_path, env={**(env or {}), **more_env})


def stop_server(proc: subprocess.Popen) -> int:
    return stop(proc)


async def stream_random(
    base_url: str,
    count: int,
    input_len: int,
    output_len: int,
    users: int,
    seed: int,
    logprobs: int = 0,
) -> tuple[list[RequestResult], float]:
    """`count` random token-id prompts of `input_len` (vLLM's `bench serve` random workload),
    `output_len` tokens each (ignore_eos), streamed through /v1/completions `users` at a time
    with `logprobs` top logprobs; their results and the run's wall seconds. Raises if any
    request failed: a figure over fewer requests than asked would compare nothing."""
    model = await fetch_model_id(base_url)
    opts = BenchOptions(base_url=base_url, model=model, logprobs=logprobs, ignore_eos=True)
    requests = random_requests(
        count, input_len, output_len, as_text=False, vocab_size=1000, seed=seed
    )
    results, wall = await run_requests(requests, opts, max_concurrency=users)
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    return results, wall


def median_tpot_ttft_ms(results: list[RequestResult]) -> tuple[float, float]:
    """(median TPOT, median TTFT) in ms of a run's requests (TPOT over those with two
    tokens or more)."""
    tpots = [t for r in results if (t := tpot(r)) is not None]
    return statistics.median(tpots) * 1e3, statistics.median(r.ttft for r in results) * 1e3


def read_metrics(base_url: str) -> dict[str, float]:
    """The server's Prometheus samples, name (with labels) -> value."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


# NOTE: the engine's figures (step timing, prefix-cache, draft and slot counters) reach
# /metrics in its periodic report, every 0.25 s (controller/config.py's report_interval_s) and
# a little later when it idles: a reading taken as a run ends may miss its last steps (a short
# round of step_overhead.py read no decode steps at all).
REPORT_SETTLE_S = 0.8


def settled_metrics(base_url: str) -> dict[str, float]:
    """read_metrics once the engine's report has caught up with what just ran."""
    time.sleep(REPORT_SETTLE_S)
    return read_metrics(base_url)


def cpu_seconds(root: int) -> dict[str, float]:
    """User + system CPU seconds of `root` (`tokenmill serve`: "frontend") and each process
    under it, by role (the `tokenmill.<folder>` it runs: "controller", "detokenizer",
    "tp_worker", ...; ranks of one role summed; "other" for the rest), read from Linux's
    /proc; this process's own as "client" (where /proc cannot be read, that alone)."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {"client": sum(os.times()[:2])}
    pending = [root]
    while pending:
        pid = pending.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue  # NOTE: a process that exited between the reads
        # NOTE: fields after the command's closing parenthesis; utime and stime are 14 and 15.
        fields = stat.rpartition(")")[2].split()
        module = next((a.decode() for a in argv if a.startswith(b"tokenmill.")), "")
        role = "frontend" if pid == root else module.split(".")[1] if module else "other"
        totals[role] = totals.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        pending.extend(int(child) for child in children)
    return totals


def layer_multiply_adds(c: ModelConfig) -> tuple[int, int, int]:
    """One token's multiply-adds in one decoder layer: its keys and values' (k/v), its q/k/v
    projection's (q with k/v), and the rest's (o and the MLP's gate/up and down)."""
    kv = c.hidden_size * 2 * c.num_kv_heads * c.head_dim
    q_kv = c.hidden_size * c.num_heads * c.head_dim + kv
    rest = c.hidden_size * (c.num_heads * c.head_dim + 3 * c.intermediate_size)
    return kv, q_kv, rest


def cpu_name() -> str:
    """The CPU's family/model and its vector extensions, as the figures depend on them."""
    from tokenmill.tp_worker.device import cpu_flags

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    pairs = (line.split(":", 1) for line in info.splitlines()[:30] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in pairs}
    name = "{} family {} model {}".format(
        *(fields.get(k, "?") for k in ("vendor_id", "cpu family", "model"))
    )
    wide = sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2")))
    return f"{name} ({' '.join(wide)})"
