"""GGUF's quantized weights kept in their blocks (tp_worker): a file's rows of blocks repacked
into the panels csrc/dequant.h reads, and QuantLinear, which multiplies by them
(csrc/linear.cpp's tm_quant_linear_then): in float32 with the bits of PackedLinear over the
weight the `gguf` package dequantizes (csrc/quant_exact.h), in bfloat16 by the factored sums
A (x . q) - B (sum of x) on those weights unrounded (csrc/quant_kernels.h).

The served types, by ggml's codes: Q8_0, Q4_0, Q4_K, Q5_K and Q6_K (what Q4_K_M, Q5_K_M,
Q6_K and Q8_0 files hold). A panel is 32 rows; per block of S weights a row it keeps the
block's float16 scales, its small integer group scales and the q values in lanes (dequant.h's
layout): 4.5 to 8.5 bits a weight, about what the file holds (Q4_K 4.625 and Q5_K 5.625:
their 6-bit group scales take a byte each; Q6_K 8.5: its q in whole bytes, for speed).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.tp_worker.cpu import huge_pages
from tokenmill.tp_worker.cpu.kernels import library
from tokenmill.tp_worker.cpu.ops import PANEL, PanelProduct, fuses_gate_up, gate_up_panels

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
TYPE_NAMES = {
    Q4_0: "Q4_0",
    Q4_1: "Q4_1",
    Q5_0: "Q5_0",
    Q5_1: "Q5_1",
    Q8_0: "Q8_0",
    Q4_K: "Q4_K",
    Q5_K: "Q5_K",
    Q6_K: "Q6_K",
}


@dataclass(frozen=True)
class Layout:
    """dequant.h's QuantLayout: S and G, the parts a block holds, q's offset and bit planes;
    `file_bytes`: a block of one row in the GGUF file."""

    block_k: int
    group_k: int
    scales: bool
    mins: bool
    whole_bytes: bool
    offset: int
    planes: int
    file_bytes: int

    def width(self, row_bytes: int) -> int:
        """Weights in a file's row of `row_bytes` bytes of blocks."""
        return row_bytes // self.file_bytes * self.block_k

    def panel_block_bytes(self) -> int:
        groups = self.block_k // self.group_k
        sc = (32 * groups * (2 if self.mins else 1)) if self.scales else 0  # NOTE: sc and m
        q = self.block_k * (32 if self.whole_bytes else 16)
        return 64 * (2 if self.mins else 1) + sc + q + self.block_k * self.planes * 4


LAYOUTS = {
    Q8_0: Layout(32, 32, False, False, True, 128, 0, 34),
    Q4_0: Layout(32, 32, False, False, False, 8, 0, 18),
    Q4_1: Layout(32, 32, False, True, False, 0, 0, 20),
    Q5_0: Layout(32, 32, False, False, False, 16, 1, 22),
    Q5_1: Layout(32, 32, False, True, False, 0, 1, 24),
    Q4_K: Layout(256, 32, True, True, False, 0, 0, 144),
    Q5_K: Layout(256, 32, True, True, False, 0, 1, 176),
    Q6_K: Layout(256, 16, True, False, True, 32, 0, 210),  # NOTE: q in bytes (dequant.h)
}


@dataclass
class QuantRows:
    """A quantized tensor's rows as the file holds them: `blocks` [rows, bytes a row] uint8,
    ggml type `qtype`, `width` weights a row."""

    qtype: int
    blocks: torch.Tensor
    width: int

    @staticmethod
    def of(qtype: int, blocks: torch.Tensor) -> QuantRows:
        """A file's rows of blocks [rows, bytes a row], their width derived from the type."""
        return QuantRows(qtype, blocks, LAYOUTS[qtype].width(blocks.shape[1]))

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    def select(self, rows: slice | torch.Tensor) -> QuantRows:
        return QuantRows(self.qtype, self.blocks[rows], self.width)

    def columns(self, start: int, end: int) -> QuantRows:
        """Weights [start, end) of every row (a row-parallel rank's share): whole blocks."""
        layout = LAYOUTS[self.qtype]
        if start % layout.block_k or end % layout.block_k:
            raise ValueError(
                f"a {TYPE_NAMES[self.qtype]} row splits at multiples of {layout.block_k}, "
                f"not at {start}:{end}"
            )
        first, last = start // layout.block_k, end // layout.block_k
        cut = self.blocks[:, first * layout.file_bytes : last * layout.file_bytes]
        return QuantRows(self.qtype, cut, end - start)


def blocks_enabled() -> bool:
    """TOKENMILL_CPU_GGUF_BLOCKS=0 dequantizes a file's blocks to the serving dtype at load
    instead (the packed float kernels, for an A/B: benchmarks/serving/quantized.py --dense)."""
    return os.environ.get("TOKENMILL_CPU_GGUF_BLOCKS", "1") != "0"


def _parts(qtype: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """One row-block per row of `blocks` [B, file_bytes] -> d (and dmin) float16 bits [B, 1 or 2],
    group scales (and mins) int8 [B, groups (x2)] or None, q [B, S] uint8 with the offset
    added: the `gguf` package's unpacking, stopped before its arithmetic."""
    n = blocks.shape[0]
    if qtype == Q8_0:
        d, qs = blocks[:, :2], blocks[:, 2:]
        return d.view(np.uint16), None, (qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    if qtype in (Q4_0, Q4_1, Q5_0, Q5_1):
        first = 4 if qtype in (Q4_1, Q5_1) else 2  # NOTE: d, then m where the type has one
        high = 4 if qtype in (Q5_0, Q5_1) else 0
        d = blocks[:, :first].copy().view(np.uint16)
        d[:, 1:] ^= 0x8000  # NOTE: dmin = -m (dequant.h: B = dmin), exact in float16
        qs = blocks[:, first + high :]
        q = (qs.reshape(n, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 15
        q = q.reshape(n, 32)
        if high:
            qh = blocks[:, first : first + 4].copy().view(np.uint32)
            q = q | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
        return d, None, q
    if qtype == Q6_K:
        ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], blocks[:, 208:]
        low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
        top = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = low.reshape(n, -1, 32) | (top.reshape(n, -1, 32) << 4)
        return d.view(np.uint16), sc.view(np.int8), q.reshape(n, 256)
    from gguf.quants import Q4_K as GgufQ4K  # NOTE: its 6-bit scale unpacking

    d, packed_scales = blocks[:, :4], blocks[:, 4:16]
    sc, m = GgufQ4K.get_scale_min(packed_scales)
    qs = blocks[:, 16 + (32 if qtype == Q5_K else 0) :]
    q = (qs.reshape(n, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    q = q.reshape(n, -1, 32)
    if qtype == Q5_K:
        qh = blocks[:, 16:48]
        bits = (qh.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        q = q | (bits.reshape(n, -1, 32) << 4)
    groups = np.concatenate([sc, m], axis=1).astype(np.int8)
    return d.view(np.uint16), groups, q.reshape(n, 256)


def pack_panels(rows: QuantRows, pairs: bool) -> torch.Tensor:
    """rows -> [panels, bytes a panel] uint8 in dequant.h's layout, its values in the order of
    bfloat16's panels where `pairs`, else of float32's (rows zero-padded to whole panels: d = 0
    gives weights of 0), on 2 MiB pages where the system has them."""
    layout = LAYOUTS[rows.qtype]
    n, width = rows.rows, rows.width
    blocks_a_row = width // layout.block_k
    panels = -(-n // PANEL)
    raw = np.zeros((panels * PANEL, blocks_a_row * layout.file_bytes), np.uint8)
    raw[:n] = rows.blocks.numpy()
    d, groups, q = _parts(rows.qtype, raw.reshape(-1, layout.file_bytes))

    def lanes(a: np.ndarray) -> np.ndarray:
        """[panels * 32 * blocks, *rest] -> [panels, blocks, *rest, 32] (lanes last)."""
        a = a.reshape(panels, PANEL, blocks_a_row, *a.shape[1:])
        return np.moveaxis(a, 1, -1)

    parts: list[np.ndarray] = [np.ascontiguousarray(lanes(d)).view(np.uint8)]
    if groups is not None:
        parts.append(np.ascontiguousarray(lanes(groups)).view(np.uint8))
    q_lanes = lanes(q)  # [P, B, S, 32]: unit k holds k's lanes in order
    if pairs:
        # NOTE: units k, k + 1 (k even): lanes 16h + 8g + t of (k, k + 1) at unit k + h, value
        # 16g + 2t + (0 for k, 1 for k + 1)
        split = q_lanes.reshape(panels, blocks_a_row, -1, 2, 2, 2, 8)  # [.., k%2, h, g, t]
        q_lanes = split.transpose(0, 1, 2, 4, 5, 6, 3).reshape(q_lanes.shape)
    if layout.whole_bytes:
        parts.append(np.ascontiguousarray(q_lanes))
    else:
        parts.append((q_lanes[..., :16] & 15) | ((q_lanes[..., 16:] & 15) << 4))
        for plane in range(layout.planes):
            bit = (q_lanes >> (4 + plane)) & 1
            parts.append(np.packbits(bit, axis=-1, bitorder="little")[..., None, :])
    if layout.planes:
        # NOTE: a k's planes side by side ([S][planes][4] bytes)
        planes = np.concatenate(parts[-layout.planes :], axis=-2)
        parts = [*parts[: -layout.planes], planes]
    flat = [p.reshape(panels, blocks_a_row, -1) for p in parts]
    packed = np.concatenate(flat, axis=-1).reshape(panels, -1)
    assert packed.shape[1] == blocks_a_row * layout.panel_block_bytes(), packed.shape
    out = huge_pages.empty(tuple(packed.shape), torch.uint8)
    out.copy_(torch.from_numpy(packed))
    return out


def dequantize(rows: QuantRows) -> torch.Tensor:
    """The float32 weights the `gguf` package gives for rows [rows, width]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(rows.blocks.numpy(), GGMLQuantizationType(rows.qtype))
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(rows.rows, rows.width)


class QuantLinear(PanelProduct):
    """PackedLinear's product with weights in GGUF blocks: y = x W^T (+ b) for x [M, K] in
    `dtype` (float32 or bfloat16), W the rows of `segments` one after the other (each but the
    last a whole number of panels; a glu layer's gate rows then up rows, of one type), with
    float32: the bits of PackedLinear(W dequantized); bfloat16: W's unrounded values summed
    in one order per K (the module docstring), `packed` the panels' table (type, address).
    NOTE: never on AMX tiles, whose rounding differs: a quantized layer has the AVX-512
    kernels' bits on every CPU."""

    amx = False

    def __init__(
        self,
        segments: list[QuantRows],
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        glu: bool = False,
        activation: str = "silu",
    ) -> None:
        widths = {s.width for s in segments}
        assert len(widths) == 1, widths
        self.in_features = widths.pop()
        self.out_features = sum(s.rows for s in segments)
        self.dtype, self.glu, self.activation = dtype, glu, activation
        if glu:
            assert len({s.qtype for s in segments}) == 1 and fuses_gate_up(self.out_features)
            whole = torch.cat([s.blocks for s in segments])
            segments = [QuantRows(segments[0].qtype, gate_up_panels(whole), self.in_features)]
            bias = None if bias is None else gate_up_panels(bias)
        for s in segments[:-1]:
            assert s.rows % PANEL == 0, "a segment ends inside a panel"
        self.panels = [pack_panels(s, pairs=dtype == torch.bfloat16) for s in segments]
        self.qtypes = [s.qtype for s in segments]
        addresses = [
            (qtype, base + p * part.shape[1])
            for qtype, part in zip(self.qtypes, self.panels, strict=True)
            for base in (part.data_ptr(),)
            for p in range(part.shape[0])
        ]
        # NOTE: `packed`: what layer_stack.py's tables and csrc/ take, the panels' table
        self.packed = torch.tensor(addresses, dtype=torch.int64)
        self.bias = None if bias is None else bias.float().contiguous()

    def nbytes(self) -> int:
        return sum(p.numel() for p in self.panels)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W's rows `ids` in float32 (an embedding's lookup; not a glu layer's)."""
        ids = ids.to(torch.int64).contiguous().view(-1)
        out = torch.empty(ids.numel(), self.in_features, dtype=torch.float32)
        status = library().tm_quant_rows(
            self.packed.data_ptr(),
            ids.data_ptr(),
            ids.numel(),
            self.in_features,
            int(self.dtype == torch.bfloat16),
            out.data_ptr(),
        )
        assert status == 0, "tm_quant_rows: a type not served in blocks"
        return out

    def c_function(self) -> Callable[..., int]:
        quant = library().tm_quant_linear_then
        return lambda *args: quant(*args, None, 0, 0)  # NOTE: no next product named


def summary(kernels: list[QuantLinear]) -> str:
    """What a start logs of the products it multiplies in blocks: their count, the panels'
    types and their memory."""
    counts: dict[str, int] = {}
    for kernel in kernels:
        for qtype in set(kernel.qtypes):
            counts[TYPE_NAMES[qtype]] = counts.get(TYPE_NAMES[qtype], 0) + 1
    types = ", ".join(f"{name} {count}" for name, count in sorted(counts.items()))
    size = sum(k.nbytes() for k in kernels) / 2**30
    return f"{len(kernels)} products in GGUF blocks ({types}; {size:.2f} GiB)"
