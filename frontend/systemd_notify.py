"""systemd integration of the main process: READY=1 once the server answers, WATCHDOG=1 while
the engine keeps reporting, STOPPING=1 when it drains (Type=notify units, see deploy/).

Without NOTIFY_SOCKET in the environment (not started by systemd) every call is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

logger = logging.getLogger(__name__)


class SystemdNotifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        # NOTE: "@name" is a socket in the abstract namespace.
        self.address = "\0" + address[1:] if address.startswith("@") else address
        usec = int(env.get("WATCHDOG_USEC", "0") or 0)
        pid = env.get("WATCHDOG_PID")
        mine = pid is None or pid == str(os.getpid())
        # systemd's advice: ping at half the timeout.
        self.watchdog_interval_s = usec / 2e6 if usec and mine else None

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, state: str) -> None:
        if not self.address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(state.encode(), self.address)
        except OSError as e:
            logger.warning("sd_notify(%s) failed: %s", state.split("\n")[0], e)

    async def watchdog(self, healthy: Callable[[], bool]) -> None:
        """Pings while `healthy()` holds; a stuck engine stops the pings and systemd restarts
        the service."""
        if self.watchdog_interval_s is None:
            return
        while True:
            if healthy():
                self.notify("WATCHDOG=1")
            else:
                logger.warning("engine not healthy: no watchdog ping")
            await asyncio.sleep(self.watchdog_interval_s)
