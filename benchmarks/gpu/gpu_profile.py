"""Where a step's time goes on a lent GPU (run by benchmarks/gpu/gpu_check.sh after
gpu_check.py): torch.profiler over a 4,096-token prefill and decode steps at 64 and 1 rows x
2,048 context of an 8B Llama shape (dummy weights, the Triton backend); the top kernels by
device time, and the wall time against the device's busy time (the rest is the host: Python,
launches, syncs).

    python benchmarks/gpu/gpu_profile.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import engine, shaped_model  # noqa: E402

from tokenmill.cli.make_model import build_checkpoint  # noqa: E402
from tokenmill.offline.engine import OfflineRequest  # noqa: E402


def device_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profiled(label: str, run, out: Path) -> None:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    busy = sum(device_us(e) for e in events) / 1e6
    kernels = sorted(events, key=device_us, reverse=True)[:12]
    lines = [f"{label}: wall {1e3 * wall:.1f} ms, device busy {1e3 * busy:.1f} ms"]
    lines += [f"  {device_us(e) / 1e3:9.2f} ms  {e.count:6d} calls  {e.key[:90]}" for e in kernels]
    text = "\n".join(lines)
    print(text, flush=True)
    with open(out / "gpu_profile.txt", "a") as f:
        f.write(text + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args()
    settings = argparse.Namespace(
        rows="64", context=2048, prefill=4096, steps=8, dtype="bfloat16", device="cuda"
    )
    work = Path(tempfile.mkdtemp(prefix="gpu-profile-"))
    model = shaped_model(build_checkpoint(work / "tiny", "llama", "tiny"), "8b", work / "8b")
    e = engine(model, settings, "triton", prefix_cache=True, load_format="dummy")
    gen = torch.Generator().manual_seed(0)

    def prompt(length: int) -> list[int]:
        return torch.randint(10, 30000, (length,), generator=gen).tolist()

    e.generate([OfflineRequest(prompt(64), max_tokens=4)])  # NOTE: warm-up, compiles
    long = prompt(4096)
    profiled("prefill 4096", lambda: e.generate([OfflineRequest(long, max_tokens=1)]), args.out)
    for rows in (64, 1):
        batch = [prompt(2048) for _ in range(rows)]
        e.generate([OfflineRequest(p, max_tokens=1) for p in batch])  # NOTE: cached after

        def decode(batch: list[list[int]] = batch) -> None:
            e.generate([OfflineRequest(p, max_tokens=9) for p in batch])

        profiled(f"{rows} rows x 2048: 8 decode steps (and 1 cached-prompt step)", decode, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
