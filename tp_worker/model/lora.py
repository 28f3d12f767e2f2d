"""LoRA deltas on the base model's projections (tp_worker): each row adds B_s (A_s x) for its
adapter slot s (lora_rows.py), in float32, to the projection's unrounded float32 output.

Every projection that adapters may touch holds a ProjectionLora: one entry per slot, the
adapter's A (transposed) and its B per output segment (a fused projection's q, k, v or gate,
up), the scaling folded into B. On the CPU, csrc/lora.cpp adds the deltas in an order fixed
per row (its rule is at the file's top); elsewhere torch multiplies each slot's rows in
blocks of a fixed shape (parallel.py's invariant_linear). Rows of no adapter get nothing
added: their bits are the base model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.tp_worker.cpu.ops import (
    LORA_EXPAND,
    LORA_SEGMENTS,
    LORA_SHRINK,
    LORA_SLACK,
    LORA_TABLE_WORDS,
    lora_cpu,
)
from tokenmill.tp_worker.model.lora_rows import LoraRows
from tokenmill.tp_worker.model.parallel import invariant_linear

# NOTE: a rank group's float32 sum in place (parallel.py's TpGroup.all_reduce)
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An adapter's A or B (float32, scaled) as the kernels read it: in `dtype` (the model's,
    as vLLM holds adapters: bfloat16 rounds each weight once), contiguous, with LORA_SLACK
    elements past its end (csrc/lora.cpp reads bfloat16 lanes whole)."""
    flat = torch.zeros(tensor.numel() + LORA_SLACK, dtype=dtype)
    flat[: tensor.numel()] = tensor.reshape(-1)
    return flat[: tensor.numel()].view(tensor.shape)


@dataclass(frozen=True)
class Segment:
    """Output columns [col, col + n) += B u[u_start : u_start + rank]."""

    b: torch.Tensor  # [rank, n] float32, B transposed, times the scaling
    col: int
    u_start: int


@dataclass(frozen=True)
class ProjectionDelta:
    """One adapter's share of one projection on this rank."""

    a: torch.Tensor  # [in_features, rank] float32: A transposed (a rank's share of its k)
    segments: tuple[Segment, ...]

    @property
    def rank(self) -> int:
        return self.a.shape[1]


class ProjectionLora:
    """The adapters' deltas of one projection, by slot. `shrink_reduce` (row-parallel
    layers at tensor parallel): each rank's u is its share of k, summed over the ranks
    before the expand."""

    def __init__(self, max_loras: int, shrink_reduce: bool = False, u_width: int = 0) -> None:
        """u_width: the widest u an adapter of this server may need here (3 x its largest
        rank: q, k and v side by side), for csrc/layer_stack.cpp's rows."""
        self.entries: list[ProjectionDelta | None] = [None] * max_loras
        self.u_width = u_width
        self.table = torch.zeros(max_loras, LORA_TABLE_WORDS, dtype=torch.int64)
        self.dtype = torch.float32  # NOTE: the adapters' A and B (lora_checkpoint.py's)
        self.shrink_reduce = shrink_reduce
        self.max_rank = 0

    def set(self, slot: int, delta: ProjectionDelta | None) -> None:
        assert delta is None or len(delta.segments) <= LORA_SEGMENTS, delta
        self.entries[slot] = delta
        if delta is not None:
            self.dtype = delta.a.dtype
        row = self.table[slot]
        row.zero_()
        if delta is not None:
            row[0], row[1] = delta.a.data_ptr(), delta.rank
            for i, seg in enumerate(delta.segments):
                words = (seg.b.data_ptr(), seg.col, seg.b.shape[1], seg.u_start, seg.b.shape[0])
                row[2 + 5 * i : 7 + 5 * i] = torch.tensor(words, dtype=torch.int64)
        self.max_rank = max((e.rank for e in self.entries if e is not None), default=0)

    def covers(self, rows: LoraRows) -> bool:
        return any(self.entries[s] is not None for s in rows.used)

    def add(self, x: torch.Tensor, y: torch.Tensor, rows: LoraRows, all_reduce: AllReduce) -> None:
        """y [M, N] (float32, unit stride) += each row's delta for x [M, K]."""
        if not self.max_rank or not self.covers(rows):
            return
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            self._add_cpu(x, y, rows, all_reduce)
        else:
            self._add_torch(x, y, rows, all_reduce)

    def _add_cpu(
        self, x: torch.Tensor, y: torch.Tensor, rows: LoraRows, all_reduce: AllReduce
    ) -> None:
        x = x if x.stride(1) == 1 else x.contiguous()
        u = torch.zeros(x.shape[0], self.max_rank, dtype=torch.float32)
        if not self.shrink_reduce:
            lora_cpu(x, rows.slots, self.table, u, y, weights=self.dtype)
            return
        lora_cpu(x, rows.slots, self.table, u, y, LORA_SHRINK, self.dtype)
        all_reduce(u)
        lora_cpu(x, rows.slots, self.table, u, y, LORA_EXPAND, self.dtype)

    def _add_torch(
        self, x: torch.Tensor, y: torch.Tensor, rows: LoraRows, all_reduce: AllReduce
    ) -> None:
        # NOTE: every rank runs the same slots in the same order: the all-reduces pair up
        for slot, index in rows.groups:
            delta = self.entries[slot]
            if delta is None:
                continue
            u = fixed_linear(x[index].float(), delta.a.float().t())
            if self.shrink_reduce:
                all_reduce(u)
            for seg in delta.segments:
                rank = seg.b.shape[0]
                d = fixed_linear(u[:, seg.u_start : seg.u_start + rank], seg.b.float().t())
                y[index, seg.col : seg.col + seg.b.shape[1]] += d


def fixed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x weight^T in blocks of a fixed number of rows (parallel.py's ROW_BLOCK rule)."""
    return invariant_linear(x, weight) if x.shape[0] else F.linear(x, weight)


@dataclass(frozen=True)
class EmbeddingDelta:
    """One adapter's embedding delta: the token's row of A^T, times B."""

    a: torch.Tensor  # [vocab, rank] float32: lora_embedding_A transposed
    b: torch.Tensor  # [rank, hidden] float32, times the scaling


class EmbeddingLora:
    """The adapters' embedding deltas, by slot (every rank holds them whole: the embedding
    is all-reduced before they add)."""

    def __init__(self, max_loras: int) -> None:
        self.entries: list[EmbeddingDelta | None] = [None] * max_loras
        self.expand = ProjectionLora(max_loras)

    def set(self, slot: int, delta: EmbeddingDelta | None) -> None:
        self.entries[slot] = delta
        if delta is None:
            self.expand.set(slot, None)
            return
        # NOTE: the expand alone reads the table: A's column is gathered, not multiplied
        self.expand.set(slot, ProjectionDelta(delta.a, (Segment(delta.b, 0, 0),)))

    def add(self, ids: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> None:
        """x [T, hidden] float32 += each adapter row's B A^T[id]."""
        if not self.expand.max_rank or not self.expand.covers(rows):
            return
        u = torch.zeros(x.shape[0], self.expand.max_rank, dtype=torch.float32, device=x.device)
        for slot, index in rows.groups:
            delta = self.entries[slot]
            if delta is not None:
                u[index, : delta.a.shape[1]] = delta.a[ids[index]].float()
        if x.device.type == "cpu":
            lora_cpu(x, rows.slots, self.expand.table, u, x, LORA_EXPAND, self.expand.dtype)
            return
        for slot, index in rows.groups:
            delta = self.entries[slot]
            if delta is not None:
                x[index] += fixed_linear(u[index, : delta.a.shape[1]], delta.b.float().t())
