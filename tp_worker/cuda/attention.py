"""Paged attention in Triton, for CUDA (tp_worker): the KV cache read where it lies, through
the request->slot table (a page table of page size 1), for decode rows and prompt chunks
after a prefix alike.

Each new token's keys are cut into splits of SPLIT positions at absolute positions (fixed,
whatever the batch) and each split into blocks of BLOCK_N keys at fixed boundaries
(multiples of BLOCK_N). One program per (tile, KV head, split) runs an online softmax over
its split, block by block in order, for a tile of BLOCK_M rows: up to BLOCK_M / GROUP_P
consecutive tokens of one request times the GROUP query heads that share the KV head (a
decode row: one token; a prompt chunk: many), so that each block of keys and values is read
once for all of them. Scores come from tl.dot (q and k in the model's dtype, float32 sums;
IEEE float32 for a float32 model); the weighted values too, on the tensor cores, with each
float32 weight cut into two parts of the values' dtype (hi, and lo = the rest: 16 of its 24
bits in bfloat16) and both products summed in float32 (IEEE float32 for a float32 model).
Every step of a row's softmax is its own (a tile-mate's keys past this row's position, or
before its window, are masked: exact no-ops on the row's state). A second kernel merges the
splits of each (token, head) in split order, up to the token's own last split.

What is free (chosen per step for speed, never changing a row's bits on the same hardware
path): the tile's height (DECODE_BLOCK_M rows where every tile holds one token, BLOCK_M
otherwise), how many splits a step launches (enough for its longest context), and how many
tokens share one launch (groups sized so that the float32 partials stay under
PARTIAL_BYTES at any context and chunk). So a token's result depends on its own context and
the fixed constants only, never on the rest of the batch nor on how its prompt was chunked.

Tested on the CPU under TRITON_INTERPRET=1 against float64 attention and for invariance
(tests/test_attention_triton.py, slow). RoPE and the KV write are torch ops
(attention_sdpa.TorchProjection).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.tp_worker.model.attention_sdpa import TorchProjection
from tokenmill.tp_worker.model.layer_attention import LayerAttention

try:
    import triton
    import triton.language as tl
except ImportError:  # NOTE: CPU installs need no Triton; only CUDA workers and tests use it
    triton = None

SPLIT = 256  # key positions per split
BLOCK_N = 32  # keys per step of a split's loop
BLOCK_M = 64  # rows (token x query head) per tile where a tile holds several tokens
DECODE_BLOCK_M = 16  # rows per tile where every tile holds one token (a decode-only step)
PV_HI_LO = True  # P.V on the tensor cores as hi + lo (False: IEEE float32, the CUDA cores)
# NOTE: a step's float32 partials (tokens x heads x splits x (DIM + 2)) past this are
# computed in several launches: at 8,192 keys an 8B shape's 2,048-token chunk needed ~1 GB.
PARTIAL_BYTES = 256 << 20


def available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class TritonAttention(TorchProjection):
    out_slots: torch.Tensor  # [T] int64 KV slot each new token writes
    table: torch.Tensor  # [R, max_len] int32
    token_rows: torch.Tensor  # [T] int32 table row of each new token
    token_pos: torch.Tensor  # [T] int32 absolute position of each new token
    decode_block_m: int = DECODE_BLOCK_M
    pv_hi_lo: bool = PV_HI_LO
    # NOTE: token_rows and token_pos on the host, where the step has them: the plan then
    # copies nothing back from the device (a sync on a GPU)
    host: tuple[np.ndarray, np.ndarray] | None = None
    # NOTE: the step's plans, made once for every layer (on the host: a sync a layer cost the
    # first H200 run a fifth of a decode step)
    made: dict[tuple[int, int], StepPlan] = field(default_factory=dict)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        settings: LayerAttention,
    ) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq * D] over one layer's cache [Hkv, slots, D]."""
        num_tokens, num_heads, dim = q.shape
        out = q.new_empty(num_tokens, num_heads, dim)
        if num_tokens == 0:
            return out.view(num_tokens, -1)
        q = q.contiguous()
        num_kv_heads = k_cache.shape[0]
        group = num_heads // num_kv_heads
        group_p = triton.next_power_of_2(group)
        plan = self.plan(group_p, num_heads * (dim + 2) * 4)
        most = max(t1 - t0 for t0, t1, _, _ in plan.launches)
        partial_max = q.new_empty(most, num_heads, plan.splits, dtype=torch.float32)
        partial_sum = torch.empty_like(partial_max)
        partial_out = q.new_empty(most, num_heads, plan.splits, dim, dtype=torch.float32)
        # NOTE: gpt-oss's sinks join the merge (a pointer to anything where there are none)
        sinks = partial_max if settings.sinks is None else settings.sinks.to(q.device)
        for t0, t1, a, b in plan.launches:
            _tile_kernel[(b - a, num_kv_heads, plan.splits)](
                q, k_cache, v_cache, self.table, plan.tiles[0, a:b], plan.tiles[1, a:b],
                plan.tiles[2, a:b], plan.tiles[3, a:b], partial_max, partial_sum, partial_out,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                self.table.stride(0), settings.scale, settings.window, settings.softcap, t0,
                GROUP=group, GROUP_P=group_p, DIM=dim, SPLIT=SPLIT, BLOCK_N=BLOCK_N,
                BLOCK_M=plan.block_m, IEEE=q.dtype == torch.float32,
                PV_IEEE=q.dtype == torch.float32 or not self.pv_hi_lo,
            )  # fmt: skip
            _merge_kernel[(t1 - t0, num_heads)](
                partial_max, partial_sum, partial_out, out, self.token_pos, sinks, t0,
                plan.splits, out.stride(0), out.stride(1), SPLIT=SPLIT, DIM=dim,
                OUT_FP32=out.dtype == torch.float32, HAS_SINKS=settings.sinks is not None,
            )  # fmt: skip
        return out.view(num_tokens, -1)

    def plan(self, group_p: int, bytes_per_split: int) -> StepPlan:
        """The step's tiles and launches for a GQA group of group_p (padded) heads, whose
        partials take bytes_per_split a token and split. NOTE: on the host, once a step,
        shared by every layer; from the step's host rows where it has them (else a copy
        back, a sync on a GPU)."""
        key = (group_p, bytes_per_split)
        if key not in self.made:
            rows, pos = self.host or (self.token_rows.cpu().numpy(), self.token_pos.cpu().numpy())
            self.made[key] = StepPlan.of(
                rows,
                pos,
                group_p,
                bytes_per_split,
                self.decode_block_m,
            ).to(self.token_rows.device)
        return self.made[key]


@dataclass(frozen=True)
class StepPlan:
    """A step's tiles and how they are launched (the free placement)."""

    tiles: torch.Tensor  # [4, NT] int32: table row, first token's index in [T], its position, count
    block_m: int  # rows a tile
    splits: int  # splits launched: enough for the step's longest context
    launches: tuple[tuple[int, int, int, int], ...]  # token range [t0, t1), tile range [a, b)

    @staticmethod
    def of(
        rows: np.ndarray, pos: np.ndarray, group_p: int, bytes_per_split: int, decode_block_m: int
    ) -> StepPlan:
        # NOTE: a new run where the row changes or the positions stop following each other
        fresh = np.ones(len(rows), dtype=bool)
        fresh[1:] = (rows[1:] != rows[:-1]) | (pos[1:] != pos[:-1] + 1)
        block_m = max(decode_block_m, group_p) if fresh.all() else max(BLOCK_M, group_p)
        tokens = block_m // group_p
        run_start = np.maximum.accumulate(np.where(fresh, np.arange(len(rows)), 0))
        first = fresh | ((np.arange(len(rows)) - run_start) % tokens == 0)
        starts = np.flatnonzero(first)
        counts = np.diff(np.append(starts, len(rows)))
        tiles = np.stack([rows[starts], starts, pos[starts], counts]).astype(np.int32)
        splits = int(pos.max()) // SPLIT + 1
        per_launch = PARTIAL_BYTES // (bytes_per_split * splits)
        return StepPlan(
            torch.from_numpy(tiles), block_m, splits, _launches(starts, len(rows), per_launch)
        )

    def to(self, device: torch.device) -> StepPlan:
        """NOTE: on a GPU from pinned memory, without waiting: a copy from pageable memory
        makes the host wait for the stream (a sync a step)."""
        if device.type == "cuda":
            tiles = self.tiles.pin_memory().to(device, non_blocking=True)
        else:
            tiles = self.tiles.to(device)
        return StepPlan(tiles, self.block_m, self.splits, self.launches)


def _launches(
    starts: np.ndarray, num_tokens: int, per_launch: int
) -> tuple[tuple[int, int, int, int], ...]:
    """Consecutive tiles (first tokens `starts`) in groups of at most per_launch tokens, or
    of one tile where that one holds more."""
    ends = np.append(starts[1:], num_tokens)
    launches = []
    a = 0
    while a < len(starts):
        t0 = int(starts[a])
        b = max(a + 1, int(np.searchsorted(ends, t0 + per_launch, side="right")))
        launches.append((t0, int(ends[b - 1]), a, b))
        a = b
    return tuple(launches)


def plan_triton(
    table: torch.Tensor,
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    out_slots: torch.Tensor,
    decode_block_m: int | None = None,
    pv_hi_lo: bool | None = None,
    host: tuple[np.ndarray, np.ndarray] | None = None,
) -> TritonAttention:
    """table [R, max_len] int32; token_rows and positions [T]: each new token's table row and
    absolute position (the step has them already: no work here); `host`: the same two as
    host arrays where the step has them (the plan then copies nothing back). decode_block_m:
    the tile height of a decode-only step, pv_hi_lo how P.V runs (None: DECODE_BLOCK_M,
    PV_HI_LO; free choices, benchmarks/gpu/gpu_accept.py checks they keep a row's bits)."""
    return TritonAttention(
        out_slots=out_slots,
        table=table,
        token_rows=token_rows.int(),
        token_pos=positions.int(),
        decode_block_m=DECODE_BLOCK_M if decode_block_m is None else decode_block_m,
        pv_hi_lo=PV_HI_LO if pv_hi_lo is None else pv_hi_lo,
        host=host,
    )


if triton is not None:

    @triton.jit
    def _tile_kernel(
        Q, K, V, TABLE, TILE_ROW, TILE_FIRST, TILE_POS, TILE_COUNT, MAX, SUM, OUT,
        stride_qt, stride_qh, stride_kh, stride_ks, stride_table, scale, window, softcap,
        token_base,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, DIM: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr, PV_IEEE: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        # NOTE: int64, so that kv_head * stride_kh cannot overflow on a cache of millions of slots
        kv_head = tl.program_id(1).to(tl.int64)
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
            scores = scores * scale
            if softcap > 0:  # NOTE: c * tanh(s / c), tanh as (1 - e) / (1 + e), e = exp(-2|x|)
                x = scores / softcap
                e = tl.exp(-2.0 * tl.abs(x))
                t = (1.0 - e) / (1.0 + e)
                scores = tl.where(x < 0, -t, t) * softcap
            scores = tl.where(seen, scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            # NOTE: a row with no key seen yet keeps best -inf, total and acc 0 exactly
            base = tl.where(new_best == float("-inf"), 0.0, new_best)
            weights = tl.exp(scores - base[:, None])
            rescale = tl.exp(best - base)
            v = tl.load(V + where, mask=inside[:, None], other=0.0)
            total = total * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None]
            if PV_IEEE:
                acc = tl.dot(weights.to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
            else:
                # NOTE: on the tensor cores: the weights as hi + lo in the values' dtype
                # (IEEE float32 on the CUDA cores took 20 ms of an H200's 64-row decode step;
                # three TF32 passes were slower still)
                hi = weights.to(v.dtype)
                lo = (weights - hi.to(tl.float32)).to(v.dtype)
                acc = tl.dot(lo, v, tl.dot(hi, v, acc))
            best = new_best
        at = ((first - token_base + t) * num_heads + head) * num_splits + split
        tl.store(MAX + at, best, mask=live)
        tl.store(SUM + at, total, mask=live)
        tl.store(OUT + at[:, None] * DIM + dims[None, :], acc, mask=live[:, None])

    @triton.jit
    def _merge_kernel(
        MAX, SUM, PARTIAL, OUT, POS, SINKS, first, num_splits, stride_ot, stride_oh,
        SPLIT: tl.constexpr, DIM: tl.constexpr, OUT_FP32: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):  # fmt: skip
        local = tl.program_id(0)
        token = first + local
        head = tl.program_id(1)
        base = (local * tl.num_programs(1) + head) * num_splits
        dims = tl.arange(0, DIM)
        # NOTE: the token's own splits (its position decides them, not the step's longest)
        mine = tl.load(POS + token) // SPLIT + 1
        best = tl.full([], float("-inf"), tl.float32)
        for split in range(0, mine):
            best = tl.maximum(best, tl.load(MAX + base + split))
        if HAS_SINKS:  # NOTE: a key of the sink's score and no value, after every split
            sink = tl.load(SINKS + head)
            best = tl.maximum(best, sink)
        total = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([DIM], dtype=tl.float32)
        for split in range(0, mine):  # NOTE: in split order, every time
            weight = tl.exp(tl.load(MAX + base + split) - best)
            total += tl.load(SUM + base + split) * weight
            acc += tl.load(PARTIAL + (base + split) * DIM + dims) * weight
        if HAS_SINKS:
            total += tl.exp(sink - best)
        result = acc / total
        out = OUT + token * stride_ot + head * stride_oh + dims
        if OUT_FP32:
            tl.store(out, result)
        else:  # NOTE: rounded to nearest even, as torch rounds (the interpreter's default cuts)
            tl.store(out, result.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"))
