"""Where a tp_worker runs: its device, its dtype, and how many KV slots fit (tp_worker)."""

from __future__ import annotations

import torch

from tokenmill.tp_worker.cpu.kernels import cpu_flags

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        native = device.type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX: bfloat16 products in hardware (csrc/linear.cpp uses VDPBF16PS);
    elsewhere bfloat16 would be emulated, slower than float32."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


# NOTE: the share of available memory the KV cache may take on the CPU when
# --kv-cache-tokens is 0: the rest of the machine needs room too. (A GPU's cache is sized
# after a profiling step: cuda/memory_profile.py.)
CPU_KV_MEMORY_FRACTION = 0.25


def cpu_kv_cache_tokens(bytes_per_token: int, cap: int, cpu_sharers: int = 1) -> int:
    """KV slots that fit in the host's available memory, at most `cap`; `cpu_sharers`
    processes size theirs from the same memory at once."""
    free = _mem_available() // max(1, cpu_sharers)
    return max(1, min(cap, int(free * CPU_KV_MEMORY_FRACTION) // bytes_per_token))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
