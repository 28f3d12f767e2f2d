"""The node link: how node 0 and the other nodes of a multi-node server watch each other
(main processes). Over ZeroMQ TCP, CURVE-secured, msgspec messages (protocol/cluster.py).

Node k > 0 says hello with its settings, then both sides send a beat every second. Node 0
fails (its server exits non-zero) when a node says one of its processes died, when a node's
settings differ from its own, or when a node that said hello is silent for NODE_TIMEOUT_S.
Node k exits when node 0 tells it to (0 after an orderly stop, 1 after a failure), when its
connection to node 0 drops, when node 0 is silent for NODE_TIMEOUT_S, and when a process of
its own dies; a node that cannot reach node 0 within --dist-timeout fails naming the address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from tokenmill.frontend.engine.cluster_layout import ClusterLayout, settings_mismatch
from tokenmill.frontend.engine.launcher import EngineProcesses
from tokenmill.frontend.systemd_notify import SystemdNotifier
from tokenmill.protocol.cluster import ClusterKey, NodeBeat, NodeDown, NodeHello, NodeMessage

logger = logging.getLogger(__name__)

BEAT_S = 1.0
NODE_TIMEOUT_S = 10.0


class RemoteNodes:
    """Node 0's end: a ROUTER on HOST:PORT+1 that knows each node by its connection."""

    def __init__(self, layout: ClusterLayout, key: ClusterKey, settings: dict[str, str]) -> None:
        self.layout = layout
        self.settings = settings
        self.context = zmq.asyncio.Context()
        self.auth = key.start_authenticator(self.context)
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        key.serve_on(self.sock)
        try:
            self.sock.bind(layout.link_addr)
        except zmq.ZMQError as e:
            self.auth.stop()
            where = layout.link_addr
            raise SystemExit(f"--dist-init-addr: cannot listen on {where}: {e}") from None
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(NodeMessage)
        self.peers: dict[int, bytes] = {}  # node rank -> ROUTER identity
        self.last_seen: dict[int, float] = {}
        self.failure: str | None = None  # set once: the server's supervisor stops on it
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._beat())]

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            logger.error("%s: shutting the server down", reason)

    async def _receive(self) -> None:
        while True:
            identity, frame = await self.sock.recv_multipart()
            try:
                message = self.decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("dropped a node-link frame that is not a node message: %s", e)
                continue
            await self._handle(identity, message)

    async def _handle(self, identity: bytes, message: NodeMessage) -> None:
        node = message.node_rank
        if not 0 < node < self.layout.nnodes:
            logger.error("dropped a node-link message from node %d of %d", node, self.layout.nnodes)
            return
        self.last_seen[node] = time.monotonic()
        if isinstance(message, NodeHello):
            self.peers[node] = identity
            mismatch = settings_mismatch(self.settings, message.settings, node)
            if mismatch is not None:
                reason = f"node {node} runs with other settings than node 0 ({mismatch})"
                await self._send(node, NodeDown(0, reason, failed=True))
                self._fail(reason)
            else:
                logger.info("node %d joined", node)
        elif isinstance(message, NodeDown):
            self._fail(f"node {node} went down: {message.reason}")

    async def _send(self, node: int, message: NodeBeat | NodeDown) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await self.sock.send_multipart([self.peers[node], self.encoder.encode(message)])

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            now = time.monotonic()
            for node in list(self.peers):
                if now - self.last_seen[node] > NODE_TIMEOUT_S:
                    self._fail(f"node {node} has been silent for {NODE_TIMEOUT_S:.0f} s")
                await self._send(node, NodeBeat(0))

    async def close(self, reason: str, failed: bool) -> None:
        """Tells every node to stop (failed: with a non-zero exit), then closes the link."""
        for task in self._tasks:
            task.cancel()
        for node in list(self.peers):
            await self._send(node, NodeDown(0, reason, failed))
        await asyncio.sleep(0.1)  # NOTE: LINGER flushes, but only while the socket lives
        self.sock.close()
        self.auth.stop()
        self.context.term()


class NodeZeroLink:
    """Node k's end: a DEALER connected to node 0's link, with its connection events."""

    EVENTS = (
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_DISCONNECTED
    )

    def __init__(self, layout: ClusterLayout, key: ClusterKey) -> None:
        self.layout = layout
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        key.connect_with(self.sock)
        self.monitor = self.sock.get_monitor_socket(self.EVENTS)
        self.sock.connect(layout.link_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(NodeMessage)
        self.connected = False
        self.last_seen = time.monotonic()

    def send(self, message: NodeHello | NodeBeat | NodeDown) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send(self.encoder.encode(message), zmq.NOBLOCK)

    def wait(self, timeout_ms: int) -> tuple[int, str] | None:
        """Handles what arrived within `timeout_ms`; (exit status, why) when node k must end."""
        for sock, _ in self.poller.poll(timeout_ms):
            outcome = self._event() if sock is self.monitor else self._message()
            if outcome is not None:
                return outcome
        return None

    def _event(self) -> tuple[int, str] | None:
        event = recv_monitor_message(self.monitor)["event"]
        where = f"node 0 at {self.layout.link_addr}"
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
            self.last_seen = time.monotonic()
            logger.info("connected to %s", where)
        elif event == zmq.EVENT_DISCONNECTED and self.connected:
            return 1, f"lost the connection to {where}"
        elif event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            return 1, f"{where} refused this node's --cluster-key-file"
        return None

    def _message(self) -> tuple[int, str] | None:
        try:
            message = self.decoder.decode(self.sock.recv())
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.error("dropped a node-link frame that is not a node message: %s", e)
            return None
        self.last_seen = time.monotonic()
        if isinstance(message, NodeDown):
            return int(message.failed), f"node 0 stopped: {message.reason}"
        return None

    def lost(self, started: float) -> tuple[int, str] | None:
        """Node 0 never answered within --dist-timeout, or went silent after it did."""
        where = f"node 0 at {self.layout.link_addr}"
        now = time.monotonic()
        if not self.connected and now - started > self.layout.timeout_s:
            return 1, f"could not reach {where} within {self.layout.timeout_s:.0f} s"
        if self.connected and now - self.last_seen > NODE_TIMEOUT_S:
            return 1, f"{where} has been silent for {NODE_TIMEOUT_S:.0f} s"
        return None

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close()
        self.context.term()


def follow_node0(
    link: NodeZeroLink,
    engine: EngineProcesses,
    stopping: Callable[[], bool],
    notifier: SystemdNotifier,
) -> tuple[int, str]:
    """Node k's life after its hello: (exit status, why) once it must end. Tells systemd
    READY=1 once node 0 answers and pings the watchdog with each beat while connected."""
    started = next_beat = time.monotonic()
    ready = False
    while True:
        outcome = link.wait(int(BEAT_S * 250)) or _own_end(engine, stopping) or link.lost(started)
        if outcome is not None:
            if outcome[0] != 0 or stopping():
                link.send(NodeDown(link.layout.node_rank, outcome[1], failed=True))
            return outcome
        if link.connected and not ready:
            ready = True
            notifier.notify(f"READY=1\nSTATUS=node {link.layout.node_rank} joined node 0")
        if time.monotonic() >= next_beat:
            link.send(NodeBeat(link.layout.node_rank))
            if link.connected:
                notifier.notify("WATCHDOG=1")
            next_beat += BEAT_S


def _own_end(engine: EngineProcesses, stopping: Callable[[], bool]) -> tuple[int, str] | None:
    exited = engine.exited()
    if exited is not None:
        return 1, f"process {exited[0]} exited with status {exited[1]}"
    if stopping():
        return 0, "stopped by a signal"
    return None
