"""Where each tensor-parallel rank runs and which addresses join the nodes (main process).

Node k runs ranks k*L .. k*L+L-1, L = tensor_parallel_size / nnodes; rank 0 (which returns
step results) and the controller are on node 0. With one node every socket is `ipc://`;
with several, node 0 listens on HOST of --dist-init-addr HOST:PORT, and only there:

    PORT            torch.distributed rendezvous (gloo on CPUs, NCCL on GPUs)
    PORT + 1        the node link: hello, heartbeats, failures (protocol/cluster.py)
    PORT + 2 + r    steps for rank r, for each rank not on node 0
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenmill.frontend.server_config import ParallelArgs
from tokenmill.tp_worker.config import RunnerConfig


@dataclass(frozen=True)
class ClusterLayout:
    nnodes: int
    node_rank: int
    world_size: int
    host: str  # of node 0; "127.0.0.1" with one node
    port: int  # 0 with one node
    key_file: str  # "" with one node
    timeout_s: float

    @staticmethod
    def of(p: ParallelArgs) -> ClusterLayout:
        host, port = "127.0.0.1", 0
        if p.nnodes > 1:
            host, _, port_text = p.dist_init_addr.rpartition(":")
            port = int(port_text)
        key = p.cluster_key_file if p.nnodes > 1 else ""
        return ClusterLayout(
            p.nnodes, p.node_rank, p.tensor_parallel_size, host, port, key, p.dist_timeout
        )

    @property
    def local_size(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        return range(self.node_rank * self.local_size, (self.node_rank + 1) * self.local_size)

    def on_node0(self, rank: int) -> bool:
        return rank < self.local_size

    def torch_addr(self) -> str:
        """The rendezvous: node 0's PORT, or a free loopback port on one node."""
        return f"tcp://{self.host}:{self.port or free_port()}"

    @property
    def link_addr(self) -> str:
        return f"tcp://{self.host}:{self.port + 1}"

    def step_addr(self, rank: int) -> str:
        return f"tcp://{self.host}:{self.port + 2 + rank}"


def free_port() -> int:
    """A TCP port free on loopback now (the rendezvous of ranks on one node)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_settings(runner: RunnerConfig, layout: ClusterLayout) -> dict[str, str]:
    """What every node's ranks must agree on (the flags that shape the KV cache and the
    table, and the checkpoint's config); node 0 refuses a node whose settings differ."""
    settings = {k: str(v) for k, v in asdict(runner).items() if k != "model"}
    config = (Path(runner.model) / "config.json").read_bytes()
    settings["config.json sha256"] = hashlib.sha256(config).hexdigest()
    settings["tensor_parallel_size"] = str(layout.world_size)
    settings["nnodes"] = str(layout.nnodes)
    return settings


def settings_mismatch(node0: dict[str, str], other: dict[str, str], node_rank: int) -> str | None:
    """A line naming each setting on which node `node_rank` differs from node 0, or None."""
    keys = sorted(set(node0) | set(other))
    diffs = [
        f"{k}: {node0.get(k)} on node 0, {other.get(k)} on node {node_rank}"
        for k in keys
        if node0.get(k) != other.get(k)
    ]
    return "; ".join(diffs) or None
