"""Configuration of a model runner (tp_worker): which checkpoint, where, and how much cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    model: str
    """Directory of a Hugging Face checkpoint (config.json, *.safetensors)."""
    kv_cache_tokens: int
    """KV slots per layer; the controller addresses them 0..kv_cache_tokens-1."""
    max_running_requests: int = 64
    """Rows of the request->slot table: requests that can hold KV at once."""
    max_model_len: int = 4096
    """Longest sequence (prompt + output) a row of the table can hold."""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N."""
    prompt_logprob_chunk: int = 0
    """Prompt positions scored per lm_head chunk; 0 = as many as fit 64 MiB of logits."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]
