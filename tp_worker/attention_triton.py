"""Paged attention in Triton, for CUDA (tp_worker): the KV cache read where it lies, through
the request->slot table (a page table of page size 1), for decode rows and prompt chunks
after a prefix alike.

Each new token's keys are cut into splits of SPLIT positions (fixed, whatever the batch);
one program per (token, query head, split) runs an online softmax over its split in blocks
of BLOCK_N keys, in order; a second kernel merges the splits of each (token, head) in split
order. A token's result depends on its own context and these constants only, never on the
rest of the batch: batch-invariant by construction. The grid's split axis is sized from the
table's width (the longest context), so it is the same every step; splits past a token's
position do nothing.

Tested on the CPU under TRITON_INTERPRET=1 against float64 attention and for invariance
(tests/test_attention_triton.py, slow); timed on a GPU by benchmarks/gpu_check.sh when
one is lent. RoPE and the KV write are torch ops (attention_sdpa.TorchProjection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.tp_worker.attention_sdpa import TorchProjection

try:
    import triton
    import triton.language as tl
except ImportError:  # NOTE: CPU installs need no Triton; only CUDA workers and tests use it
    triton = None

SPLIT = 256  # key positions per split
BLOCK_N = 32  # keys per step of a split's loop


def available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class TritonAttention(TorchProjection):
    out_slots: torch.Tensor  # [T] int64 KV slot each new token writes
    table: torch.Tensor  # [R, max_len] int32
    token_rows: torch.Tensor  # [T] int32 table row of each new token
    token_pos: torch.Tensor  # [T] int32 absolute position of each new token
    sliding_window: int  # 0: none

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
        _split_kernel[(num_tokens, num_heads, num_splits)](
            q, k_cache, v_cache, self.table, self.token_rows, self.token_pos,
            partial_max, partial_sum, partial_out,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            self.table.stride(0), scale, self.sliding_window,
            GROUP=num_heads // k_cache.shape[0], DIM=dim, SPLIT=SPLIT, BLOCK_N=BLOCK_N,
        )  # fmt: skip
        _merge_kernel[(num_tokens, num_heads)](
            partial_max, partial_sum, partial_out, out,
            num_splits, out.stride(0), out.stride(1), DIM=dim,
        )  # fmt: skip
        return out.view(num_tokens, -1)


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
    def _split_kernel(
        Q, K, V, TABLE, TOKEN_ROWS, TOKEN_POS, MAX, SUM, OUT,
        stride_qt, stride_qh, stride_kh, stride_ks, stride_table, scale, window,
        GROUP: tl.constexpr, DIM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
        row = tl.load(TOKEN_ROWS + token)
        pos = tl.load(TOKEN_POS + token)
        lo = split * SPLIT
        if window > 0:
            lo = tl.maximum(lo, pos - window + 1)
        hi = tl.minimum(split * SPLIT + SPLIT, pos + 1)
        dims = tl.arange(0, DIM)
        q = tl.load(Q + token * stride_qt + head * stride_qh + dims).to(tl.float32)
        kv_head = head // GROUP
        best = tl.full([], float("-inf"), tl.float32)
        total = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([DIM], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            valid = keys < hi
            slots = tl.load(TABLE + row * stride_table + keys, mask=valid, other=0).to(tl.int64)
            where = kv_head * stride_kh + slots[:, None] * stride_ks + dims[None, :]
            k = tl.load(K + where, mask=valid[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], 1) * scale
            scores = tl.where(valid, scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 0))
            weights = tl.exp(scores - new_best)
            rescale = tl.exp(best - new_best)
            v = tl.load(V + where, mask=valid[:, None], other=0.0).to(tl.float32)
            total = total * rescale + tl.sum(weights, 0)
            acc = acc * rescale + tl.sum(weights[:, None] * v, 0)
            best = new_best
        at = (token * tl.num_programs(1) + head) * num_splits + split
        tl.store(MAX + at, best)
        tl.store(SUM + at, total)
        tl.store(OUT + at * DIM + dims, acc)

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
