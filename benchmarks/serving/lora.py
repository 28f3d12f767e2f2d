"""LoRA's speed: a request on an adapter against one on the base, on one server that holds
both, at one user (TPOT) and at 64 users spread over 4 adapters (output tok/s); vLLM CPU
serving the same adapters beside it (--vllm).

The adapters are random PEFT ones (rank --rank, every projection q/k/v/o/gate/up/down), made
on the checkpoint with peft. The workload is `vllm bench serve`'s random one: 128 random
prompt tokens, 128 out (ignore_eos). Each figure is the median over --rounds rounds; at one
user, base and adapter requests alternate in one run (the pairs see the same machine), at 64
users the two workloads alternate round by round (vLLM's after tokenmill's, one server at a
time).

    python benchmarks/serving/lora.py [--model DIR] [--rank 16] [--rounds 3] [--vllm | --vllm-only]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from server import cpu_name, start_server, stop_server
from speculative import random_bodies, run

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.peers.launch import start_vllm, stop  # noqa: E402
from tokenmill.tp_worker.device import cpu_has_native_bf16  # noqa: E402

NUM_ADAPTERS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: Path, out: Path, rank: int) -> dict[str, Path]:
    """NUM_ADAPTERS random PEFT adapters on `model`: name -> directory."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tokenmill.cli.gguf_checkpoint import transformers_model

    adapters = {}
    for i in range(NUM_ADAPTERS):
        torch.manual_seed(i)
        base = transformers_model(Path(model), torch.float32)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS,
                            init_lora_weights=False)  # fmt: skip
        get_peft_model(base, config).save_pretrained(out / f"a{i}")
        adapters[f"a{i}"] = out / f"a{i}"
    return adapters


# (users, bodies, each body's figure): one workload, run as one `vllm bench serve`-like run
Workload = tuple[int, list[dict[str, Any]], list[str]]


def workloads(vocab: int, users: int) -> list[Workload]:
    """One user alternating base and adapter requests (each pair the same prompt, so that
    both sample the same state of a shared machine: its 1-user TPOT moves by 30% from one
    request to the next here); `users` users on the base; as many spread over the
    adapters."""
    one = random_bodies(8, vocab, 128, 128)
    many = random_bodies(2 * users, vocab, 128, 128)
    alternating = [pair for b in one for pair in (b, {**b, "model": "a0"})]
    spread = [{**b, "model": f"a{i % NUM_ADAPTERS}"} for i, b in enumerate(many)]
    return [
        (1, alternating, ["1 user, base", "1 user, adapter"] * len(one)),
        (users, many, [f"{users} users, base"] * len(many)),
        (users, spread, [f"{users} users, {NUM_ADAPTERS} adapters"] * len(many)),
    ]


def measure(url: str, loads: list[Workload], rounds: int) -> dict[str, tuple[float, float] | str]:
    """figure -> (median output tok/s, median TPOT ms) over `rounds`, workloads interleaved;
    or, for a workload the server failed, its error (the rest are not run after it). A
    figure sharing its run with another (one user) has tok/s over its own requests' time."""
    asyncio.run(run(url, loads[0][1][:2], 2))  # NOTE: warm-up
    figures: dict[str, list[tuple[float, float]]] = {name: [] for _, _, ns in loads for name in ns}
    for _ in range(rounds):
        for users, bodies, names in loads:
            try:
                seconds, timed = asyncio.run(run(url, bodies, users))
            except (AssertionError, OSError) as e:
                return {**_medians(figures), names[0]: f"failed: {str(e)[:200]}"}
            for name in dict.fromkeys(names):
                own = [t for t, n in zip(timed, names, strict=True) if n == name]
                tpots = [(t.latency - t.ttft) / (t.tokens - 1) for t in own if t.tokens > 1]
                spent = seconds if len(own) == len(timed) else sum(t.latency for t in own)
                tok_s = sum(t.tokens for t in own) / spent
                figures[name].append((tok_s, 1e3 * statistics.median(tpots)))
    return dict(_medians(figures))


def _medians(figures: dict[str, list[tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    return {
        name: (statistics.median(f[0] for f in fs), statistics.median(f[1] for f in fs))
        for name, fs in figures.items()
        if fs
    }


def lora_flags(adapters: dict[str, Path], rank: int) -> list[str]:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return ["--enable-lora", "--lora-modules", *modules, "--max-loras", str(NUM_ADAPTERS),
            "--max-lora-rank", str(rank)]  # fmt: skip


def print_table(results: dict[str, dict[str, tuple[float, float] | str]], users: int) -> None:
    print(f"\n{'server':<10} {'workload':<26} {'out tok/s':>10} {'TPOT ms':>8}")
    for server, figures in results.items():
        for name, value in figures.items():
            if isinstance(value, str):
                print(f"{server:<10} {name:<26} {value}")
            else:
                print(f"{server:<10} {name:<26} {value[0]:>10.1f} {value[1]:>8.2f}")
    print("\nratios (adapter / base):")
    many_lora, many_base = f"{users} users, {NUM_ADAPTERS} adapters", f"{users} users, base"
    for server, f in results.items():
        one = _ratio(f, "1 user, adapter", "1 user, base", 1)
        many = _ratio(f, many_lora, many_base, 0)
        print(f"{server:<10} TPOT at 1 user {one}   out tok/s at {users} users {many}")


def _ratio(figures: dict[str, tuple[float, float] | str], top: str, bottom: str, at: int) -> str:
    a, b = figures.get(top), figures.get(bottom)
    if not isinstance(a, tuple) or not isinstance(b, tuple):
        return "-"
    return f"{a[at] / b[at]:.3f}x"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default: SmolLM2)")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank (16)")
    p.add_argument("--users", type=int, default=64, help="the many-user count (64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per server (3)")
    p.add_argument("--dtype", default="", help="default: what tokenmill's auto picks here")
    p.add_argument("--vllm", action="store_true", help="vLLM CPU too, with the same adapters")
    p.add_argument("--vllm-only", action="store_true", help="vLLM CPU alone (its figures)")
    return p.parse_args()


def tokenmill_figures(
    args: argparse.Namespace, loads: list[Workload], adapters: dict, root: Path
) -> dict:
    flags = ["--served-model-name", "m", "--dtype", args.dtype, "--max-model-len", "2048"]
    flags += lora_flags(adapters, args.rank)
    proc, url = start_server(args.model, flags, root / "tokenmill.log")
    try:
        return measure(url, loads, args.rounds)
    finally:
        stop_server(proc)


def vllm_figures(
    args: argparse.Namespace, loads: list[Workload], adapters: dict, root: Path
) -> dict:
    log = root / "vllm.log"
    peer = start_vllm(args.model, args.dtype, log, lora_flags(adapters, args.rank))
    try:
        figures = measure(peer.url, loads, args.rounds)
    finally:
        stop(peer)
    if any(isinstance(v, str) for v in figures.values()):
        lines = log.read_text().splitlines()
        errors = [line for line in lines if "Error" in line and "HTTP/1.1" not in line]
        print("vLLM's log, its last error lines:\n" + "\n".join(errors[-15:]))
    return figures


def main() -> int:
    from tokenmill.tp_worker.model.config import load_model_config

    args = parse_args()
    args.dtype = args.dtype or ("bfloat16" if cpu_has_native_bf16() else "float32")
    if args.model is None:
        from tokenmill.cli.default_model import resolve_model

        args.model = resolve_model(None).directory
    loads = workloads(load_model_config(str(args.model)).vocab_size, args.users)
    results: dict[str, dict[str, tuple[float, float] | str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        adapters = make_adapters(args.model, root, args.rank)
        if not args.vllm_only:
            results["tokenmill"] = tokenmill_figures(args, loads, adapters, root)
        if args.vllm or args.vllm_only:
            results["vLLM"] = vllm_figures(args, loads, adapters, root)
    print_table(results, args.users)
    print(f"\nmodel {args.model}, dtype {args.dtype}, rank {args.rank}, {os.cpu_count()} CPUs: "
          f"{cpu_name()}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
