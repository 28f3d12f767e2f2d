"""The attention seam: one object per step that every layer calls (tp_worker).

The model code is the same on every device; what runs under it is picked once per worker
(ModelRunner.attention_backend): our own paged CPU kernel (cpu/attention.py, on the CPU in a
dtype csrc/ takes), torch's SDPA over gathered keys (model/attention_sdpa.py, elsewhere), or the
paged Triton kernel (cuda/attention.py, `--attention-backend triton`: for CUDA, opt-in
until a lent GPU has validated it).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from tokenmill.tp_worker.cpu import attention as attention_cpu
from tokenmill.tp_worker.cuda import attention as attention_triton
from tokenmill.tp_worker.model.attention_sdpa import plan_sdpa
from tokenmill.tp_worker.model.layer_attention import LayerAttention
from tokenmill.tp_worker.step_inputs import LastLayerRows


class Attention(Protocol):
    out_slots: torch.Tensor  # [T] int64 KV slot each new token writes

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        settings: LayerAttention,
    ) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq * D] over one layer's cache [Hkv, slots, D], which already
        holds the new tokens' keys and values; the layer's scale, window and soft-cap."""
        ...

    def attend_projection(
        self,
        qkv: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        kv: tuple[torch.Tensor, torch.Tensor],
        num_heads: int,
        num_kv_heads: int,
        settings: LayerAttention,
    ) -> torch.Tensor:
        """The fused projection qkv [T, (Hq + 2 Hkv) * D] -> [T, Hq * D]: RoPE on q and k,
        the new keys and values into the layer's cache, then `attend`."""
        ...


def plan_attention(
    table: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    starts: torch.Tensor,
    is_prefill: torch.Tensor,
    out_slots: torch.Tensor,
    backend: str,
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    host: tuple[np.ndarray, np.ndarray] | None = None,
) -> Attention:
    """One step's attention metadata, built once and shared by every layer (each brings its
    own window: layer_attention.py). `table` is
    [R, max_len] int32; out_slots is [T] int64; the other tensors are [B] int64 (bool);
    `starts` is the index in [T] of each row's first new token; token_rows and positions
    are [T]: each new token's table row and position (`host`: the same two on the host, where
    the caller has them). backend: cpu, sdpa, triton."""
    if backend == "triton":
        return attention_triton.plan_triton(table, token_rows, positions, out_slots, host=host)
    if backend == "cpu":
        return attention_cpu.PagedAttention(
            table=table,
            rows=req_rows.contiguous(),
            token_starts=starts,
            num_tokens=extend_lens.contiguous(),
            first_pos=prefix_lens.contiguous(),
            out_slots=out_slots,
        )
    return plan_sdpa(table, req_rows, prefix_lens, extend_lens, starts, is_prefill, out_slots)


def plan_last_layer(attention: Attention, rows: LastLayerRows | None) -> Attention | None:
    """The last layer's plan when it computes only `rows` past its KV write, or None to
    compute every token: no rows to drop, or a backend whose numbers for a token might
    depend on the tokens beside it (only the CPU kernel's never do)."""
    if rows is None or not isinstance(attention, attention_cpu.PagedAttention):
        return None
    return attention.keeping(rows.index, rows.first_pos, rows.counts)
