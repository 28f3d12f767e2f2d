"""Row-local kernels in Triton, for CUDA (tp_worker): RMSNorm and the log-softmax's max and
log-sum, one program a row, each row's sum taken in one fixed order.

torch's CUDA reductions (`mean`, `sum`) choose how to split a row by the tensor's whole
shape: with few rows they cut each row among several blocks and add the pieces, with many
they give a row to one block, so a row's sum (and then its normalised hidden state or its
logprobs) rounds differently alone and in a batch. Here each program walks its row in BLOCK
slices in order, one lane per column of a slice (RMSNorm's squares summed in float32; the
softmax's exponentials, taken in float32, summed in float64, as csrc/log_softmax.cpp keeps
double totals), and adds the lanes in one tree at the end; BLOCK depends on the row's width
alone. So a row's result depends on its own values only: batch-invariant by construction.
Used by the Triton backend (`--attention-backend triton`), with the rest of cuda/.

Tested on the CPU under TRITON_INTERPRET=1 against float64 and alone against in a batch
(tests/test_rowwise_triton.py, slow); on a GPU by benchmarks/gpu/gpu_accept.py.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # NOTE: CPU installs need no Triton; only CUDA workers and tests use it
    triton = None

MAX_BLOCK = 1024  # columns a program reads at once


def available() -> bool:
    return triton is not None


def runs_on(x: torch.Tensor) -> bool:
    """Whether a tensor's rows go through these kernels: on CUDA, where Triton is installed."""
    return x.is_cuda and triton is not None


def block_for(width: int) -> int:
    """The slice a program reads, from the row's width alone (never from the row count)."""
    return min(MAX_BLOCK, triton.next_power_of_2(width))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """x [T, H] (the float32 residual stream, or q/k heads in the model's dtype) -> [T, H] in
    `dtype`: weight * (x * rsqrt(mean(x^2) + eps)), in float32 and rounded once (weight
    float32)."""
    assert triton is not None, "Triton is not installed"
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](
            x, weight, out, hidden, x.stride(0), out.stride(0), eps,
            BLOCK=block_for(hidden), OUT_FP32=out.dtype == torch.float32, num_warps=4,
        )  # fmt: skip
    return out


def log_softmax_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] float32 -> each row's max [N] (NaN where the row holds one) and
    log(sum(exp(x - max))) [N] float32, the sum in float64."""
    assert triton is not None, "Triton is not installed"
    assert logits.dtype == torch.float32
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    max_ = logits.new_empty(rows)
    logsum = logits.new_empty(rows)
    if rows:
        _log_softmax_stats_kernel[(rows,)](
            logits, max_, logsum, vocab, logits.stride(0), BLOCK=block_for(vocab), num_warps=4
        )
    return max_, logsum


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        X, W, Y, hidden, stride_x, stride_y, eps,
        BLOCK: tl.constexpr, OUT_FP32: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            inside = start + cols < hidden
            x = tl.load(X + row * stride_x + start + cols, mask=inside, other=0.0).to(tl.float32)
            squares += x * x
        scale = 1.0 / tl.sqrt_rn(tl.sum(squares, 0) / hidden + eps)
        for start in range(0, hidden, BLOCK):
            inside = start + cols < hidden
            x = tl.load(X + row * stride_x + start + cols, mask=inside, other=0.0).to(tl.float32)
            w = tl.load(W + start + cols, mask=inside, other=0.0).to(tl.float32)
            y = w * (x * scale)
            at = Y + row * stride_y + start + cols
            if OUT_FP32:
                tl.store(at, y, mask=inside)
            else:  # NOTE: rounded to nearest even, as torch rounds
                tl.store(at, y.to(Y.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)

    @triton.jit
    def _log_softmax_stats_kernel(X, MAX, LOGSUM, vocab, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        nan = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, vocab, BLOCK):
            inside = start + cols < vocab
            x = tl.load(X + row * stride_x + start + cols, mask=inside, other=float("-inf"))
            best = tl.maximum(best, x)
            nan = tl.maximum(nan, (x != x).to(tl.int32))
        # NOTE: tl.maximum may drop a NaN; torch's amax keeps it, and so does this max
        top = tl.where(tl.max(nan, 0) > 0, float("nan"), tl.max(best, 0))
        total = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, vocab, BLOCK):
            inside = start + cols < vocab
            x = tl.load(X + row * stride_x + start + cols, mask=inside, other=float("-inf"))
            total += tl.exp(x - top).to(tl.float64)
        tl.store(MAX + row, top)
        tl.store(LOGSUM + row, tl.log(tl.sum(total, 0)).to(tl.float32))
