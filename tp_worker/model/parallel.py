"""Tensor-parallel layers for the tp_worker processes.

Column-parallel layers shard output features, row-parallel layers shard input features and
all-reduce their partial sums; the vocabulary is sharded across ranks for the embedding and
the lm_head, whose logits are all-gathered so that every rank samples the same token.
With one rank every collective is a no-op, so the same model code runs in-process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tokenmill.tp_worker.cpu.ops import (
    PANEL,
    PackedLinear,
    cast_rows_cpu,
    fuses_gate_up,
    glu_mul_cpu,
)
from tokenmill.tp_worker.cpu.quantized import QuantLinear, QuantRows, blocks_enabled, dequantize
from tokenmill.tp_worker.cuda import linear as linear_triton
from tokenmill.tp_worker.cuda.linear import triton_linear
from tokenmill.tp_worker.model.lora_rows import LoraRows

if TYPE_CHECKING:
    from tokenmill.tp_worker.model.lora import ProjectionLora


@dataclass(frozen=True)
class TpGroup:
    rank: int = 0
    size: int = 1

    @staticmethod
    def current() -> TpGroup:
        if dist.is_available() and dist.is_initialized():
            return TpGroup(dist.get_rank(), dist.get_world_size())
        return TpGroup()

    def shard(self, total: int, name: str) -> tuple[int, int]:
        """The [start, end) of this rank's equal share of `total`."""
        if total % self.size:
            raise ValueError(f"{name}={total} is not divisible by tensor-parallel size {self.size}")
        per_rank = total // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        if self.size == 1:
            return value
        x = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return int(x.item())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


class ShardedLinear(nn.Module):
    """y = x W^T (+ b) with W holding this rank's rows (column-parallel) or columns
    (row-parallel). Row-parallel layers all-reduce, and add the bias once, after the sum (at
    one rank, the CPU kernel adds it in its epilogue: the same float32 adds).
    `glu` (an MLP's column-parallel gate_up, gate rows then up rows: its activation's name,
    config.py's ModelConfig.activation): y = act(gate) * up, in the CPU kernel's epilogue
    where it can; "": a plain product."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        row_parallel: bool,
        group: TpGroup,
        dtype: torch.dtype,
        device: torch.device,
        glu: str = "",
    ) -> None:
        super().__init__()
        assert not (glu and row_parallel), "a glu layer is column-parallel"
        self.row_parallel = row_parallel
        self.in_features, self.out_features = in_features, out_features
        self.glu = glu
        self.group = group
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.kernel: PackedLinear | QuantLinear | None = None
        self.triton = False  # cuda/linear.py, switched on by CausalLM.use_triton_kernels
        self.lora: ProjectionLora | None = None  # --enable-lora: the adapters' deltas (lora.py)
        # NOTE: a GGUF file's blocks by their first row (model/blocks.py), until packed or
        # dequantized into the weight
        self.blocks: dict[int, QuantRows] = {}

    def take_blocks(self, first_row: int, rows: QuantRows) -> bool:
        """This rank's rows [first_row, + rows) of the weight as GGUF blocks."""
        if rows.width != self.in_features or first_row + rows.rows > self.out_features:
            raise ValueError(
                f"blocks of [{rows.rows}, {rows.width}] do not fit at row {first_row} of "
                f"[{self.out_features}, {self.in_features}]"
            )
        self.blocks[first_row] = rows
        return True

    def block_segments(self, first_row: int = 0) -> list[QuantRows] | None:
        """The blocks from `first_row` on, in row order, where they are every row from there
        and each segment but the last is whole panels (QuantLinear's rule); else None."""
        if not blocks_enabled():
            return None
        segments: list[QuantRows] = []
        at = first_row
        for start in sorted(row for row in self.blocks if row >= first_row):
            if start != at or (segments and segments[-1].rows % PANEL):
                return None
            segments.append(self.blocks[start])
            at += self.blocks[start].rows
        return segments if segments and at == self.out_features else None

    def use_cpu_kernel(self) -> None:
        """Multiply through csrc/linear.cpp from now on; the unpacked weight is freed. GGUF
        blocks are multiplied as they are (cpu/quantized.py) where they can be, else
        dequantized first."""
        fused = bool(self.glu) and fuses_gate_up(self.weight.shape[0])
        bias = None if self.row_parallel and self.group.size > 1 else self.bias
        segments = self.block_segments()
        if fused and segments and len({s.qtype for s in segments}) > 1:
            segments = None  # NOTE: gate and up of two types: no panel holds both
        if segments:
            self.kernel = QuantLinear(
                segments, self.weight.dtype, bias, glu=fused, activation=self.glu or "silu"
            )
            self.blocks = {}
        else:
            self.dequantize_blocks()
            self.kernel = PackedLinear(
                self.weight.data, bias, glu=fused, activation=self.glu or "silu"
            )
        self.weight.data = self.weight.data.new_empty(0)

    def dequantize_blocks(self) -> None:
        """The GGUF blocks taken, as the float weight (for any path but QuantLinear)."""
        for first, rows in self.blocks.items():
            self.weight.data[first : first + rows.rows].copy_(dequantize(rows))
        self.blocks = {}

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """x W^T (+ b), plus `residual` where given (the float32 residual stream: the sum is
        float32; with the CPU kernel y is added unrounded, in its epilogue or after the
        float32 all-reduce; torch's products round y to the model's dtype first). With
        `lora`, each adapter row's delta too (_with_lora)."""
        if lora is not None and self.lora is not None and self.lora.covers(lora):
            return self._with_lora(x, residual, lora)
        if self.glu:
            assert residual is None, "a glu layer takes no residual"
            return self._gated(x)
        out_dtype = None if residual is None else residual.dtype
        whole = not self.row_parallel or self.group.size == 1
        if self.kernel is not None and residual is not None and whole:
            return self.kernel(x, out_dtype, residual=residual)
        if self.triton and linear_triton.FUSED_EPILOGUES and residual is not None and whole:
            return triton_linear(x, self.weight, self.bias, residual=residual)
        if not self.row_parallel:
            out = self._matmul(x, self.bias, out_dtype)
        elif self.kernel is not None and self.group.size == 1:
            out = self._matmul(x, None, out_dtype)  # NOTE: the kernel holds the bias
        else:
            out = self.group.all_reduce(self._matmul(x, None, out_dtype))
            out = out if self.bias is None else out + self.bias
        return out if residual is None else residual + out

    def _with_lora(
        self, x: torch.Tensor, residual: torch.Tensor | None, lora: LoraRows
    ) -> torch.Tensor:
        """The product's float32 output that the paths above start from, each adapter row's
        delta added there, then the same rounding, activation or residual add: a row of no
        adapter gets forward's bits (on the CPU; csrc/ adds and rounds as torch does)."""
        assert self.lora is not None
        y = self._float_out(x, residual is not None)
        self.lora.add(x, y, lora, self.group.all_reduce)
        cpu = self.kernel is not None
        if self.glu:
            return glu_mul_cpu(y, x.dtype, self.glu) if cpu else self._act_mul(y, x.dtype)
        if residual is not None:
            return residual + y
        return cast_rows_cpu(y, x.dtype) if cpu else y.to(x.dtype)

    def _float_out(self, x: torch.Tensor, to_residual: bool) -> torch.Tensor:
        """x W^T + b [M, N] in float32 (contiguous) as forward computes it before rounding:
        the kernel's sums; torch's product (rounded by torch); at tensor parallel, the sum
        over the ranks (in float32 where it adds to the residual, else in the model's dtype,
        as forward sums it)."""
        whole = not self.row_parallel or self.group.size == 1
        if self.kernel is not None and whole:
            return self.kernel.float_sums(x)
        if whole:
            return self._matmul(x, self.bias).float().contiguous()
        out = self.group.all_reduce(self._matmul(x, None, torch.float32 if to_residual else None))
        out = out if self.bias is None else out + self.bias
        return out.float().contiguous()

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, computed in float32 and rounded once: in the kernel's epilogue, else
        after the product (the same bits on the CPU: from the float32 sums)."""
        if self.kernel is not None and self.kernel.glu:
            return self.kernel(x)
        if self.kernel is not None:
            return glu_mul_cpu(self.kernel(x, torch.float32), x.dtype, self.glu)
        if self.triton and linear_triton.FUSED_EPILOGUES:  # NOTE: from the float32 sums too
            return triton_linear(x, self.weight, self.bias, glu=self.glu)
        # NOTE: in float32 and rounded once, as the CPU kernels do (gate and up themselves
        # come rounded from torch's product).
        return self._act_mul(self._matmul(x, self.bias).float(), x.dtype)

    def _act_mul(self, gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """act(gate) * up of float32 gate_up [M, 2 inter] in torch, rounded once to dtype."""
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.glu == "gelu_tanh" else F.silu(gate)
        return (act * up).to(dtype)

    def _matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x W^T (+ bias) in out_dtype (default x's)."""
        if self.kernel is not None:
            # NOTE: packed with the bias of a column-parallel layer
            return self.kernel(x, out_dtype)
        if self.triton:
            return triton_linear(x, self.weight, bias, out_dtype)
        out = invariant_linear(x, self.weight, bias)
        return out if out_dtype is None else out.to(out_dtype)


# NOTE: where csrc/linear.cpp does not run (CUDA, float16), BLAS picks its kernel (and so its
# summation order) by the number of rows M: the same row multiplied alone, in a batch of 8,
# or in a prefill chunk of 300 rounds differently. Multiplying in blocks of exactly ROW_BLOCK
# rows (the last one zero-padded) keeps each row's result independent of what it is batched
# with, as far as the library computes a fixed shape the same way each time.
ROW_BLOCK = 32


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear over x [M, in] whose rows do not depend on M (see ROW_BLOCK)."""
    rows = x.shape[0]
    padded = -(-rows // ROW_BLOCK) * ROW_BLOCK
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    out = torch.cat([F.linear(block, weight, bias) for block in x.split(ROW_BLOCK)])
    return out[:rows]


class VocabEmbedding(nn.Module):
    """Embedding rows [vocab_start, vocab_end) live on this rank; others contribute zeros."""

    def __init__(
        self, vocab_size: int, hidden: int, group: TpGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.group = group
        self.vocab_start, self.vocab_end = group.shard(_padded(vocab_size, group.size), "vocab")
        self.weight = nn.Parameter(
            torch.zeros(self.vocab_end - self.vocab_start, hidden, dtype=dtype, device=device),
            requires_grad=False,
        )

        self.blocks: QuantRows | None = None  # NOTE: a GGUF file's, until packed or dequantized
        # NOTE: the rows as QuantLinear panels (use_blocks): the lookup's and the lm_head's
        self.quant: QuantLinear | None = None

    def take_blocks(self, rows: QuantRows) -> bool:
        """The whole vocabulary's embeddings as GGUF blocks (this rank keeps its rows)."""
        local = rows.select(slice(self.vocab_start, self.vocab_end))
        if local.width != self.weight.shape[1] or local.rows > self.weight.shape[0]:
            raise ValueError(f"embedding blocks [{rows.rows}, {rows.width}] do not fit")
        self.blocks = local
        return True

    def use_blocks(self) -> bool:
        """The rows from their blocks from now on (the weight freed), where it has blocks."""
        if self.blocks is None or not blocks_enabled():
            return False
        rows, padding = self.blocks, self.weight.shape[0] - self.blocks.rows
        if padding:  # NOTE: the vocabulary padded for the ranks: zero blocks give zero rows
            zeros = rows.blocks.new_zeros(padding, rows.blocks.shape[1])
            rows = QuantRows(rows.qtype, torch.cat([rows.blocks, zeros]), rows.width)
        self.quant = QuantLinear([rows], self.weight.dtype)
        self.blocks = None
        self.weight.data = self.weight.data.new_empty(0)
        return True

    def dequantize_blocks(self) -> None:
        if self.blocks is not None:
            self.weight.data[: self.blocks.rows].copy_(dequantize(self.blocks))
            self.blocks = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self._rows(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        out = self._rows(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.embedding(ids, self.weight)
        rows = self.quant.rows(ids).to(self.weight.dtype)
        return rows.view(*ids.shape, rows.shape[-1])


def _padded(vocab_size: int, tp_size: int) -> int:
    """Vocab rounded up so that every rank holds the same number of rows."""
    return -(-vocab_size // tp_size) * tp_size
