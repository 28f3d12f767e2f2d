"""What every tokenmill process does first: name itself, log one line per event, and die
with its parent (so that no orphan outlives the server)."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


def setup_process(title: str, level: str | None = None) -> None:
    # NOTE: children are fresh interpreters; naming the process names their log lines.
    multiprocessing.current_process().name = title.split("::")[-1]
    setup_logging(level or os.environ.get("TOKENMILL_LOG_LEVEL", "info"))
    try:
        import setproctitle  # optional

        setproctitle.setproctitle(title)
    except ImportError:
        pass
    # NOTE: Ctrl-C reaches the whole process group; children leave shutdown to the parent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def yield_cpu(niceness: int) -> bool:
    """Sets every thread of this process (and so the threads and children it makes later) to
    `niceness`. False where the system refuses (lowering it needs CAP_SYS_NICE or a high
    enough RLIMIT_NICE, as root or systemd's LimitNICE= give)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # NOTE: not Linux: niceness is per process there
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except PermissionError:
            return False
        except OSError as e:  # NOTE: a thread that ended meanwhile
            logging.getLogger(__name__).debug("niceness of thread %d unchanged: %s", tid, e)
    return True


class ServingPriority:
    """A serving process's (frontend, detokenizer) niceness by load: `niceness` while at
    least BUSY requests are in flight, the default 0 again at IDLE or fewer.

    NOTE: on cores that the model's threads fill, a serving process at niceness 0 preempts a
    model thread that its partners in a parallel region then wait for: under load it should
    wait for a free core instead. With one or two requests it should not: each token then
    waits on the serving processes, and at niceness 10 they get a tenth of a busy core
    (measured: time to first token 79 ms at 10, 57 ms at 0, one request at a time). Where the
    system does not let a process lower its niceness again, it stays at `niceness` once busy.
    """

    BUSY = 4
    IDLE = 2

    def __init__(self, niceness: int) -> None:
        self.niceness = niceness
        self.current = 0
        self._can_return = True

    def update(self, num_in_flight: int) -> None:
        if self.niceness <= 0:
            return
        if self.current == 0 and num_in_flight >= self.BUSY:
            if yield_cpu(self.niceness):
                self.current = self.niceness
        elif self.current > 0 and num_in_flight <= self.IDLE and self._can_return:
            if yield_cpu(0):
                self.current = 0
            else:
                self._can_return = False
                logging.getLogger(__name__).info(
                    "this process may not lower its niceness: it stays at %d", self.current
                )


def exit_with_parent(parent_pid: int | None) -> None:
    """Exits this process when its parent does (PR_SET_PDEATHSIG, plus a polling thread where
    that is not available)."""
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
