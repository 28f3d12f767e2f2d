"""Peak extra memory of prompt logprobs over an 8,192-token prompt with a 128k vocabulary.

DESIGN.md promises that prompt logprobs are scored in bounded-memory chunks, never as one
[prompt_len, vocab] float32 tensor (4008 MiB here). Each variant runs in a fresh process with
the in-process OfflineEngine; peak memory is measured from "model loaded" to "request done".

    python benchmarks/engine/prompt_logprobs_memory.py [--model DIR] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MIB = 1 << 20
TARGET_MIB = 256
VOCAB_SIZE = 128256
DEFAULT_CACHE = Path.home() / ".cache" / "tokenmill" / "bench-llama-small-128k"
# name -> (max_tokens, prompt_logprob_start, num_top)
VARIANTS = {
    "no prompt logprobs": (1, -1, 0),
    "prompt logprobs, top 0": (1, 0, 0),
    "prompt logprobs, top 5": (1, 0, 5),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="HF checkpoint dir; default: build one")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--max-prefill-tokens", type=int, default=2048)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    return parser.parse_args()


def resolve_model(model: Path | None) -> Path:
    if model is not None:
        return model
    if (DEFAULT_CACHE / "config.json").exists():
        return DEFAULT_CACHE
    from tokenmill.cli.make_model import build_checkpoint

    print(f"building llama/small with vocab {VOCAB_SIZE} into {DEFAULT_CACHE} ...", flush=True)
    return build_checkpoint(DEFAULT_CACHE, "llama", "small", vocab_size=VOCAB_SIZE)


# ---------------------------------------------------------------- child process


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakMemory:
    """Peak bytes above the level at start(): VmHWM on CPU, max_memory_allocated on CUDA."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch

    def start(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated()
            return
        import resource

        self.base = _proc_status_kib("VmRSS") * 1024
        self.hwm_reset = _reset_peak_rss()
        # Without a reset, ru_maxrss still holds the loading peak; report it as a bound.
        self.maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def peak_extra(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated() - self.base
        if self.hwm_reset:
            return _proc_status_kib("VmHWM") * 1024 - self.base
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(peak, self.maxrss_before) - self.base


def run_child(args: argparse.Namespace) -> dict[str, object]:
    import numpy as np

    from tokenmill.offline.engine import OfflineEngine, OfflineRequest
    from tokenmill.tp_worker.config import RunnerConfig
    from tokenmill.tp_worker.model_runner import ModelRunner

    max_tokens, start, num_top = VARIANTS[args.child]
    slots = args.prompt_len + 64
    config = RunnerConfig(
        model=str(args.model),
        kv_cache_tokens=slots,
        max_running_requests=1,
        max_model_len=slots,
        dtype="float32",
        device=args.device,
    )
    engine = OfflineEngine(ModelRunner(config), max_prefill_tokens=args.max_prefill_tokens)
    vocab = engine.runner.model_config.vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt_len).tolist()
    request = OfflineRequest(
        prompt, max_tokens=max_tokens, prompt_logprob_start=start, num_top=num_top
    )
    memory = PeakMemory(args.device)
    memory.start()
    began = time.perf_counter()
    [output] = engine.generate([request])
    seconds = time.perf_counter() - began
    extra = memory.peak_extra()
    lps = np.asarray(output.prompt_logprobs, dtype=np.float32)
    return {
        "variant": args.child,
        "vocab": vocab,
        "peak_extra_mib": extra / MIB,
        "seconds": seconds,
        "num_prompt_logprobs": len(lps),
        "all_finite": bool(np.isfinite(lps).all()),
        "num_top_rows": len(output.prompt_top_ids),
        "top_width": int(output.prompt_top_ids[0].shape[0]) if output.prompt_top_ids else 0,
        "peak_source": "cuda" if memory.cuda else ("VmHWM" if memory.hwm_reset else "ru_maxrss"),
    }


# ---------------------------------------------------------------- parent process


def run_variant(args: argparse.Namespace, model: Path, variant: str) -> dict[str, object]:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        "--model",
        str(model),
        "--prompt-len",
        str(args.prompt_len),
        "--max-prefill-tokens",
        str(args.max_prefill_tokens),
        "--device",
        args.device,
    ]
    # NOTE: glibc raises its mmap threshold as big blocks are freed and then keeps freed memory
    # in its arenas, so RSS peaks vary by hundreds of MiB from run to run. A fixed threshold
    # returns every block >= 1 MiB to the OS on free: RSS then tracks live tensors.
    env = {"MALLOC_MMAP_THRESHOLD_": str(MIB), **os.environ}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        sys.exit(f"variant {variant!r} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(result: dict[str, object], prompt_len: int) -> list[str]:
    """Problems with a variant's returned prompt logprobs (none expected)."""
    _, start, num_top = VARIANTS[str(result["variant"])]
    want = prompt_len - 1 if start >= 0 else 0
    problems = []
    if result["num_prompt_logprobs"] != want:
        problems.append(f"{result['num_prompt_logprobs']} prompt logprobs, expected {want}")
    if not result["all_finite"]:
        problems.append("non-finite prompt logprobs")
    if start >= 0 and (result["num_top_rows"], result["top_width"]) != (want, num_top):
        problems.append(f"top ids {result['num_top_rows']} x {result['top_width']}")
    return problems


def report(results: list[dict[str, object]], args: argparse.Namespace) -> int:
    print(
        f"prompt {args.prompt_len} tokens, vocab {results[0]['vocab']}, device {args.device}, "
        f"max_prefill_tokens {args.max_prefill_tokens}, peak from {results[0]['peak_source']}"
    )
    print(f"{'variant':<26} {'peak extra MiB':>15} {'seconds':>9}  checks")
    failures = 0
    for r in results:
        problems = check(r, args.prompt_len)
        failures += bool(problems)
        status = "; ".join(problems) or f"ok ({r['num_prompt_logprobs']} finite)"
        print(f"{r['variant']:<26} {r['peak_extra_mib']:>15.1f} {r['seconds']:>9.2f}  {status}")
    base = float(results[0]["peak_extra_mib"])
    full_mib = (args.prompt_len * float(results[0]["vocab"]) * 4) / MIB
    for r in results[1:]:
        extra = float(r["peak_extra_mib"]) - base
        failures += extra > TARGET_MIB
        print(
            f"prompt logprobs extra ({r['variant']}) = {extra:.1f} MiB (target <= {TARGET_MIB}"
            f" MiB; one float32 [{args.prompt_len}, {r['vocab']}] tensor is {full_mib:.0f} MiB)"
        )
    return 1 if failures else 0


def main() -> int:
    args = parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return 0
    model = resolve_model(args.model)
    return report([run_variant(args, model, v) for v in VARIANTS], args)


if __name__ == "__main__":
    sys.exit(main())
