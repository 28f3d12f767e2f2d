"""Run by tests/test_linear_triton.py in a subprocess with TRITON_INTERPRET=1 (set before
Triton is imported): the Triton linear kernel against float64 products (float32 output, the
lm_head's, straight from the accumulators), and each row alone against the same row in
batches of every size and at other places in them, bit for bit."""

from __future__ import annotations

import torch
from triton_interpreter import rowwise_interpreted_dot

from tokenmill.tp_worker.cuda.linear import TileConfig, k_slice, tile_config, triton_linear

# NOTE: small tiles so that the interpreter's pass is quick and shapes cross tile edges
SMALL = TileConfig(16, 16, 16)


def check_against_float64(dtype: torch.dtype, config: TileConfig | None) -> None:
    g = torch.Generator().manual_seed(0)
    for rows, n, k in ((1, 40, 72), (37, 24, 50), (5, 64, 128)):
        x = torch.randn(rows, k, generator=g).to(dtype)
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        exact = x.double() @ w.double().T + b.double()
        out = triton_linear(x, w, b, torch.float32, config)
        # NOTE: float32 sums of k products of exact inputs: error ~ k * 2^-24 * |terms|
        scale = (x.double().abs() @ w.double().abs().T).max().item()
        assert (out.double() - exact).abs().max().item() <= 1e-6 * scale, (dtype, rows, n, k)
        rounded = triton_linear(x, w, b, None, config)
        assert rounded.dtype == dtype
        # NOTE: the interpreter rounds float32 to bfloat16 its own way (half up, and a
        # mantissa carry can miss the exponent); benchmarks/gpu/gpu_accept.py checks the GPU's
        if dtype == torch.float32:
            assert torch.equal(rounded, out)


def check_rows_alone_and_in_batches(dtype: torch.dtype, config: TileConfig | None) -> None:
    g = torch.Generator().manual_seed(1)
    n, k = 48, 96
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(70, k, generator=g).to(dtype)
    whole = triton_linear(x, w, None, torch.float32, config)
    for rows in (1, 2, 15, 16, 17, 33, 70):
        part = triton_linear(x[:rows], w, None, torch.float32, config)
        assert torch.equal(part, whole[:rows]), (dtype, rows)
    # NOTE: a row at another place in another batch
    moved = torch.cat([x[40:45], x[:3]])
    assert torch.equal(triton_linear(moved, w, None, torch.float32, config)[5:], whole[:3])


def check_epilogues(dtype: torch.dtype) -> None:
    """The residual added to the float32 sums, and an MLP's silu(gate) * up before one
    rounding, against float64; a row alone = in its batch = under other tile shapes."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(21, 80, generator=g).to(dtype)
    w = torch.randn(2 * 24, 80, generator=g).to(dtype)
    residual = torch.randn(21, 24, generator=g)
    summed = triton_linear(x, w[:24], None, residual=residual)
    exact = x.double() @ w[:24].double().T + residual.double()
    assert summed.dtype == torch.float32
    assert (summed.double() - exact).abs().max().item() < 1e-4, dtype
    assert torch.equal(summed, triton_linear(x, w[:24], None, torch.float32) + residual)
    gated = triton_linear(x, w, None, torch.float32, glu="silu")
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    assert (gated.double() - exact).abs().max().item() < 1e-4 * exact.abs().max().item()
    slice_ = k_slice(dtype)  # NOTE: the weight's K order; the tile's shape is free
    for rows in (1, 5, 21):
        for config in (TileConfig(16, 16, slice_), TileConfig(32, 64, slice_), None):
            assert torch.equal(
                triton_linear(x[:rows], w, None, torch.float32, config, glu="silu"), gated[:rows]
            ), (dtype, rows, config)
            assert torch.equal(
                triton_linear(x[:rows], w[:24], None, None, config, residual[:rows]),
                summed[:rows],
            ), (dtype, rows, config)


def check_tile_shapes() -> None:
    """The K slice is the weight's; the tile's shape follows the rows (free)."""
    for rows in (1, 16, 17, 511, 512, 4096):
        configs = {tile_config(n, 4096, torch.bfloat16, rows).block_k for n in (8, 4096, 28672)}
        assert configs == {64}, rows
    assert tile_config(4096, 4096, torch.bfloat16, 1).block_m == 16
    assert tile_config(4096, 4096, torch.bfloat16, 1).block_n == 32  # NOTE: 128 tiles of 132
    assert tile_config(28672, 4096, torch.bfloat16, 1).block_n == 128
    assert tile_config(4096, 4096, torch.bfloat16, 4096).block_m == 128


def main() -> int:
    rowwise_interpreted_dot()
    check_tile_shapes()
    for dtype in (torch.float32, torch.bfloat16):
        for config in (SMALL, TileConfig(32, 16, 16), None):
            check_against_float64(dtype, config)
            check_rows_alone_and_in_batches(dtype, config)
        check_epilogues(dtype)
        print(f"{dtype}: float64 agreement and row invariance ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
