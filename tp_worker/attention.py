"""The attention seam: one object per step that every layer calls (tp_worker).

The model code is the same on every device; what runs under it is picked here from the
device and dtype: our own paged CPU kernel (attention_cpu.py), or torch's SDPA over gathered
keys (attention_sdpa.py) where no kernel of ours exists yet (CUDA, float16).
"""

from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.tp_worker import attention_cpu
from tokenmill.tp_worker.attention_sdpa import plan_sdpa


class Attention(Protocol):
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens -> [T, Hq * D], after writing
        k/v into one layer's cache [slots, Hkv, D]."""
        ...


def plan_attention(
    table: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    is_prefill: torch.Tensor,
    out_slots: torch.Tensor,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> Attention:
    """One step's attention metadata, built once and shared by every layer. `table` is
    [R, max_len] int32; out_slots is [T] int64; the other tensors are [B] int64 (bool)."""
    if table.device.type == "cpu" and attention_cpu.supports(dtype):
        return attention_cpu.PagedAttention(
            table=table,
            rows=req_rows.contiguous(),
            token_starts=torch.cumsum(extend_lens, 0) - extend_lens,
            num_tokens=extend_lens.contiguous(),
            first_pos=prefix_lens.contiguous(),
            out_slots=out_slots,
            sliding_window=sliding_window or 0,
        )
    return plan_sdpa(
        table, req_rows, prefix_lens, extend_lens, is_prefill, out_slots, sliding_window
    )
