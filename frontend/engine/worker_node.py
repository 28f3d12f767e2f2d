"""`tokenmill serve --node-rank K` with K > 0 (main process): this node's tensor-parallel ranks
and nothing else: no HTTP listener, no controller. It joins node 0 over the node link and
lives as long as node 0 and its own ranks do (node_link.py says when it ends)."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from types import FrameType

from tokenmill.frontend.engine.cluster_layout import ClusterLayout, node_settings
from tokenmill.frontend.engine.launcher import launch_node_ranks, runner_config
from tokenmill.frontend.engine.node_link import NodeZeroLink, follow_node0
from tokenmill.frontend.server_config import ServerConfig
from tokenmill.frontend.systemd_notify import SystemdNotifier
from tokenmill.protocol.cluster import ClusterKey, NodeHello

logger = logging.getLogger(__name__)


def serve_worker_node(config: ServerConfig, model_dir: Path) -> int:
    layout = ClusterLayout.of(config.parallel)
    key = ClusterKey.load(layout.key_file)
    runner = runner_config(config, model_dir, config.model.max_model_len, layout.local_size)
    signals: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        signals.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    link = NodeZeroLink(layout, key)
    engine = launch_node_ranks(config, runner, layout)
    logger.info(
        "node %d of %d: ranks %d..%d, joining node 0 at %s",
        layout.node_rank,
        layout.nnodes,
        layout.local_ranks.start,
        layout.local_ranks.stop - 1,
        layout.link_addr,
    )
    notifier = SystemdNotifier()
    try:
        link.send(NodeHello(layout.node_rank, node_settings(runner, layout)))
        code, reason = follow_node0(link, engine, lambda: bool(signals), notifier)
        (logger.info if code == 0 else logger.error)("node %d ends: %s", layout.node_rank, reason)
        notifier.notify("STOPPING=1")
        return code
    finally:
        engine.shutdown()
        link.close()
