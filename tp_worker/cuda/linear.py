"""Linear layers and the lm_head in Triton, for CUDA (tp_worker): y = x W^T (+ b) (+ a
residual), or an MLP's silu(x G^T) * (x U^T), with one K order per weight whatever the number
of rows, and no split-K, so that a row's output is the same bits alone or in any batch.
(cuBLAS picks its kernel, and with it the summation order, by the shape: the same row rounds
differently in a batch of 1 and of 64.)

Each program computes a BLOCK_M x BLOCK_N tile of y, stepping through K in BLOCK_K slices in
order and accumulating in float32 (`tl.dot`, on the tensor cores; float32 inputs in IEEE
precision, never TF32); the rows of a tile never meet in a sum. What is fixed per weight: the
K slice (`k_slice`, from the dtype alone). What is free, chosen per call for speed
(`tile_config`): the tile's height and width by the number of rows (16-row tiles narrow
enough to fill the GPU at decode, 64 x 128 in between, 128 x 128 for prefill chunks). The
output is rounded once to its dtype: the lm_head's float32 logits come straight from the
accumulators, a residual is added to them in float32 (the residual stream's dtype), and an
MLP's gate and up products meet in silu(gate) * up before their one rounding.

Tested on the CPU under TRITON_INTERPRET=1 against float64 products and alone against in a
batch (tests/test_linear_triton.py, slow); timed against cuBLAS and checked bit for bit across
tile shapes on a lent GPU by benchmarks/gpu/gpu_accept.py.
"""

from __future__ import annotations

import functools
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


def k_slice(dtype: torch.dtype) -> int:
    """The K slice of every tile (a weight's summation order): float32 takes half the
    bfloat16 slice for the same shared memory."""
    return 32 if dtype == torch.float32 else 64


# NOTE: the tile shapes by rows. Measured on an H200 (gpu_linear.py, an 8B Llama's five
# weights in bfloat16): 64 x 128 beat 64 x 64, 128 x 64 and 128 x 128 at 1, 16 and 64 rows
# and reached 0.55-0.6 of cuBLAS at 4,096 rows, where 128 x 128 reached 0.74.
DECODE_ROWS = 16  # at most this many rows: 16-row tiles
PREFILL_ROWS = 512  # at least this many: 128 x 128 tiles
SM_COUNT = 132  # an H100's and an H200's; read off the device where there is one
ROW_BUCKETS = True  # False: one 64 x 128 tile for every row count (the first H200 run's)
FUSED_EPILOGUES = True  # False: the residual add and silu(gate) * up in torch, after rounding


def tile_config(
    out_features: int, in_features: int, dtype: torch.dtype, rows: int = 64, sms: int = SM_COUNT
) -> TileConfig:
    """A call's tiles: the K slice from the weight's dtype alone; the tile's shape by the
    number of rows (free: no row's sum changes with it). At decode, tiles narrow enough that
    a narrow weight (an 8B's o_proj: 32 tiles of 128 columns) still gives every
    multiprocessor one."""
    del in_features
    k = k_slice(dtype)
    if not ROW_BUCKETS:
        return TileConfig(64, 128, k)
    if rows >= PREFILL_ROWS:
        return TileConfig(128, 128, k, num_warps=8)
    if rows > DECODE_ROWS:
        return TileConfig(64, 128, k)
    width = 128
    while width > 32 and -(-out_features // width) < sms:
        width //= 2
    return TileConfig(16, width, k)


def available() -> bool:
    return triton is not None


# NOTE: the kernel's GLU constexpr: none, then cpu/ops.py's ACTIVATION_CODES
GLU_CODES = {"": 0, "silu": 1, "gelu_tanh": 2}


def triton_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: TileConfig | None = None,
    residual: torch.Tensor | None = None,
    glu: str = "",
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in out_dtype (default x's).
    residual [M, N]: added to the float32 sums, the result in the residual's dtype.
    glu (an activation: silu, gelu_tanh): weight holds gate rows then up rows [2N, K] (bias
    likewise): act(gate) * up [M, N]."""
    assert triton is not None, "Triton is not installed"
    rows, k = x.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1
    assert not (glu and residual is not None), "an MLP's gate_up takes no residual"
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or tile_config(n, k, weight.dtype, rows, _sms(x.device))
    if residual is not None:
        out_dtype = residual.dtype
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _linear_kernel[grid](
        x, weight, weight if bias is None else bias, out, out if residual is None else residual,
        rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        0 if residual is None else residual.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, GLU=GLU_CODES[glu],
        IEEE=x.dtype == torch.float32, OUT_FP32=out.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


@functools.cache
def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_rm,
        HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GLU: tl.constexpr,
        IEEE: tl.constexpr, OUT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # NOTE: M is not specialised on (a row count of 1 or a multiple of 16 would compile
        # another kernel); the K loop is the same for every M and every tile shape.
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :],
                mask=(rm[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )
            w_at = w_ptr + rn[None, :] * stride_wn + kk[:, None]
            w_mask = (rn[None, :] < N) & (kk[:, None] < K)
            w = tl.load(w_at, mask=w_mask, other=0.0)
            if IEEE:  # noqa: SIM108 (a branch on a constexpr, resolved at compile time)
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
            if GLU:  # NOTE: the up rows, N rows below the gate's
                u = tl.load(w_at + N * stride_wn, mask=w_mask, other=0.0)
                if IEEE:  # noqa: SIM108
                    up = tl.dot(x, u, up, input_precision="ieee")
                else:
                    up = tl.dot(x, u, up)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if GLU:
                up += tl.load(b_ptr + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        # NOTE: act(gate) * up from the float32 sums, rounded once (csrc's rule): gelu_tanh
        # as x * sigmoid(2u) (csrc/silu.h)
        if GLU == 1:
            acc = acc / (1.0 + tl.exp(-acc)) * up
        if GLU == 2:
            z = acc * (1.5957691216057308 + 0.0713548162726009 * (acc * acc))
            acc = acc / (1.0 + tl.exp(-z)) * up
        inside = (rm[:, None] < M) & (rn[None, :] < N)
        if HAS_RESIDUAL:
            acc += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=inside, other=0.0)
        out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if OUT_FP32:
            tl.store(out, acc, mask=inside)
        else:  # NOTE: rounded to nearest even, as torch rounds (the interpreter's default cuts)
            tl.store(out, acc.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)
