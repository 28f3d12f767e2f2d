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


def yield_cpu(niceness: int) -> None:
    """Lowers every thread of this process (and so the threads and children it makes later)
    to `niceness`, never raising one: on cores the model's threads fill, a serving process
    then waits for a free core instead of preempting a model thread that its partners in a
    parallel region would wait for. 0 changes nothing."""
    if niceness <= 0:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # NOTE: not Linux: niceness is per process there
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError as e:  # NOTE: a thread that ended meanwhile, or a sandbox
            logging.getLogger(__name__).debug("niceness of thread %d unchanged: %s", tid, e)


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
