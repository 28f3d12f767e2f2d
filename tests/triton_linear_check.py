"""Run by tests/test_linear_triton.py in a subprocess with TRITON_INTERPRET=1 (set before
Triton is imported): the Triton linear kernel against float64 products (float32 output, the
lm_head's, straight from the accumulators), and each row alone against the same row in
batches of every size and at other places in them, bit for bit."""

from __future__ import annotations

import torch
from triton_interpreter import rowwise_interpreted_dot

from tokenmill.tp_worker.linear_triton import TileConfig, tile_config, triton_linear

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
        # mantissa carry can miss the exponent); benchmarks/gpu_linear.py checks the GPU's
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


def main() -> int:
    rowwise_interpreted_dot()
    assert tile_config(4096, 4096, torch.bfloat16) == tile_config(8, 8, torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        for config in (SMALL, None):
            check_against_float64(dtype, config)
            check_rows_alone_and_in_batches(dtype, config)
        print(f"{dtype}: float64 agreement and row invariance ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
