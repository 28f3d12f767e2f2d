"""Starts the engine's processes and watches them (main process).

Each child is a fresh `python -m tokenmill.<folder>` with its config as JSON on the command
line: no pickle, nothing inherited but the environment. Sockets live under a private
runtime directory (mode 0700) that is removed at exit. If any child exits, the supervisor
reports it and the server goes down with a non-zero status.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from tokenmill.controller.config import ControllerConfig
from tokenmill.controller.speculation import SpeculativeConfig
from tokenmill.detokenizer.config import DetokenizerConfig
from tokenmill.frontend.engine.cluster_layout import ClusterLayout
from tokenmill.frontend.server_config import ServerConfig
from tokenmill.protocol import step_channel
from tokenmill.tp_worker.config import RunnerConfig, WorkerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaAddresses:
    """One engine's own sockets (--data-parallel-size D: D of them)."""

    requests: str  # frontend -> controller
    results: str  # rank 0 -> controller (the step channel)
    outputs: str  # controller -> detokenizer (a frame stream, as the step channel)
    workers: tuple[str, ...]  # controller -> each rank (the step channel, or TCP off node 0)


@dataclass(frozen=True)
class Addresses:
    detokenized: str  # every detokenizer -> frontend
    reports: str  # every controller -> frontend
    replicas: tuple[ReplicaAddresses, ...]

    @staticmethod
    def under(runtime_dir: Path, layout: ClusterLayout, num_replicas: int = 1) -> Addresses:
        """`ipc://` under runtime_dir, the frame streams' `unix://` there too (the step
        channel: rank 0 is on node 0; the outputs), but TCP for the steps of ranks on other
        nodes."""

        def ipc(name: str) -> str:
            return f"ipc://{runtime_dir / name}"

        def unix(name: str) -> str:
            return f"{step_channel.SCHEME}{runtime_dir / name}"

        def replica(d: int) -> ReplicaAddresses:
            return ReplicaAddresses(
                ipc(f"requests{d}"),
                unix(f"results{d}"),
                unix(f"outputs{d}"),
                tuple(
                    unix(f"worker{d}.{r}") if layout.on_node0(r) else layout.step_addr(r)
                    for r in range(layout.world_size)
                ),
            )

        replicas = tuple(replica(d) for d in range(num_replicas))
        return Addresses(ipc("detokenized"), ipc("reports"), replicas)


@dataclass
class EngineProcesses:
    runtime_dir: Path
    addresses: Addresses
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, module: str, config: object) -> None:
        argv = [sys.executable, "-m", module, msgspec.json.encode(config).decode()]
        self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=_child_env())

    def exited(self) -> tuple[str, int] | None:
        """The first child that has exited, with its status."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def shutdown(self, timeout: float = 5.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def make_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or None
    path = Path(tempfile.mkdtemp(prefix="tokenmill-", dir=base))
    os.chmod(path, 0o700)
    return path


def launch_engine(
    config: ServerConfig, model_dir: Path, max_model_len: int, layout: ClusterLayout
) -> EngineProcesses:
    """Node 0: per engine replica a detokenizer, a controller and this node's ranks."""
    runtime_dir = make_runtime_dir()
    num_replicas = config.parallel.data_parallel_size
    addrs = Addresses.under(runtime_dir, layout, num_replicas)
    engine = EngineProcesses(runtime_dir, addrs)
    runner = runner_config(config, model_dir, max_model_len, layout.local_size * num_replicas)
    for d, replica in enumerate(addrs.replicas):
        suffix = _replica_suffix(d, num_replicas)
        engine.start(
            "detokenizer" + suffix,
            "tokenmill.detokenizer",
            DetokenizerConfig(
                tokenizer_path=str(model_dir),
                input_addr=replica.outputs,
                output_addr=addrs.detokenized,
                abort_addr=replica.requests,
                parent_pid=os.getpid(),
                niceness=config.http.serving_nice,
            ),
        )
        engine.start(
            "controller" + suffix,
            "tokenmill.controller",
            controller_config(config, addrs, d, layout, model_dir),
        )
        start_ranks(engine, config, runner, layout, d)
    return engine


def controller_config(
    config: ServerConfig,
    addrs: Addresses,
    replica: int,
    layout: ClusterLayout,
    model_dir: Path | str = "",
) -> ControllerConfig:
    s, mine = config.scheduler, addrs.replicas[replica]
    return ControllerConfig(
        request_addr=mine.requests,
        worker_addrs=mine.workers,
        result_addr=mine.results,
        detokenizer_addr=mine.outputs,
        report_addr=addrs.reports,
        max_running_requests=s.max_running_requests,
        max_prefill_tokens=s.max_prefill_tokens,
        model_dir=str(model_dir),
        decode_steps=s.decode_steps,
        speculative_config=s.speculative_config,
        enable_prefix_cache=not s.disable_prefix_cache,
        overlap_schedule=s.overlap_schedule,
        step_timing=s.step_timing,
        parent_pid=os.getpid(),
        cluster_key_file=layout.key_file,
        replica=replica,
        max_queued_requests=s.max_queued_requests,
        queue_timeout_s=s.queue_timeout,
        max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
        lora_modules=config.lora.modules(),
    )


def launch_node_ranks(
    config: ServerConfig, runner: RunnerConfig, layout: ClusterLayout
) -> EngineProcesses:
    """Node k > 0: this node's ranks only; their steps come from node 0's controller."""
    runtime_dir = make_runtime_dir()
    engine = EngineProcesses(runtime_dir, Addresses.under(runtime_dir, layout))
    start_ranks(engine, config, runner, layout, 0)
    return engine


def runner_config(
    config: ServerConfig, model_dir: Path, max_model_len: int, cpu_sharers: int
) -> RunnerConfig:
    s, m = config.scheduler, config.model
    spec = SpeculativeConfig.parse(s.speculative_config)
    return RunnerConfig(
        draft_model=spec.model if spec is not None else "",
        cpu_sharers=cpu_sharers,
        model=str(model_dir),
        kv_cache_tokens=s.kv_cache_tokens,
        gpu_memory_utilization=s.gpu_memory_utilization,
        profile_tokens=s.max_prefill_tokens,
        max_logprobs=s.max_logprobs,
        max_running_requests=s.max_running_requests,
        max_model_len=max_model_len,
        dtype=m.dtype,
        device=m.device,
        # NOTE: each request carries its own mode (the frontend resolves it against
        # --logprobs-mode), so the ranks' own is raw
        logprobs_mode="raw",
        load_format=m.load_format,
        attention_backend=m.attention_backend,
        return_routed_experts=s.enable_return_routed_experts,
        max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
        max_lora_rank=config.lora.max_lora_rank,
        lora_modules=tuple(path for _, path in config.lora.modules()),
    )


def start_ranks(
    engine: EngineProcesses,
    config: ServerConfig,
    runner: RunnerConfig,
    layout: ClusterLayout,
    replica: int,
) -> None:
    """This node's ranks of one replica; the node's cores (or GPUs) are shared out among
    the ranks of every replica it runs."""
    dist_addr = layout.torch_addr()
    addrs = engine.addresses.replicas[replica]
    num_replicas = len(engine.addresses.replicas)
    for rank in layout.local_ranks:
        local_rank = replica * layout.local_size + rank % layout.local_size
        engine.start(
            f"tp_worker{rank}{_replica_suffix(replica, num_replicas)}",
            "tokenmill.tp_worker",
            WorkerConfig(
                runner=runner,
                rank=rank,
                world_size=layout.world_size,
                dist_init_addr=dist_addr,
                batch_addr=addrs.workers[rank],
                result_addr=addrs.results,
                parent_pid=os.getpid(),
                step_timing=config.scheduler.step_timing,
                local_rank=local_rank,
                cluster_key_file=layout.key_file,
                dist_timeout_s=layout.timeout_s,
            ),
        )


def _replica_suffix(replica: int, num_replicas: int) -> str:
    """Process names: "controller" with one replica, "controller.dp1" among several."""
    return "" if num_replicas == 1 else f".dp{replica}"


# NOTE: glibc otherwise keeps freed [chunk, vocab] logit buffers (64 MiB, logprobs.py) in its
# arenas, and a CPU worker's resident memory grows by hundreds of MiB after prompt logprobs;
# blocks from this size up are mmapped and returned on free. Not lower: a 1 MiB threshold
# mmapped (and page-faulted) every activation of every step, a third of a CPU decode step.
MMAP_THRESHOLD = 32 << 20


# NOTE: how long an idle OpenMP thread of a worker spins before it sleeps (libgomp's unit: a
# few hundred iterations a microsecond). libgomp's default, 300,000, kept a CPU worker's
# second thread spinning through all of the host work between two steps, on the core the
# controller, detokenizer and frontend needed then: at one user on SmolLM2 (a 2-core Zen 5),
# their share of a decode step went from 0.77 to 0.44 ms and the median TPOT from 7.42 to
# 6.74 ms with 20,000 (benchmarks/serving/one_user.py --compare=GOMP_SPINCOUNT=20000); the spin
# still spans the gaps between one step's kernels. An environment that sets it (or
# OMP_WAIT_POLICY) keeps its own.
GOMP_SPINCOUNT = 20_000


def _child_env() -> dict[str, str]:
    spin = {} if "OMP_WAIT_POLICY" in os.environ else {"GOMP_SPINCOUNT": str(GOMP_SPINCOUNT)}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), **spin, **os.environ}
