"""Linear layers and the lm_head in Triton, for CUDA (tp_worker): y = x W^T (+ b) with one
tile shape and one K order per weight whatever the number of rows, and no split-K, so that a
row's output is the same bits alone or in any batch. (cuBLAS picks its kernel, and with it
the summation order, by the shape: the same row rounds differently in a batch of 1 and of 64.)

Each program computes a BLOCK_M x BLOCK_N tile of y, stepping through K in BLOCK_K slices in
order and accumulating in float32 (`tl.dot`, on the tensor cores; float32 inputs in IEEE
precision, never TF32); the rows of a tile never meet in a sum, and the tile shape depends on
the weight's shape alone (`tile_config`). The output is rounded once to its dtype: the
lm_head's float32 logits come straight from the accumulators.

Tested on the CPU under TRITON_INTERPRET=1 against float64 products and alone against in a
batch (tests/test_linear_triton.py, slow); timed against cuBLAS on a lent GPU by
benchmarks/gpu_linear.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # NOTE: CPU installs need no Triton; only CUDA workers and tests use it
    triton = None


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def tile_config(out_features: int, in_features: int, dtype: torch.dtype) -> TileConfig:
    """A weight's tiles, from its shape and dtype alone (never from the number of rows).
    NOTE: measured on an H200 (benchmarks/gpu_linear.py, an 8B Llama's five weights in
    bfloat16), 64 x 128 tiles with K slices of 64 beat 64 x 64, 128 x 64 and 128 x 128 at 1,
    16 and 64 rows (e.g. gate_up 2.0 against 1.9 TB/s), and reach 0.55-0.6 of cuBLAS at 4,096
    rows (128 x 128 reached 0.74 there, but reads the weights 10-25% slower at decode sizes);
    float32 takes half the K slice for the same shared memory."""
    del out_features, in_features
    return TileConfig(64, 128, 32 if dtype == torch.float32 else 64)


def available() -> bool:
    return triton is not None


def triton_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in out_dtype (default x's)."""
    assert triton is not None, "Triton is not installed"
    rows, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or tile_config(n, k, weight.dtype)
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _linear_kernel[grid](
        x,
        weight,
        weight if bias is None else bias,
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        OUT_FP32=out.dtype == torch.float32,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        IEEE: tl.constexpr,
        OUT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # NOTE: M is not specialised on (a row count of 1 or a multiple of 16 would compile
        # another kernel); the tile shape and the K loop are the same for every M.
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :],
                mask=(rm[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_ptr + rn[None, :] * stride_wn + kk[:, None],
                mask=(rn[None, :] < N) & (kk[:, None] < K),
                other=0.0,
            )
            if IEEE:  # noqa: SIM108 (a branch on a constexpr, resolved at compile time)
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        inside = (rm[:, None] < M) & (rn[None, :] < N)
        if OUT_FP32:
            tl.store(out, acc, mask=inside)
        else:  # NOTE: rounded to nearest even, as torch rounds (the interpreter's default cuts)
            tl.store(out, acc.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)
