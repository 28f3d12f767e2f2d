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
from tokenmill.detokenizer.config import DetokenizerConfig
from tokenmill.frontend.cluster_layout import ClusterLayout
from tokenmill.frontend.server_config import ServerConfig
from tokenmill.tp_worker.config import RunnerConfig, WorkerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Addresses:
    requests: str  # frontend -> controller
    results: str  # rank 0 -> controller
    outputs: str  # controller -> detokenizer
    detokenized: str  # detokenizer -> frontend
    reports: str  # controller -> frontend
    workers: tuple[str, ...]  # controller -> each rank

    @staticmethod
    def under(runtime_dir: Path, layout: ClusterLayout) -> Addresses:
        """`ipc://` under runtime_dir, but TCP for the steps of ranks on other nodes."""

        def ipc(name: str) -> str:
            return f"ipc://{runtime_dir / name}"

        return Addresses(
            ipc("requests"),
            ipc("results"),
            ipc("outputs"),
            ipc("detokenized"),
            ipc("reports"),
            tuple(
                ipc(f"worker{r}") if layout.on_node0(r) else layout.step_addr(r)
                for r in range(layout.world_size)
            ),
        )


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
    """Node 0: the detokenizer, the controller and this node's ranks."""
    runtime_dir = make_runtime_dir()
    addrs = Addresses.under(runtime_dir, layout)
    engine = EngineProcesses(runtime_dir, addrs)
    parent = os.getpid()
    s = config.scheduler
    engine.start(
        "detokenizer",
        "tokenmill.detokenizer",
        DetokenizerConfig(
            tokenizer_path=str(model_dir),
            input_addr=addrs.outputs,
            output_addr=addrs.detokenized,
            abort_addr=addrs.requests,
            parent_pid=parent,
        ),
    )
    engine.start(
        "controller",
        "tokenmill.controller",
        ControllerConfig(
            request_addr=addrs.requests,
            worker_addrs=addrs.workers,
            result_addr=addrs.results,
            detokenizer_addr=addrs.outputs,
            report_addr=addrs.reports,
            max_running_requests=s.max_running_requests,
            max_prefill_tokens=s.max_prefill_tokens,
            decode_steps=s.decode_steps,
            enable_prefix_cache=not s.disable_prefix_cache,
            step_timing=s.step_timing,
            parent_pid=parent,
            cluster_key_file=layout.key_file,
        ),
    )
    start_ranks(engine, config, runner_config(config, model_dir, max_model_len), layout)
    return engine


def launch_node_ranks(
    config: ServerConfig, model_dir: Path, max_model_len: int, layout: ClusterLayout
) -> EngineProcesses:
    """Node k > 0: this node's ranks only; their steps come from node 0's controller."""
    runtime_dir = make_runtime_dir()
    engine = EngineProcesses(runtime_dir, Addresses.under(runtime_dir, layout))
    start_ranks(engine, config, runner_config(config, model_dir, max_model_len), layout)
    return engine


def runner_config(config: ServerConfig, model_dir: Path, max_model_len: int) -> RunnerConfig:
    s, m = config.scheduler, config.model
    return RunnerConfig(
        model=str(model_dir),
        kv_cache_tokens=s.kv_cache_tokens,
        max_running_requests=s.max_running_requests,
        max_model_len=max_model_len,
        dtype=m.dtype,
        device=m.device,
        logprobs_mode=s.logprobs_mode,
    )


def start_ranks(
    engine: EngineProcesses, config: ServerConfig, runner: RunnerConfig, layout: ClusterLayout
) -> None:
    dist_addr = layout.torch_addr()
    for rank in layout.local_ranks:
        engine.start(
            f"tp_worker{rank}",
            "tokenmill.tp_worker",
            WorkerConfig(
                runner=runner,
                rank=rank,
                world_size=layout.world_size,
                dist_init_addr=dist_addr,
                batch_addr=engine.addresses.workers[rank],
                result_addr=engine.addresses.results,
                parent_pid=os.getpid(),
                step_timing=config.scheduler.step_timing,
                local_world_size=layout.local_size,
                cluster_key_file=layout.key_file,
                dist_timeout_s=layout.timeout_s,
            ),
        )


# NOTE: glibc otherwise keeps freed [chunk, vocab] logit buffers (64 MiB, logprobs.py) in its
# arenas, and a CPU worker's resident memory grows by hundreds of MiB after prompt logprobs;
# blocks from this size up are mmapped and returned on free. Not lower: a 1 MiB threshold
# mmapped (and page-faulted) every activation of every step, a third of a CPU decode step.
MMAP_THRESHOLD = 32 << 20


def _child_env() -> dict[str, str]:
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), **os.environ}
