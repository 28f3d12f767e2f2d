"""The main process at run time: launch the engine, wait until it is ready, serve HTTP,
and supervise: a child that dies takes the server down with a non-zero exit; SIGTERM drains
in-flight requests first, then exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import replace
from pathlib import Path

from aiohttp import web

from tokenmill.frontend.app.routes import build_app
from tokenmill.frontend.engine.cluster_layout import ClusterLayout, node_settings
from tokenmill.frontend.engine.launcher import EngineProcesses, launch_engine, runner_config
from tokenmill.frontend.engine.node_link import RemoteNodes
from tokenmill.frontend.engine.zmq_client import ZmqEngineClient
from tokenmill.frontend.server_config import ServerConfig
from tokenmill.frontend.systemd_notify import SystemdNotifier
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.protocol.cluster import ClusterKey
from tokenmill.protocol.process import ServingPriority

logger = logging.getLogger(__name__)


async def serve(config: ServerConfig, model_dir: Path) -> int:
    layout = ClusterLayout.of(config.parallel)
    nodes = _remote_nodes(config, model_dir, layout)
    engine = launch_engine(config, model_dir, config.model.max_model_len, layout)
    client = ZmqEngineClient(
        [r.requests for r in engine.addresses.replicas],
        engine.addresses.detokenized,
        engine.addresses.reports,
        ServingPriority(config.http.serving_nice),
    )
    stop = asyncio.Event()
    state = {"exit_code": 0, "drain": False}
    _install_signals(stop, state, client)
    client.start()
    if nodes is not None:
        nodes.start()
    notifier = SystemdNotifier()
    watcher = asyncio.create_task(_supervise(engine, nodes, client, stop, state))
    tasks = [watcher]
    runner = None
    try:
        if await _wait_ready(client, stop):
            config = replace(
                config, model=replace(config.model, max_model_len=client.max_model_len)
            )
            runner = await _start_http(config, client, Tokenizer(model_dir))
            notifier.notify(f"READY=1\nSTATUS=serving {config.served_model_name}")
            tasks.append(asyncio.create_task(notifier.watchdog(client.stats.healthy)))
            await stop.wait()
            notifier.notify("STOPPING=1")
            if state["drain"]:
                await _drain(client, config.http.drain_timeout)
    finally:
        for task in tasks:
            task.cancel()
        if runner is not None:
            await runner.cleanup()
        client.close()
        if nodes is not None:
            failed = state["exit_code"] != 0
            await nodes.close("its server failed" if failed else "its server stopped", failed)
        engine.shutdown()
    return int(state["exit_code"])


def _remote_nodes(
    config: ServerConfig, model_dir: Path, layout: ClusterLayout
) -> RemoteNodes | None:
    """Node 0's end of the node link, with the settings every node must share."""
    if layout.nnodes == 1:
        return None
    runner = runner_config(config, model_dir, config.model.max_model_len, layout.local_size)
    return RemoteNodes(layout, ClusterKey.load(layout.key_file), node_settings(runner, layout))


async def _start_http(
    config: ServerConfig, client: ZmqEngineClient, tokenizer: Tokenizer
) -> web.AppRunner:
    app = build_app(config, client, tokenizer)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.http.host, config.http.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    logger.info(
        "tokenmill ready: http://%s:%d/v1 serving %r (max model len %d)",
        config.http.host,
        port,
        config.served_model_name,
        config.model.max_model_len,
    )
    return runner


async def _wait_ready(client: ZmqEngineClient, stop: asyncio.Event) -> bool:
    ready = asyncio.create_task(client.ready.wait())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for task in (ready, stopped):
        task.cancel()
    return client.ready.is_set() and not stop.is_set()


async def _supervise(
    engine: EngineProcesses,
    nodes: RemoteNodes | None,
    client: ZmqEngineClient,
    stop: asyncio.Event,
    state: dict,
) -> None:
    while True:
        exited = engine.exited()
        if exited is not None:
            name, code = exited
            logger.error("process %s exited with status %s: shutting the server down", name, code)
        if exited is not None or (nodes is not None and nodes.failure is not None):
            client.mark_dead()
            state["exit_code"] = 1
            stop.set()
            return
        await asyncio.sleep(0.2)


async def _drain(client: ZmqEngineClient, timeout_s: float) -> None:
    """Lets requests in flight finish (new ones get 503 since the signal) for up to
    `timeout_s`; then fails the rest, whose clients get an error (event), and returns."""
    deadline = time.monotonic() + timeout_s
    while client.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if client.num_in_flight:
        logger.warning(
            "drain timeout (%g s): failing %d requests in flight", timeout_s, client.num_in_flight
        )
        client.mark_dead(f"the server is shutting down (--drain-timeout {timeout_s:g} s)")
        await asyncio.sleep(ERROR_FLUSH_S)
    logger.info("drained")


# NOTE: long enough for the handlers to write the error events of requests a drain failed.
ERROR_FLUSH_S = 0.5


def _install_signals(stop: asyncio.Event, state: dict, client: ZmqEngineClient) -> None:
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        logger.info("received %s: draining and shutting down", signal.Signals(signum).name)
        client.draining = True  # NOTE: at once: /health 503 and new requests 503 from now
        state["drain"] = True
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
