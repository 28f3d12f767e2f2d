"""Attention over the slot-addressed KV cache, for a ragged batch (tp_worker).

Each row's keys are gathered from the KV cache through its slots in the request->slot table,
queries are padded to [B, Q], and one masked SDPA call serves prefill chunks, prefix hits
and decode alike. The metadata is built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionBatch:
    out_slots: torch.Tensor  # [T] int64 KV slot each new token writes
    key_slots: torch.Tensor  # [B, L] int64 slots of each row's keys (padding reads slot 0)
    mask: torch.Tensor  # [B, 1, Q, L] bool, True = may attend
    query_index: torch.Tensor  # [B, Q] int64 token index of each padded query (padding: 0)
    token_index: torch.Tensor  # [T] int64 flat [B*Q] index of each token's query


def build_attention_batch(
    table: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    out_slots: torch.Tensor,
    sliding_window: int | None,
) -> AttentionBatch:
    """table [R, max_len] int32; the other inputs are [B] int64 on the table's device."""
    device = table.device
    seq_lens = prefix_lens + extend_lens
    num_q = int(extend_lens.max())
    num_k = int(seq_lens.max())
    key_pos = torch.arange(num_k, device=device)
    q_off = torch.arange(num_q, device=device)
    q_pos = prefix_lens[:, None] + q_off[None, :]  # [B, Q]
    valid_q = q_off[None, :] < extend_lens[:, None]  # [B, Q]
    visible = key_pos[None, None, :] <= q_pos[:, :, None]  # causal, [B, Q, L]
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    # NOTE: padded queries see key 0 so that no softmax row is empty (NaN); they are dropped.
    visible &= valid_q[:, :, None]
    visible[:, :, 0] |= ~valid_q
    starts = torch.cumsum(extend_lens, 0) - extend_lens  # [B] first token index of each row
    query_index = torch.where(valid_q, starts[:, None] + q_off[None, :], 0)
    flat = torch.arange(len(req_rows) * num_q, device=device).view(-1, num_q)
    return AttentionBatch(
        out_slots=out_slots,
        key_slots=table[req_rows, :num_k].long(),
        mask=visible.unsqueeze(1),
        query_index=query_index,
        token_index=flat[valid_q],
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens -> [T, Hq * D].

    Writes the new keys and values into the cache first, so a row attends to itself."""
    k_cache.index_copy_(0, batch.out_slots, k)
    v_cache.index_copy_(0, batch.out_slots, v)
    keys = k_cache[batch.key_slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[batch.key_slots].transpose(1, 2)
    queries = q[batch.query_index].transpose(1, 2)  # [B, Hq, Q, D]
    out = F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=batch.mask,
        scale=scale,
        enable_gqa=queries.shape[1] != keys.shape[1],
    )  # [B, Hq, Q, D]
    out = out.transpose(1, 2).reshape(-1, q.shape[1] * q.shape[2])  # [B*Q, Hq*D]
    return out[batch.token_index]
