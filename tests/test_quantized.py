"""GGUF's quantized weights multiplied in their blocks (cpu/quantized.py, csrc/dequant.h,
csrc/quant_kernels.h): for every served type, in float32 and bfloat16, the product has every
bit of the packed product of the weight the `gguf` package dequantizes (rounded to the dtype),
at one row (the fused microkernels) and at many (a panel dequantized into a buffer), with a
bias, a residual and the gate/up epilogue; an embedding's rows are gguf's values; and the
build without any AVX gives the same bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.tp_worker.cpu import kernels as cpu_kernels
from tokenmill.tp_worker.cpu import quantized
from tokenmill.tp_worker.cpu.ops import PackedLinear
from tokenmill.tp_worker.cpu.quantized import (
    LAYOUTS,
    TYPE_NAMES,
    QuantLinear,
    QuantRows,
    dequantize,
)

TYPES = sorted(LAYOUTS)
DTYPES = (torch.float32, torch.bfloat16)


def random_rows(qtype: int, rows: int, width: int, seed: int = 0) -> QuantRows:
    """Blocks of random bytes with float16 scales of a usual size (random scale bytes could
    be infinities): every bit pattern of q, sc and m occurs."""
    rng = np.random.default_rng(seed * 100 + qtype)
    layout = LAYOUTS[qtype]
    blocks = width // layout.block_k
    raw = rng.integers(0, 256, size=(rows, blocks, layout.file_bytes), dtype=np.uint8)

    def halves(scale: float) -> np.ndarray:
        values = rng.uniform(0.5, 2.0, size=(rows, blocks)) * scale
        return values.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)

    at = layout.file_bytes - 2 if qtype == quantized.Q6_K else 0  # NOTE: Q6_K's d comes last
    raw[..., at : at + 2] = halves(2.0**-8)
    if layout.mins:
        raw[..., 2:4] = halves(2.0**-9)
    return QuantRows(qtype, torch.from_numpy(raw.reshape(rows, -1)), width)


@pytest.mark.parametrize("qtype", TYPES, ids=[TYPE_NAMES[t] for t in TYPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_the_product_is_the_packed_product_of_ggufs_dequantized_weight(
    qtype: int, dtype: torch.dtype
) -> None:
    rows = random_rows(qtype, 80, 512)  # NOTE: 2.5 panels: a padded last panel
    weight = dequantize(rows)
    bias = torch.randn(80)
    quant = QuantLinear([rows], dtype, bias=bias)
    packed = PackedLinear(weight.to(dtype), bias)
    torch.manual_seed(qtype)
    for m in (1, 2, 3, 4, 5, 13, 40):
        x = torch.randn(m, 512).to(dtype)
        assert torch.equal(quant(x), packed(x)), m
        residual = torch.randn(m, 80)
        assert torch.equal(
            quant(x, torch.float32, residual=residual),
            packed(x, torch.float32, residual=residual),
        ), m
        assert torch.equal(quant.float_sums(x), packed.float_sums(x)), m
    ids = torch.tensor([0, 7, 31, 32, 79])
    assert torch.equal(quant.rows(ids), weight[ids])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_the_gate_up_epilogue_and_segments_of_two_types(dtype: torch.dtype) -> None:
    gate = random_rows(quantized.Q4_K, 64, 256, seed=1)
    up = random_rows(quantized.Q4_K, 64, 256, seed=2)
    weight = torch.cat([dequantize(gate), dequantize(up)]).to(dtype)
    glu = QuantLinear([gate, up], dtype, glu=True, activation="silu")
    packed = PackedLinear(weight, None, glu=True, activation="silu")
    # NOTE: q/k/v of a Q4_K_M file: two types in one product
    v = random_rows(quantized.Q6_K, 32, 256, seed=3)
    mixed = QuantLinear([gate, v], dtype)
    mixed_packed = PackedLinear(torch.cat([dequantize(gate), dequantize(v)]).to(dtype), None)
    for m in (1, 4, 9):
        x = torch.randn(m, 256).to(dtype)
        assert torch.equal(glu(x), packed(x)), m
        assert torch.equal(glu.float_sums(x), packed.float_sums(x)), m
        assert torch.equal(mixed(x), mixed_packed(x)), m


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_the_portable_build_gives_the_same_bits(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    products = {t: QuantLinear([random_rows(t, 32, 256)], dtype) for t in TYPES}
    xs = [torch.randn(m, 256).to(dtype) for m in (1, 3, 7)]
    native = {t: [q(x) for x in xs] for t, q in products.items()}
    ids = torch.tensor([0, 17, 31])
    rows = {t: q.rows(ids) for t, q in products.items()}
    portable = cpu_kernels.load(cpu_kernels.build("x86-64-v2"))
    monkeypatch.setattr(quantized, "library", lambda: portable)
    for t, q in products.items():
        for x, expected in zip(xs, native[t], strict=True):
            assert torch.equal(q(x), expected), (TYPE_NAMES[t], x.shape)
        assert torch.equal(q.rows(ids), rows[t]), TYPE_NAMES[t]


def test_a_row_split_off_its_blocks_is_refused() -> None:
    rows = random_rows(quantized.Q4_K, 32, 512)
    assert rows.columns(256, 512).width == 256
    with pytest.raises(ValueError, match="multiples of 256"):
        rows.columns(128, 512)
