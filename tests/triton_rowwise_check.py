"""Run by tests/test_rowwise_triton.py in a subprocess with TRITON_INTERPRET=1 (set before
Triton is imported): the row-local kernels (RMSNorm, the log-softmax's max and log-sum)
against float64, and each row alone against the same row in batches of other sizes and at
other places in them, bit for bit. NOTE: with one program a row, the interpreter cannot
round a row differently by its batch, so the latter checks the kernels' indexing and
strides; whether a GPU keeps a row's bits is gpu_accept.py's to say."""

from __future__ import annotations

import torch

from tokenmill.tp_worker.cuda.rowwise import MAX_BLOCK, log_softmax_stats, rms_norm


def check_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for hidden in (40, MAX_BLOCK + 300):  # NOTE: one slice, and several with a ragged end
        x = torch.randn(37, hidden, generator=g) * 3
        w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
        out = rms_norm(x, w, 1e-6)
        x64 = x.double()
        exact = w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
        error = ((out.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max().item()
        # NOTE: float32 throughout, then (bfloat16) one rounding: up to 2^-7 relative here,
        # where the interpreter cuts rather than rounds (benchmarks/gpu/gpu_accept.py checks
        # the GPU's rounding against torch's)
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), (dtype, hidden, error)
        for rows in (1, 2, 16, 37):
            assert torch.equal(rms_norm(x[:rows], w, 1e-6), out[:rows]), (dtype, hidden, rows)
        moved = torch.cat([x[20:25], x[:3]])
        assert torch.equal(rms_norm(moved, w, 1e-6)[5:], out[:3]), (dtype, hidden, "moved")
    print(f"rms_norm {dtype}: float64 agreement and row invariance ok")


def check_log_softmax() -> None:
    g = torch.Generator().manual_seed(1)
    for vocab in (50, 3 * MAX_BLOCK + 17):
        logits = torch.randn(9, vocab, generator=g) * 4
        max_, logsum = log_softmax_stats(logits)
        assert torch.equal(max_, logits.amax(-1))
        exact = torch.logsumexp(logits.double(), -1) - logits.double().amax(-1)
        assert (logsum.double() - exact).abs().max().item() < 1e-6, vocab
        for rows in (1, 4, 9):
            part = log_softmax_stats(logits[:rows])
            assert torch.equal(part[0], max_[:rows]) and torch.equal(part[1], logsum[:rows])
        moved = log_softmax_stats(torch.cat([logits[5:], logits[:2]]))
        assert torch.equal(moved[1][4:], logsum[:2]), vocab
    strided = torch.randn(3, 2 * vocab, generator=g)[:, :vocab]  # NOTE: a view with row gaps
    assert torch.equal(log_softmax_stats(strided)[1], log_softmax_stats(strided.clone())[1])
    nan = torch.randn(2, 70, generator=g)
    nan[1, 33] = float("nan")
    assert log_softmax_stats(nan)[0].isnan().tolist() == [False, True]
    print("log_softmax_stats: float64 agreement and row invariance ok")


def main() -> int:
    for dtype in (torch.float32, torch.bfloat16):
        check_rms_norm(dtype)
    check_log_softmax()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
