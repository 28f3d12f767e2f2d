"""Paged attention in Triton, for CUDA (tp_worker): the KV cache read where it lies, through
the request->slot table (a page table of page size 1), for decode rows and prompt chunks
after a prefix alike.

Each new token's keys are cut into splits of SPLIT positions (fixed, whatever the batch) and
each split into blocks of BLOCK_N keys at fixed boundaries (multiples of BLOCK_N). One
program per (tile, KV head, split) runs an online softmax over its split, block by block in
order, for a tile of BLOCK_M rows: up to BLOCK_M / GROUP_P consecutive tokens of one request
times the GROUP query heads that share the KV head (a decode row: one token; a prompt chunk:
many), so that each block of keys and values is read once for all of them. Scores come from
tl.dot (q and k in the model's dtype, float32 sums; IEEE float32 for a float32 model), the
weighted values from an IEEE float32 tl.dot; every step of a row's softmax is its own (a
tile-mate's keys past this row's position, or before its window, are masked: exact no-ops
on the row's state). A second kernel merges the splits of each (token, head) in split order.
So a token's result depends on its own context and these constants only, never on the rest
of the batch nor on how its prompt was chunked: batch-invariant by construction (the tensor
cores compute every row of a tile alike; checked on an H200 by benchmarks/gpu_check.sh).

Tested on the CPU under TRITON_INTERPRET=1 against float64 attention and for invariance
(tests/test_attention_triton.py, slow). RoPE and the KV write are torch ops
(attention_sdpa.TorchProjection).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.tp_worker.attention_sdpa import TorchProjection

try:
    import triton
    import triton.language as tl
except ImportError:  # NOTE: CPU installs need no Triton; only CUDA workers and tests use it
    triton = None

SPLIT = 256  # key positions per split
BLOCK_N = 32  # keys per step of a split's loop
BLOCK_M = 64  # rows (token x query head) per tile


def available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class TritonAttention(TorchProjection):
    out_slots: torch.Tensor  # [T] int64 KV slot each new token writes
    table: torch.Tensor  # [R, max_len] int32
    token_rows: torch.Tensor  # [T] int32 table row of each new token
    token_pos: torch.Tensor  # [T] int32 absolute position of each new token
    sliding_window: int  # 0: none
    # NOTE: the step's tiles by tokens a tile, made once for every layer (on the host: a
    # sync a layer cost the first H200 run a fifth of a decode step)
    made: dict[int, torch.Tensor] = field(default_factory=dict)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq * D] over one layer's cache [Hkv, slots, D]."""
        num_tokens, num_heads, dim = q.shape
        num_splits = -(-self.table.shape[1] // SPLIT)
        partial_max = q.new_empty(num_tokens, num_heads, num_splits, dtype=torch.float32)
        partial_sum = torch.empty_like(partial_max)
        partial_out = q.new_empty(num_tokens, num_heads, num_splits, dim, dtype=torch.float32)
        out = q.new_empty(num_tokens, num_heads, dim)
        if num_tokens == 0:
            return out.view(num_tokens, -1)
        q = q.contiguous()
        num_kv_heads = k_cache.shape[0]
        group = num_heads // num_kv_heads
        group_p = triton.next_power_of_2(group)
        tiles = self.tiles(BLOCK_M // group_p)
        _tile_kernel[(tiles.shape[1], num_kv_heads, num_splits)](
            q, k_cache, v_cache, self.table, tiles[0], tiles[1], tiles[2], tiles[3],
            partial_max, partial_sum, partial_out,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            self.table.stride(0), scale, self.sliding_window,
            GROUP=group, GROUP_P=group_p, DIM=dim, SPLIT=SPLIT, BLOCK_N=BLOCK_N,
            BLOCK_M=BLOCK_M, IEEE=q.dtype == torch.float32,
        )  # fmt: skip
        _merge_kernel[(num_tokens, num_heads)](
            partial_max, partial_sum, partial_out, out,
            num_splits, out.stride(0), out.stride(1), DIM=dim,
        )  # fmt: skip
        return out.view(num_tokens, -1)

    def tiles(self, tokens: int) -> torch.Tensor:
        """[4, NT] int32 tiles of up to `tokens` consecutive tokens of one request: table
        row, first token's index in [T], its position, token count. NOTE: on the host, once
        a step (one sync)."""
        if tokens not in self.made:
            self.made[tokens] = self._tiles(tokens)
        return self.made[tokens]

    def _tiles(self, tokens: int) -> torch.Tensor:
        rows = self.token_rows.cpu().numpy()
        pos = self.token_pos.cpu().numpy()
        # NOTE: a new run where the row changes or the positions stop following each other
        fresh = np.ones(len(rows), dtype=bool)
        fresh[1:] = (rows[1:] != rows[:-1]) | (pos[1:] != pos[:-1] + 1)
        run_start = np.maximum.accumulate(np.where(fresh, np.arange(len(rows)), 0))
        first = fresh | ((np.arange(len(rows)) - run_start) % tokens == 0)
        starts = np.flatnonzero(first)
        counts = np.diff(np.append(starts, len(rows)))
        table = np.stack([rows[starts], starts, pos[starts], counts]).astype(np.int32)
        return torch.from_numpy(table).to(self.token_rows.device)


def plan_triton(
    table: torch.Tensor,
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    out_slots: torch.Tensor,
    sliding_window: int | None,
) -> TritonAttention:
    """table [R, max_len] int32; token_rows and positions [T]: each new token's table row and
    absolute position (the step has them already: no work here)."""
    return TritonAttention(
        out_slots=out_slots,
        table=table,
        token_rows=token_rows.int(),
        token_pos=positions.int(),
        sliding_window=sliding_window or 0,
    )


if triton is not None:

    @triton.jit
    def _tile_kernel(
        Q, K, V, TABLE, TILE_ROW, TILE_FIRST, TILE_POS, TILE_COUNT, MAX, SUM, OUT,
        stride_qt, stride_qh, stride_kh, stride_ks, stride_table, scale, window,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, DIM: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        num_heads = tl.num_programs(1) * GROUP
        num_splits = tl.num_programs(2)
        row = tl.load(TILE_ROW + tile)
        first = tl.load(TILE_FIRST + tile)
        pos0 = tl.load(TILE_POS + tile)
        count = tl.load(TILE_COUNT + tile)
        r = tl.arange(0, BLOCK_M)
        t = r // GROUP_P  # the row's token in the tile
        h = r % GROUP_P  # its query head in the group
        live = (t < count) & (h < GROUP)
        head = kv_head * GROUP + h
        pos = pos0 + t
        dims = tl.arange(0, DIM)
        q = tl.load(
            Q + (first + t)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=live[:, None],
            other=0.0,
        )
        lo_row = tl.zeros([BLOCK_M], dtype=tl.int32) + split * SPLIT
        if window > 0:
            lo_row = tl.maximum(lo_row, pos - window + 1)
        hi_row = tl.minimum(split * SPLIT + SPLIT, pos + 1)
        # NOTE: blocks at multiples of BLOCK_N, from the tile's lowest row start: a row's
        # blocks are the same ones whatever shares its tile
        end = tl.minimum(split * SPLIT + SPLIT, pos0 + count)
        start = split * SPLIT
        if window > 0:
            start = tl.maximum(start, ((pos0 - window + 1) // BLOCK_N) * BLOCK_N)
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DIM], dtype=tl.float32)
        for block in range(start, end, BLOCK_N):
            keys = block + tl.arange(0, BLOCK_N)
            inside = keys < end
            slots = tl.load(TABLE + row * stride_table + keys, mask=inside, other=0).to(tl.int64)
            where = kv_head * stride_kh + slots[:, None] * stride_ks + dims[None, :]
            k = tl.load(K + where, mask=inside[:, None], other=0.0)
            if IEEE:  # noqa: SIM108 (a branch on a constexpr, resolved at compile time)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            seen = (keys[None, :] >= lo_row[:, None]) & (keys[None, :] < hi_row[:, None])
            scores = tl.where(seen, scores * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            # NOTE: a row with no key seen yet keeps best -inf, total and acc 0 exactly
            base = tl.where(new_best == float("-inf"), 0.0, new_best)
            weights = tl.exp(scores - base[:, None])
            rescale = tl.exp(best - base)
            v = tl.load(V + where, mask=inside[:, None], other=0.0).to(tl.float32)
            total = total * rescale + tl.sum(weights, 1)
            # NOTE: IEEE float32: three TF32 passes ("tf32x3") were slower on the H200 (the
            # kernel 20 -> 29 ms a decode step at 64 rows, 84 -> 120 ms a 4,096-token prefill)
            acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="ieee")
            best = new_best
        at = ((first + t) * num_heads + head) * num_splits + split
        tl.store(MAX + at, best, mask=live)
        tl.store(SUM + at, total, mask=live)
        tl.store(OUT + at[:, None] * DIM + dims[None, :], acc, mask=live[:, None])

    @triton.jit
    def _merge_kernel(MAX, SUM, PARTIAL, OUT, num_splits, stride_ot, stride_oh, DIM: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        base = (token * tl.num_programs(1) + head) * num_splits
        dims = tl.arange(0, DIM)
        best = tl.full([], float("-inf"), tl.float32)
        for split in range(0, num_splits):
            best = tl.maximum(best, tl.load(MAX + base + split))
        total = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([DIM], dtype=tl.float32)
        for split in range(0, num_splits):  # NOTE: in split order, every time
            weight = tl.exp(tl.load(MAX + base + split) - best)
            total += tl.load(SUM + base + split) * weight
            acc += tl.load(PARTIAL + (base + split) * DIM + dims) * weight
        result = acc / total
        tl.store(OUT + token * stride_ot + head * stride_oh + dims, result.to(OUT.dtype.element_ty))
