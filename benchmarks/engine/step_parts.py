"""Where a decode step's time goes outside the model forward, part by part, in one process.

Runs the real controller over an in-process runner (offline/engine.py: no sockets, no
HTTP) at batch --batch, each part of a step timed by a wrapper this script puts around it
(nothing in the engine changes), and prints the median per decode step of each: the
controller's output processing, scheduling and batch build, and the worker's step inputs,
forward setup (table write and attention plan), model forward (layers and lm_head, the
figure `step_overhead.py` divides by), sampling and logprobs, result and fed-sample record.
These parts run cold in a real step (the lm_head's weights have just gone through the
caches), so their warm timings in isolation understate them; here they run where they run.
What this leaves out, the sockets between processes and the detokenizer and frontend, is
`step_overhead.py`'s "outside the worker".

    python benchmarks/engine/step_parts.py [--preset small|medium | --model DIR] [--dtype bfloat16]
        [--batch 32] [--logprobs 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
import tokenmill.tp_worker.model_runner as runner_module  # noqa: E402
from benchmarks.checkpoints import add_model_args, resolve_model  # noqa: E402
from tokenmill.controller.batch_builder import BatchBuilder  # noqa: E402
from tokenmill.controller.output_processor import OutputProcessor  # noqa: E402
from tokenmill.controller.scheduler import Scheduler  # noqa: E402
from tokenmill.offline.engine import OfflineEngine, OfflineRequest  # noqa: E402
from tokenmill.protocol.arrays import unpack  # noqa: E402
from tokenmill.protocol.step import ForwardBatch  # noqa: E402
from tokenmill.tp_worker.config import RunnerConfig  # noqa: E402
from tokenmill.tp_worker.cpu.host_memory import keep_freed_memory  # noqa: E402
from tokenmill.tp_worker.fed_samples import LastSamples  # noqa: E402
from tokenmill.tp_worker.model_runner import ModelRunner  # noqa: E402
from tokenmill.tp_worker.step_inputs import StepInputsBuilder  # noqa: E402
from tokenmill.tp_worker.step_outputs import StepOutputs  # noqa: E402

# (label, owner, attribute): each part, in the order a step runs them
PARTS = (
    ("controller: output processing", OutputProcessor, "apply"),
    ("controller: scheduling", Scheduler, "schedule"),
    ("controller: batch build", BatchBuilder, "build"),
    ("worker: fed samples", LastSamples, "feed"),
    ("worker: step inputs", StepInputsBuilder, "build"),
    ("worker: forward, all", ModelRunner, "_forward"),
    ("worker: sampling, logprobs", runner_module, "score_sampled"),
    ("worker: result", StepOutputs, "to_result"),
    ("worker: fed-sample record", LastSamples, "record"),
)


class PartTimer:
    """Wall time of every call of each wrapped part, grouped into steps by the runner's
    step calls: a step's parts are kept where its batch decodes only."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, label: str, owner: Any, name: str) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        function = original.__func__ if isinstance(original, staticmethod) else original

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.current[label] += time.perf_counter() - started

        wrapped = staticmethod(timed) if isinstance(original, staticmethod) else timed
        setattr(owner, name, wrapped)

    def wrap_step(self, runner: ModelRunner) -> Callable[[ForwardBatch], Any]:
        step = runner.step

        def timed_step(batch: ForwardBatch) -> Any:
            runner.forward_s = 0.0
            started = time.perf_counter()
            result = step(batch)
            self.current["worker: step, all"] += time.perf_counter() - started
            self.current["worker: model forward"] += runner.forward_s
            decodes = not unpack(batch.is_prefill).any()
            # NOTE: a step's controller parts ran before it (the batch build) and after the
            # step before it (output processing, scheduling): one cycle per step either way.
            if decodes:
                self.steps.append(dict(self.current))
            self.current.clear()
            return result

        return timed_step


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "medium")
    p.add_argument("--dtype", default="auto", help="the runner's dtype (default auto)")
    p.add_argument("--batch", type=int, default=32, help="decode batch (default 32)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--output-len", type=int, default=96, help="output tokens (default 96)")
    p.add_argument("--logprobs", type=int, default=0, help="top logprobs asked (default 0)")
    p.add_argument("--rounds", type=int, default=3, help="measured runs of the batch (3)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    keep_freed_memory()  # NOTE: as the worker process does (no page faults per step)
    timer = PartTimer()
    for label, owner, name in PARTS:
        timer.wrap(label, owner, name)
    runner = ModelRunner(
        RunnerConfig(
            model=str(resolve_model(args)),
            kv_cache_tokens=args.batch * (args.input_len + args.output_len + 16),
            max_running_requests=args.batch,
            max_model_len=args.input_len + args.output_len + 16,
            dtype=args.dtype,
            device="cpu",
        )
    )
    runner.time_forward = True
    engine = OfflineEngine(runner, enable_prefix_cache=False)
    engine.sockets.step = timer.wrap_step(runner)
    gen = torch.Generator().manual_seed(0)
    requests = [
        OfflineRequest(
            torch.randint(3, 1000, (args.input_len,), generator=gen).tolist(),
            max_tokens=args.output_len,
            logprobs=args.logprobs > 0,
            num_top=args.logprobs,
        )
        for _ in range(args.batch)
    ]
    engine.generate(requests)  # warm-up
    timer.steps.clear()
    for _ in range(args.rounds):
        engine.generate(requests)
    report(timer.steps, args)
    return 0


def report(steps: list[dict[str, float]], args: argparse.Namespace) -> None:
    def median_us(label: str) -> float:
        return 1e6 * statistics.median(step.get(label, 0.0) for step in steps)

    print(
        f"{len(steps)} decode steps at batch {args.batch} ({args.dtype}, top {args.logprobs}),"
        " median per step:"
    )
    forward = median_us("worker: model forward")
    for label, _, _ in PARTS:
        if label == "worker: forward, all":
            print(f"  {'worker: forward setup':<32}{median_us(label) - forward:9.0f} us")
            print(f"  {'worker: model forward':<32}{forward:9.0f} us")
            continue
        print(f"  {label:<32}{median_us(label):9.0f} us")
    parts = sum(median_us(label) for label, _, _ in PARTS) - forward
    rest = median_us("worker: step, all") - sum(
        median_us(label) for label, _, _ in PARTS if label.startswith("worker")
    )
    print(f"  {'worker: the rest of its step':<32}{rest:9.0f} us")
    print(
        f"host parts {parts + rest:.0f} us against a {forward:.0f} us forward: "
        f"{(parts + rest) / (parts + rest + forward):.1%} of the sum"
    )


if __name__ == "__main__":
    raise SystemExit(main())
