"""Two nodes simulated on one machine: two `tokenmill serve` processes with --nnodes 2 on
loopback, tensor parallelism 2 across them (gloo), the step and link sockets CURVE-secured.
They must answer as one node does, refuse strangers, and fail together, leaving no orphans."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq
from helpers import assert_same_tp_answer
from server_process import ServerProcess, start_server
from test_server_faults import assert_gone, children_of, streaming_request

from tokenmill.frontend.server_config import ParallelArgs, validate_parallel
from tokenmill.protocol.cluster import ClusterKey, NodeHello

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

ENV = {"OMP_NUM_THREADS": "1"}  # NOTE: two nodes share this machine's cores
BODY = {
    "input_ids": list(range(90, 140)),
    "return_logprob": True,
    "logprob_start_len": 10,
    "top_logprobs_num": 5,
    "sampling_params": {"max_new_tokens": 12, "temperature": 0},
}


def free_port_run(n: int) -> int:
    """A port p with p..p+n-1 free on loopback (now)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and all(_free(base + i) for i in range(n)):
            return base


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Cluster:
    node0: ServerProcess
    node1: subprocess.Popen
    node1_log: Path
    port: int
    key_file: Path

    def stop(self) -> tuple[int, int]:
        code0 = self.node0.stop()
        return code0, self.node1.wait(timeout=30)

    def kill(self) -> None:
        for proc in (self.node0.proc, self.node1):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def cluster_args(model: Path, port: int, key: Path, *extra: str) -> list[str]:
    return [
        "--tensor-parallel-size", "2", "--nnodes", "2",
        "--dist-init-addr", f"127.0.0.1:{port}", "--cluster-key-file", str(key),
        "--kv-cache-tokens", "8192", "--max-model-len", "1024", "--dtype", "float32",
        "--dist-timeout", "60", *extra,
    ]  # fmt: skip


def start_node(model: Path, args: list[str], rank: int, log: Path) -> subprocess.Popen:
    """A node without waiting for it (node 1 has no HTTP listener to wait on)."""
    argv = [sys.executable, "-m", "tokenmill.cli.main", "serve", "--model", str(model)]
    return subprocess.Popen(
        [*argv, *args, "--node-rank", str(rank), "--port", "0"],
        stdout=open(log, "wb"),  # noqa: SIM115 (the node writes it until it ends)
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **ENV},
    )


def start_cluster(model: Path, tmp: Path) -> Cluster:
    port = free_port_run(4)
    key = tmp / "cluster.key"
    ClusterKey.generate().write(key)
    args = cluster_args(model, port, key)
    node1 = start_node(model, args, 1, tmp / "node1.log")
    try:
        node0 = start_server(model, tmp / "node0.log", *args, "--node-rank", "0", env=ENV)
    except BaseException:
        os.killpg(node1.pid, signal.SIGKILL)
        raise
    return Cluster(node0, node1, tmp / "node1.log", port, key)


def test_two_nodes_answer_as_one_refuse_strangers_and_stop_together(
    server, tiny_checkpoint, tmp_path: Path
) -> None:
    model = tiny_checkpoint("llama")
    cluster = start_cluster(model, tmp_path)
    try:
        _, one = server.post("/generate", BODY)
        status, two = cluster.node0.post("/generate", BODY)
        assert status == 200, two
        assert_same_tp_answer(two, one)
        # node 0 runs rank 0, the controller, the detokenizer; node 1 only rank 1
        assert len(children_of(cluster.node0.proc.pid)) == 3
        (rank1,) = children_of(cluster.node1.pid).values()
        assert "tokenmill.tp_worker" in rank1

        strangers = Strangers(cluster.port)
        status, again = cluster.node0.post("/generate", BODY)
        assert status == 200, again
        assert_same_tp_answer(again, one)
        assert strangers.received_nothing()
        assert cluster.node0.get("/health")[0] == 200
        assert cluster.node1.poll() is None
        strangers.close()
        assert cluster.stop() == (0, 0), cluster.node1_log.read_text()[-2000:]
        assert "node 0 stopped: its server stopped" in cluster.node1_log.read_text()
    finally:
        cluster.kill()


class Strangers:
    """Peers without the cluster key: a step reader with no key, one with a key pair of its
    own, and a node-link client that claims to be node 1."""

    def __init__(self, port: int) -> None:
        self.context = zmq.Context()
        self.readers = [self.context.socket(zmq.PULL) for _ in range(2)]
        public, secret = zmq.curve_keypair()
        self.readers[1].setsockopt(zmq.CURVE_SERVERKEY, ClusterKey.generate().server_public)
        self.readers[1].setsockopt(zmq.CURVE_PUBLICKEY, public)
        self.readers[1].setsockopt(zmq.CURVE_SECRETKEY, secret)
        for reader in self.readers:
            reader.connect(f"tcp://127.0.0.1:{port + 3}")  # rank 1's steps
        self.link = self.context.socket(zmq.DEALER)
        self.link.connect(f"tcp://127.0.0.1:{port + 1}")
        self.link.send(msgspec.msgpack.encode(NodeHello(1, {"forged": "yes"})))
        self.link.send(b"not a node message")
        time.sleep(0.5)

    def received_nothing(self) -> bool:
        return not any(r.poll(200) for r in [*self.readers, self.link])

    def close(self) -> None:
        self.context.destroy(linger=0)


def test_a_dead_remote_rank_fails_requests_and_stops_both_nodes(
    tiny_checkpoint, tmp_path: Path
) -> None:
    cluster = start_cluster(tiny_checkpoint("llama"), tmp_path)
    try:
        errors: list[BaseException] = []
        thread = streaming_request(cluster.node0, errors, 900)
        (rank1,) = children_of(cluster.node1.pid)
        node0_children = children_of(cluster.node0.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert cluster.node0.proc.wait(timeout=30) != 0
        assert cluster.node1.wait(timeout=30) != 0
        thread.join(timeout=30)
        assert errors, "the request in flight must fail, not hang"
        assert_gone([rank1, *node0_children])
        # NOTE: whichever notices first ends node 0: rank 0's failed collective (rank 0 or the
        # controller exits), or node 1 saying why over the link
        assert "shutting the server down" in cluster.node0.log()
    finally:
        cluster.kill()


def test_node1_ends_when_node0_is_killed(tiny_checkpoint, tmp_path: Path) -> None:
    cluster = start_cluster(tiny_checkpoint("llama"), tmp_path)
    try:
        (rank1,) = children_of(cluster.node1.pid)
        os.kill(cluster.node0.proc.pid, signal.SIGKILL)  # no goodbye: the link just drops
        assert cluster.node1.wait(timeout=30) == 1
        assert_gone([rank1])
        assert "lost the connection to node 0" in cluster.node1_log.read_text()
    finally:
        cluster.kill()


def alone(model: Path, rank: int, tmp_path: Path) -> tuple[int, str]:
    """Node `rank` started with no other node and --dist-timeout 3: it must exit 1; its
    port and log."""
    port = free_port_run(4)
    key = tmp_path / "key"
    ClusterKey.generate().write(key)
    args = cluster_args(model, port, key)
    args[args.index("--dist-timeout") + 1] = "3"
    log = tmp_path / f"node{rank}.log"
    node = start_node(model, args, rank, log)
    try:
        assert node.wait(timeout=60) == 1
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    return port, log.read_text()


def test_a_node_that_cannot_reach_node0_fails_naming_the_address(
    tiny_checkpoint, tmp_path: Path
) -> None:
    port, log = alone(tiny_checkpoint("llama"), 1, tmp_path)
    assert f"could not reach node 0 at tcp://127.0.0.1:{port + 1} within 3 s" in log, log[-2000:]


def test_node0_refuses_a_node_with_other_settings(tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama")
    port = free_port_run(4)
    key = tmp_path / "key"
    ClusterKey.generate().write(key)
    args = cluster_args(model, port, key)
    node1 = start_node(model, [*args, "--max-running-requests", "8"], 1, tmp_path / "node1.log")
    node0 = start_node(model, args, 0, tmp_path / "node0.log")
    try:
        assert node0.wait(timeout=60) == 1
        assert node1.wait(timeout=30) == 1
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    expected = "max_running_requests: 64 on node 0, 8 on node 1"
    assert expected in (tmp_path / "node0.log").read_text()
    assert expected in (tmp_path / "node1.log").read_text()


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"nnodes": 0}, "--nnodes"),
        ({"nnodes": 2, "node_rank": 2}, "--node-rank"),
        ({"nnodes": 2, "tensor_parallel_size": 3}, "--tensor-parallel-size"),
        ({"nnodes": 2, "tensor_parallel_size": 2}, "--dist-init-addr"),
        ({"nnodes": 2, "tensor_parallel_size": 2, "dist_init_addr": "host"}, "--dist-init-addr"),
        (
            {"nnodes": 2, "tensor_parallel_size": 2, "dist_init_addr": "h:70000"},
            "--dist-init-addr",
        ),
        ({"nnodes": 2, "tensor_parallel_size": 2, "dist_init_addr": "h:1"}, "--cluster-key-file"),
        ({"dist_timeout": 0.0}, "--dist-timeout"),
    ],
)
def test_bad_parallel_flags_name_the_flag(changes: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        validate_parallel(ParallelArgs(**changes))


def test_the_cluster_key_file(tmp_path: Path) -> None:
    path = tmp_path / "key"
    subprocess.run(["tokenmill", "cluster-key", str(path)], check=True, capture_output=True)
    assert path.stat().st_mode & 0o777 == 0o600
    ClusterKey.load(path)
    again = subprocess.run(["tokenmill", "cluster-key", str(path)], capture_output=True, text=True)
    assert again.returncode != 0 and "never overwrites" in again.stderr
    path.write_text("server-public = short\n")
    with pytest.raises(ValueError, match="no valid server-public"):
        ClusterKey.load(path)
    with pytest.raises(ValueError, match="No such file"):
        ClusterKey.load(tmp_path / "missing")


def test_node0_alone_fails_naming_the_rendezvous(tiny_checkpoint, tmp_path: Path) -> None:
    port, log = alone(tiny_checkpoint("llama"), 0, tmp_path)
    expected = f"rank 0 could not join the other 1 ranks at tcp://127.0.0.1:{port} within 3 s"
    assert expected in log, log[-2000:]
