"""The CPU attention backend: csrc/attention.cpp (or, in bfloat16 on a CPU with AMX,
csrc/attention_amx.cpp) reads each row's keys and values where they lie in the KV cache,
through the request->slot table (tp_worker).

Every query token attends to its own row's positions [0, position] (or its layer's sliding
window),
so a row's work and its numbers depend on its own context only: the kernel's reduction order
is fixed per (token, head) (see the rule at the top of csrc/attention.cpp), never by its
batch, its chunk or how the kernel groups tokens into work items.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenmill.tp_worker.cpu.kernels import library
from tokenmill.tp_worker.cpu.ops import DTYPE_CODES, amx_enabled, rope_store_cpu
from tokenmill.tp_worker.model.layer_attention import LayerAttention


@dataclass(frozen=True)
class PagedAttention:
    table: torch.Tensor  # [R, max_len] int32 slot of each position of each table row
    rows: torch.Tensor  # [B] int64 table row of each batch row
    token_starts: torch.Tensor  # [B] int64 index in [T] of each batch row's first new token
    num_tokens: torch.Tensor  # [B] int64 new tokens of each batch row
    first_pos: torch.Tensor  # [B] int64 position of each batch row's first new token
    out_slots: torch.Tensor  # [T] int64 KV slot each new token writes
    # NOTE: the queries attended, as indices into the step's [T] tokens (None: all of them);
    # every new token's key and value is still written.
    query_index: torch.Tensor | None = None

    def keeping(
        self, index: torch.Tensor, first_pos: torch.Tensor, counts: torch.Tensor
    ) -> PagedAttention:
        """This plan for the tokens `index` [K] alone, a suffix of each row's new tokens
        (`counts` [B] of them from position `first_pos` [B]); the KV write stays whole."""
        starts = torch.cumsum(counts, 0) - counts
        return replace(
            self,
            token_starts=starts,
            num_tokens=counts.contiguous(),
            first_pos=first_pos.contiguous(),
            query_index=index,
        )

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        settings: LayerAttention,
    ) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq * D] over the cache [Hkv, slots, D], the new tokens' keys
        already in it."""
        # NOTE: the kernel takes raw pointers: what it reads must be laid out as it expects.
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
        assert self.table.is_contiguous() and self.table.dtype == torch.int32
        assert q.dtype == k_cache.dtype == v_cache.dtype
        q = q.contiguous()
        out = torch.empty_like(q)
        lib = library()
        amx = uses_amx(q.dtype, q.shape[2])
        status = (lib.tm_paged_attention_amx if amx else lib.tm_paged_attention)(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            self.table.data_ptr(),
            self.rows.data_ptr(),
            self.token_starts.data_ptr(),
            self.num_tokens.data_ptr(),
            self.first_pos.data_ptr(),
            out.data_ptr(),
            self.rows.shape[0],
            q.shape[1],
            k_cache.shape[0],
            q.shape[2],
            k_cache.stride(0),
            k_cache.stride(1),
            self.table.shape[1],
            settings.window,
            settings.scale,
            settings.softcap,
            None if settings.sinks is None else settings.sinks.data_ptr(),
            DTYPE_CODES[q.dtype],
        )
        assert status == 0, f"tm_paged_attention failed ({status})"
        return out.view(q.shape[0], -1)

    def attend_projection(
        self,
        qkv: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        kv: tuple[torch.Tensor, torch.Tensor],
        num_heads: int,
        num_kv_heads: int,
        settings: LayerAttention,
        kv_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RoPE and the KV write in one pass (csrc/rope.cpp), then `attend` (see Attention).
        With kv_rows [T, 2 Hkv * D], every token's keys and values, qkv holds the rows of the
        tokens `query_index` keeps only: the same rotations and writes, so the same bits."""
        if kv_rows is None:
            q = rope_store_cpu(qkv, cos_sin, kv, self.out_slots, num_heads, num_kv_heads)
            if self.query_index is not None:
                q = q[self.query_index]
        else:
            index = self.query_index
            assert index is not None
            rope_store_cpu(kv_rows, cos_sin, kv, self.out_slots, 0, num_kv_heads)
            kept_q, kept_cos_sin = qkv[:, : num_heads * kv[0].shape[2]], [c[index] for c in cos_sin]
            q = rope_store_cpu(kept_q, tuple(kept_cos_sin), kv, self.out_slots[index], num_heads, 0)
        return self.attend(q, kv[0], kv[1], settings)


def uses_amx(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention runs csrc/attention_amx.cpp. NOTE: the same kernel for every call of
    a model: its dtype, head size and the machine decide (bfloat16 heads of 64, 128, ... on
    AMX)."""
    return dtype == torch.bfloat16 and head_dim % 64 == 0 and amx_enabled()
