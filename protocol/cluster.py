"""What crosses between nodes: the node link's messages, and the CURVE keys that every
socket reaching another node is secured with (used by the frontend, controller and tp_worker).

One key file holds two key pairs: the server pair of node 0's bound sockets and the client
pair every other node connects with. A peer without the file cannot finish the CURVE
handshake: a bound socket's ZAP handler accepts only the client public key, so a stranger's
connection never joins the socket (a PUSH never sends it a step) and its frames never arrive.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
import zmq.auth.asyncio
import zmq.auth.thread

# NOTE: ZeroMQ's ZAP domain for our sockets; any other domain is refused by the handler.
ZAP_DOMAIN = "tokenmill"
_KEY_NAMES = ("server-public", "server-secret", "client-public", "client-secret")


class NodeHello(msgspec.Struct, frozen=True, tag="node_hello"):
    """First message of node K (> 0) to node 0: who it is and the flags its ranks run with."""

    node_rank: int
    settings: dict[str, str]  # what every node must agree on, see cluster_layout.py


class NodeBeat(msgspec.Struct, frozen=True, tag="node_beat"):
    """Sent every second both ways while a node's processes run."""

    node_rank: int


class NodeDown(msgspec.Struct, frozen=True, tag="node_down"):
    """A node is going away: one of its processes died, its flags disagree, or node 0 stops."""

    node_rank: int
    reason: str
    failed: bool  # False: an orderly stop (node 0 drained and exits 0)


NodeMessage = NodeHello | NodeBeat | NodeDown
Authenticator = zmq.auth.thread.ThreadAuthenticator | zmq.auth.asyncio.AsyncioAuthenticator


@dataclass(frozen=True)
class ClusterKey:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @staticmethod
    def generate() -> ClusterKey:
        return ClusterKey(*zmq.curve_keypair(), *zmq.curve_keypair())

    @staticmethod
    def load(path: str | Path) -> ClusterKey:
        """The key file `write` made; ValueError naming the file if it is not one."""
        values: dict[str, bytes] = {}
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"cluster key file {path}: {e.strerror}") from None
        for line in text.splitlines():
            name, sep, value = line.partition("=")
            if sep and not line.lstrip().startswith("#"):
                values[name.strip()] = value.strip().encode()
        missing = [n for n in _KEY_NAMES if len(values.get(n, b"")) != 40]
        if missing:
            raise ValueError(
                f"cluster key file {path}: no valid {', '.join(missing)} "
                "(make one with `tokenmill cluster-key FILE`)"
            )
        return ClusterKey(*(values[n] for n in _KEY_NAMES))

    def write(self, path: str | Path) -> None:
        """Writes the file readable by its owner only (it is the cluster's password)."""
        lines = ["# tokenmill cluster key: copy to every node, keep it secret (mode 0600)"]
        keys = (self.server_public, self.server_secret, self.client_public, self.client_secret)
        lines += [f"{n} = {k.decode()}" for n, k in zip(_KEY_NAMES, keys, strict=True)]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")

    def serve_on(self, sock: zmq.Socket) -> None:
        """Makes `sock` (before bind) accept only peers holding the client key."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    def connect_with(self, sock: zmq.Socket) -> None:
        """Makes `sock` (before connect) a client that proves it holds the key."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)

    def start_authenticator(self, context: zmq.Context) -> Authenticator:
        """The ZAP handler of `context`'s CURVE servers: the client public key, nothing else
        (stop it before destroying the context)."""
        auth: Authenticator
        if isinstance(context, zmq.asyncio.Context):
            auth = zmq.auth.asyncio.AsyncioAuthenticator(context)
        else:
            auth = zmq.auth.thread.ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, _OneKey(self.client_public))
        return auth


class _OneKey:
    """ZAP credentials provider: accepts exactly one client public key (Z85, as pyzmq passes
    it)."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and hmac.compare_digest(key, self.public)
