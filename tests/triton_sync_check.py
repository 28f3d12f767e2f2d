"""Run by tests/test_step_syncs.py in a subprocess with TRITON_INTERPRET=1 (set before Triton
is imported): the Triton backend's steps ask the device nothing back. Every aten op that
makes a GPU's host wait (an item(), a bool() of a tensor, a nonzero(), a boolean index,
torch.equal) is counted while a step runs (prompt chunks with prompt logprobs, a prefix-cache
hit's table fill, decode steps); a step may have none but those of CPU-only branches
(CPU_ONLY). The result's one copy back is a `.cpu()`, which on the CPU dispatches no op: on
a GPU it is the step's one sync. NOTE: copies between host and device are not seen here
either (on the CPU they are no-ops); those a step makes go from pinned memory without
waiting (upload.py, the attention plan's tiles), and on a GPU gpu_accept.py counts every
sync with torch's sync debug mode."""

from __future__ import annotations

import sys
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_interpreter import rowwise_interpreted_dot

from tokenmill.offline.engine import OfflineEngine, OfflineRequest
from tokenmill.tp_worker.config import RunnerConfig
from tokenmill.tp_worker.cuda import attention as cuda_attention
from tokenmill.tp_worker.model_runner import ModelRunner

WAITS = {
    "aten._local_scalar_dense.default",
    "aten.item.default",
    "aten.is_nonzero.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.equal.default",
    "aten.repeat_interleave.Tensor",
}
# NOTE: branches that run on the CPU only: the rotary's CPU table reads its largest position
# (on CUDA the angles are computed on the device from the positions)
CPU_ONLY = {("rope.py", "cos_sin")}


class HostWaits(TorchDispatchMode):
    """Counts the ops that would make a GPU's host wait, by the code that asked for them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in WAITS or _boolean_index(func, args):
            frame = _caller()
            if (frame.filename.rsplit("/", 1)[-1], frame.name) not in CPU_ONLY:
                self.seen[f"{func} in {frame.filename}:{frame.lineno} {frame.name}"] += 1
        return func(*args, **(kwargs or {}))


def _boolean_index(func, args) -> bool:
    if str(func) != "aten.index.Tensor":
        return False
    return any(i is not None and i.dtype == torch.bool for i in args[1])


def _caller() -> traceback.FrameSummary:
    """The innermost frame of code outside torch (tokenmill's, or this check's own)."""
    frames = [
        f
        for f in traceback.extract_stack()
        if "site-packages" not in f.filename and f.name not in ("__torch_dispatch__", "_caller")
    ]
    return frames[-1]


def main(model_dir: str) -> int:
    rowwise_interpreted_dot()
    with HostWaits() as probe:  # NOTE: the probe itself sees a wait where there is one
        bool((torch.ones(2) > 0).any())
    assert sum(probe.seen.values()) == 1, probe.seen
    config = RunnerConfig(
        model=model_dir, kv_cache_tokens=2048, max_running_requests=4, max_model_len=256,
        dtype="float32", device="cpu", cpu_kernels=False, attention_backend="triton",
    )  # fmt: skip
    planned = cuda_attention.plan_triton

    def from_the_host(*args, **kwargs):
        assert kwargs.get("host") is not None, "a step planned without its rows on the host"
        return planned(*args, **kwargs)

    cuda_attention.plan_triton = from_the_host  # NOTE: the plan's copy back, else unseen here
    engine = OfflineEngine(ModelRunner(config), max_prefill_tokens=16)
    step, steps = engine.sockets.step, []

    def counted(batch):
        with HostWaits() as waits:
            result = step(batch)
        steps.append(("decode" if b"\x01" not in batch.is_prefill.data else "prefill", waits.seen))
        return result

    engine.sockets.step = counted
    engine.generate([
        OfflineRequest(list(range(20, 40)), max_tokens=6, num_top=5, prompt_logprob_start=0),
        OfflineRequest(list(range(50, 60)), max_tokens=6, temperature=0.8, top_k=20,
                       top_p=0.9, min_p=0.05, seed=3),
        OfflineRequest(list(range(70, 75)), max_tokens=6, token_ids=(5, 9)),
    ])  # fmt: skip
    # NOTE: a prefix-cache hit: the step fills the row's table with the cached slots
    engine.generate([OfflineRequest(list(range(20, 40)) + [7, 8], max_tokens=2)])
    kinds = [kind for kind, _ in steps]
    assert kinds.count("decode") >= 4 and kinds.count("prefill") >= 2, kinds
    waited = [(kind, dict(w)) for kind, w in steps if w]
    assert not waited, f"steps that wait on the device: {waited}"
    print(f"{len(steps)} steps ({kinds.count('prefill')} with prompt chunks), none waits on the "
          "device before its result")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
