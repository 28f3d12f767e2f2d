"""Round trips between two processes: a ZeroMQ PUSH/PULL pair over ipc:// (what the step
channel was) against the step channel's Unix-domain frame stream (protocol/step_channel.py),
in turn, with a pause between trips as a step's forward leaves (--pause-ms). With --spinner a
third process keeps one core busy, as a worker's idle OpenMP thread does between steps.

    python benchmarks/step_channel.py [--trips 2000] [--bytes 800] [--rounds 2] [--spinner]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from tokenmill.protocol.step_channel import FrameListener, FrameStream


def zmq_echo(into: str, back: str, trips: int) -> None:
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.connect(into)
    push.connect(back)
    for _ in range(trips):
        push.send(pull.recv())
    context.destroy(linger=1000)


def stream_echo(into: str, back: str, trips: int) -> None:
    batches, results = FrameStream.connect(into), FrameStream.connect(back)
    for _ in range(trips):
        results.send(bytes(batches.recv()))


def zmq_trips(folder: Path, args: argparse.Namespace) -> list[float]:
    into, back = f"ipc://{folder}/zin", f"ipc://{folder}/zback"
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    push.bind(into)
    pull.bind(back)
    echo = mp.Process(target=zmq_echo, args=(into, back, args.trips))
    echo.start()
    times = timed(lambda frame: (push.send(frame), pull.recv()), args)
    echo.join()
    context.destroy(linger=0)
    return times


def stream_trips(folder: Path, args: argparse.Namespace) -> list[float]:
    into, back = f"unix://{folder}/sin", f"unix://{folder}/sback"
    batches, results = FrameListener(into), FrameListener(back)
    echo = mp.Process(target=stream_echo, args=(into, back, args.trips))
    echo.start()
    times = timed(lambda frame: (batches.send(frame), results.recv()), args)
    echo.join()
    batches.close()
    results.close()
    return times


def timed(trip: Callable[[bytes], object], args: argparse.Namespace) -> list[float]:
    frame = bytes(args.bytes)
    times = []
    for _ in range(args.trips):
        started = time.perf_counter()
        trip(frame)
        times.append(time.perf_counter() - started)
        time.sleep(args.pause_ms / 1000)
    return times


def spin(stop: mp.synchronize.Event) -> None:
    while not stop.is_set():
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trips", type=int, default=2000, help="round trips per measurement (2000)")
    p.add_argument("--bytes", type=int, default=800, help="frame size (800, a batch of 32)")
    p.add_argument("--pause-ms", type=float, default=0.5, help="pause between trips (0.5)")
    p.add_argument("--rounds", type=int, default=2, help="measurements of each, in turn (2)")
    p.add_argument("--spinner", action="store_true", help="a third process keeps a core busy")
    args = p.parse_args()
    mp.set_start_method("fork")
    stop = mp.Event()
    spinner = mp.Process(target=spin, args=(stop,)) if args.spinner else None
    if spinner:
        spinner.start()
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for name, trips in (("zeromq ipc://", zmq_trips), ("step channel", stream_trips)):
                us = sorted(t * 1e6 for t in trips(Path(folder), args))
                print(
                    f"{name:<14} round trip of {args.bytes} bytes: median {us[len(us) // 2]:6.1f}"
                    f" us, mean {statistics.mean(us):6.1f}, p90 {us[int(len(us) * 0.9)]:6.1f}"
                )
    stop.set()
    if spinner:
        spinner.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
