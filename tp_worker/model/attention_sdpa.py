"""The torch attention backend (SDPA over gathered keys), for devices without a kernel of
our own: CUDA today, until a paged kernel fills the seam there (tp_worker).

Each row's keys are gathered from the KV cache through its slots in the request->slot table,
and one masked SDPA call per group serves all rows of the group. Decode rows (one sampled
token each) and prefill rows (prompt chunks, after a prefix hit or not) form two groups.

NOTE: the groups and the padding keep a row's numbers independent of its batch. SDPA's CPU
kernels sum in an order that depends on the padded key length and on whether there is one
query or many; so keys are padded to a multiple of KEY_BLOCK, prefill queries to a multiple
of QUERY_BLOCK, and decode rows never share a call with prefill rows. The metadata is built
once per step and shared by every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.tp_worker.model.layer_attention import LayerAttention
from tokenmill.tp_worker.model.rope import apply_rotary

KEY_BLOCK = 64
QUERY_BLOCK = 32


@dataclass(frozen=True)
class AttentionGroup:
    key_slots: torch.Tensor  # [G, L] int64 slots of each row's keys (padding reads slot 0)
    mask: torch.Tensor  # [G, 1, Q, L] bool, True = may attend (causal)
    query_index: torch.Tensor  # [G, Q] int64 token index of each padded query (padding: 0)
    valid: torch.Tensor  # [N] int64 flat [G*Q] index of each real query
    tokens: torch.Tensor  # [N] int64 token index of each real query, same order
    q_pos: torch.Tensor  # [G, Q] int64 position of each padded query
    # NOTE: the mask within each window a layer asks for, made once a step
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int) -> torch.Tensor:
        """The mask of a layer that attends in `window` (0: the causal mask)."""
        if window <= 0:
            return self.mask
        if window not in self.windowed:
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            inside = key_pos[None, None, :] > self.q_pos[:, :, None] - window
            mask = self.mask & inside.unsqueeze(1)
            mask[..., 0] |= ~mask.any(-1)  # NOTE: padded queries keep key 0 (no NaN rows)
            self.windowed[window] = mask
        return self.windowed[window]


class TorchProjection:
    """`attend_projection` with torch ops (RoPE, the KV write) for backends that bring only
    their own `attend`: SDPA here, Triton in cuda/attention.py."""

    out_slots: torch.Tensor

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        settings: LayerAttention,
    ) -> torch.Tensor:
        raise NotImplementedError

    def attend_projection(
        self,
        qkv: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        kv: tuple[torch.Tensor, torch.Tensor],
        num_heads: int,
        num_kv_heads: int,
        settings: LayerAttention,
    ) -> torch.Tensor:
        """RoPE on q and k of the fused projection, the new keys and values into the layer's
        cache [Hkv, slots, D] at `out_slots`, then `attend` (see attention.Attention)."""
        dim = kv[0].shape[2]
        q, k, v = qkv.split([num_heads * dim, num_kv_heads * dim, num_kv_heads * dim], dim=-1)
        q = apply_rotary(q.view(-1, num_heads, dim), *cos_sin)
        k = apply_rotary(k.view(-1, num_kv_heads, dim), *cos_sin)
        kv[0].index_copy_(1, self.out_slots, k.transpose(0, 1))
        kv[1].index_copy_(1, self.out_slots, v.view(-1, num_kv_heads, dim).transpose(0, 1))
        return self.attend(q, kv[0], kv[1], settings)


@dataclass(frozen=True)
class SdpaAttention(TorchProjection):
    out_slots: torch.Tensor  # [T] int64 KV slot each new token writes
    groups: tuple[AttentionGroup, ...]

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        settings: LayerAttention,
    ) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq * D] over the cache, the new tokens' keys already in it."""
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for group in self.groups:
            keys = k_cache[:, group.key_slots].transpose(0, 1)  # [G, Hkv, L, D]
            values = v_cache[:, group.key_slots].transpose(0, 1)
            queries = q[group.query_index].transpose(1, 2)  # [G, Hq, Q, D]
            mask = group.mask_for(settings.window)
            if settings.softcap > 0 or settings.sinks is not None:
                result = _eager(queries, keys, values, mask, settings)
            else:
                result = F.scaled_dot_product_attention(
                    queries,
                    keys,
                    values,
                    attn_mask=mask,
                    scale=settings.scale,
                    enable_gqa=queries.shape[1] != keys.shape[1],
                )  # [G, Hq, Q, D]
            out[group.tokens] = result.transpose(1, 2).reshape(-1, out.shape[1])[group.valid]
        return out


def _eager(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    settings: LayerAttention,
) -> torch.Tensor:
    """Attention with Gemma 2's soft-capped scores or gpt-oss's sinks (SDPA takes neither),
    in float32 as transformers' eager attention computes it: [G, Hq, Q, D]."""
    repeat = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(repeat, dim=1).float()
    values = values.repeat_interleave(repeat, dim=1).float()
    scores = queries.float() @ keys.transpose(-1, -2) * settings.scale
    if settings.softcap > 0:
        scores = torch.tanh(scores / settings.softcap) * settings.softcap
    scores = scores.masked_fill(~mask, -math.inf)
    if settings.sinks is None:
        return (scores.softmax(-1) @ values).to(queries.dtype)
    # NOTE: the sink as one more key of that score and no value, dropped after the softmax
    sink = settings.sinks.to(scores.device).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return (weights @ values).to(queries.dtype)


def plan_sdpa(
    table: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    starts: torch.Tensor,
    is_prefill: torch.Tensor,
    out_slots: torch.Tensor,
) -> SdpaAttention:
    """table [R, max_len] int32; the other inputs are [B] on the table's device."""
    groups = []
    for rows, query_block in (
        ((~is_prefill).nonzero().squeeze(1), 1),
        (is_prefill.nonzero().squeeze(1), QUERY_BLOCK),
    ):
        if rows.numel():
            lens = (req_rows[rows], prefix_lens[rows], extend_lens[rows], starts[rows])
            if query_block == 1:
                lens = _one_query_each(*lens)
            groups.append(_group(table, *lens, query_block))
    return SdpaAttention(out_slots=out_slots, groups=tuple(groups))


def _one_query_each(
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    starts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode rows with several tokens (a sampled token and the drafts after it) as one
    single-query row per token, each seeing the positions up to its own: the call plain
    decoding makes for each of them (SDPA's sum order depends on the query count)."""
    if bool((extend_lens == 1).all()):
        return req_rows, prefix_lens, extend_lens, starts
    offsets = torch.arange(int(extend_lens.sum()), device=extend_lens.device)
    offsets = offsets - (torch.cumsum(extend_lens, 0) - extend_lens).repeat_interleave(extend_lens)
    return (
        req_rows.repeat_interleave(extend_lens),
        prefix_lens.repeat_interleave(extend_lens) + offsets,
        torch.ones_like(offsets),
        starts.repeat_interleave(extend_lens) + offsets,
    )


def _group(
    table: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    starts: torch.Tensor,
    query_block: int,
) -> AttentionGroup:
    device = table.device
    num_q = _round_up(int(extend_lens.max()), query_block)
    num_k = _round_up(int((prefix_lens + extend_lens).max()), KEY_BLOCK)
    key_pos = torch.arange(num_k, device=device)
    q_off = torch.arange(num_q, device=device)
    q_pos = prefix_lens[:, None] + q_off[None, :]  # [G, Q]
    valid_q = q_off[None, :] < extend_lens[:, None]  # [G, Q]
    visible = key_pos[None, None, :] <= q_pos[:, :, None]  # causal, [G, Q, L]
    # NOTE: padded queries see key 0 so that no softmax row is empty (NaN); they are dropped.
    visible &= valid_q[:, :, None]
    visible[:, :, 0] |= ~valid_q
    query_index = torch.where(valid_q, starts[:, None] + q_off[None, :], 0)
    columns = key_pos.clamp(max=table.shape[1] - 1)
    flat = torch.arange(valid_q.numel(), device=device).view_as(valid_q)
    return AttentionGroup(
        key_slots=table[req_rows][:, columns].long(),
        mask=visible.unsqueeze(1),
        query_index=query_index,
        valid=flat[valid_q],
        tokens=query_index[valid_q],
        q_pos=q_pos,
    )


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block
