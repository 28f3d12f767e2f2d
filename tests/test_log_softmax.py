"""The log-softmax computed only where asked (logprobs.LogSoftmax, csrc/log_softmax.cpp):
close to torch's log_softmax, the first max as argmax, NaN where torch gives NaN, a row's
numbers independent of its company, and the same bits from a build without any AVX."""

from __future__ import annotations

import pytest
import torch

from tokenmill.tp_worker.cpu import kernels as cpu_kernels
from tokenmill.tp_worker.sample import logprobs
from tokenmill.tp_worker.sample.logprobs import LogSoftmax
from tokenmill.tp_worker.sample.sampling import greedy_ids


def _logits(rows: int = 9, vocab: int = 1003, seed: int = 0) -> torch.Tensor:
    """1003 columns: 62 whole blocks of 16 and a tail of 11."""
    return 6 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_a_trained_models_tail_is_not_lost(cpu_kernel: bool) -> None:
    """A trained model's shape: a few logits near the top and ~49,000 some 16-20 below, each
    of whose terms falls below half an ulp of a float32 sum near 1 (together ~5e-4 of it).
    float32 lanes dropped them (the logsum low by about that much); double totals keep the
    logsum within float32 rounding of float64's."""
    gen = torch.Generator().manual_seed(5)
    logits = -16.0 - 4.0 * torch.rand(3, 49152, generator=gen)
    logits[:, :4] = torch.tensor([0.0, -1.0, -2.5, -3.0])
    scores = LogSoftmax.of(logits, cpu_kernel)
    exact = torch.logsumexp(logits.double(), dim=-1) - logits.double().amax(dim=-1)
    torch.testing.assert_close(scores.logsum.double(), exact, atol=4e-7, rtol=0)


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_matches_torch_log_softmax(cpu_kernel: bool) -> None:
    logits = _logits()
    scores = LogSoftmax.of(logits, cpu_kernel, top=8)
    expected = torch.log_softmax(logits.double(), dim=-1)
    rows = torch.arange(9).repeat_interleave(1003)
    ids = torch.arange(1003).repeat(9)
    torch.testing.assert_close(
        scores.at(rows, ids).double(), expected.flatten(), atol=1e-6, rtol=3e-7
    )
    one_each = torch.tensor([5, 0, 1002, 17, 999, 3, 3, 500, 1])  # one id in each row
    assert torch.equal(scores.at_rows(one_each), scores.at(torch.arange(9), one_each))
    # NOTE: the torch path leaves the greedy id to sampling's own argmax.
    expected_argmax = logits.argmax(dim=-1) if cpu_kernel else None
    assert (scores.argmax is None) == (expected_argmax is None)
    if scores.argmax is not None:
        assert torch.equal(scores.argmax, expected_argmax)
    top_ids, top_values = scores.top(torch.tensor([4, 0]), 5)
    reference = expected[[4, 0]].topk(5, dim=-1)
    assert torch.equal(top_ids.long(), reference.indices)
    torch.testing.assert_close(top_values.double(), reference.values, atol=2e-6, rtol=0)


def test_ties_infinities_and_nan_as_torch() -> None:
    logits = _logits(6, 40)
    logits[0, [3, 17, 33]] = 50.0  # a tie in three lanes: the first index wins
    logits[1] = float("-inf")
    logits[1, 25] = 0.0  # one finite logit: logprob 0 there, -inf elsewhere
    logits[2, [5, 30]] = float("nan")
    logits[3, 7] = float("inf")
    logits[4] = float("-inf")
    logits[5, 38] = 80.0  # the max in the tail past the last whole block
    scores = LogSoftmax.of(logits, cpu_kernel=True, top=4)
    assert scores.argmax is not None and scores.argmax.tolist() == [3, 25, 5, 7, 0, 38]
    top_ids, top_values = scores.top(torch.tensor([0, 1, 5]), 4)
    assert top_ids[0, :3].tolist() == [3, 17, 33]  # equal values: the smaller index first
    assert top_ids[1, 0] == 25 and top_values[1, 0] == 0.0
    assert bool((top_values[1, 1:] == float("-inf")).all()) and top_ids[2, 0] == 38
    nan_row_ids, _ = scores.top(torch.tensor([2]), 2)  # NaN rows are torch's: NaN first
    assert nan_row_ids[0].tolist() in ([5, 30], [30, 5])
    assert torch.equal(scores.argmax, logits.argmax(dim=-1))
    rows = torch.arange(6).repeat_interleave(40)
    ids = torch.arange(40).repeat(6)
    ours = scores.at(rows, ids).view(6, 40)
    expected = torch.log_softmax(logits, dim=-1)
    assert ours[1, 25] == 0.0 and bool((ours[1, :25] == float("-inf")).all())
    for row in (2, 3, 4):
        assert bool(ours[row].isnan().all()) and bool(expected[row].isnan().all())
    torch.testing.assert_close(ours[[0, 5]], expected[[0, 5]], atol=2e-6, rtol=0)


def test_greedy_ids_alone_are_the_log_softmax_pass_argmax() -> None:
    """sampling.greedy_ids (the kernel's max pass alone, where no logprob is read): the
    argmax of the log-softmax pass and torch's, ties, infinities and NaN included, and on
    rows of a wider buffer."""
    logits = _logits(7, 33000)
    logits[0, [3, 17, 33]] = 50.0
    logits[1] = float("-inf")
    logits[2, [5, 30]] = float("nan")
    logits[3, 32999] = float("inf")
    wide = torch.zeros(7, 33100)
    wide[:, :33000] = logits
    for x in (logits, wide[:, :33000]):
        ids = greedy_ids(x, cpu_kernel=True)
        assert torch.equal(ids, LogSoftmax.of(x.contiguous(), cpu_kernel=True).argmax)
        assert torch.equal(ids, x.argmax(dim=-1)) and ids.tolist()[:4] == [3, 0, 5, 32999]


def test_a_row_is_bitwise_the_same_in_any_company() -> None:
    logits = _logits(64, 3000)
    together = LogSoftmax.of(logits, cpu_kernel=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = LogSoftmax.of(logits, cpu_kernel=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single.logsum, together.logsum)
    for start, stop in ((0, 1), (13, 14), (5, 40)):
        part = LogSoftmax.of(logits[start:stop], cpu_kernel=True)
        assert torch.equal(part.logsum, together.logsum[start:stop])
        assert torch.equal(part.max, together.max[start:stop])
    strided = LogSoftmax.of(torch.cat([logits, logits], dim=1)[:, :3000], cpu_kernel=True)
    assert torch.equal(strided.logsum, together.logsum)


def test_a_build_without_avx_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = _logits(7, 1003)
    logits[2, 100] = float("nan")
    native = LogSoftmax.of(logits, cpu_kernel=True, top=20)
    portable = cpu_kernels.load(cpu_kernels.build("x86-64-v2"))
    monkeypatch.setattr(logprobs, "library", lambda: portable)
    other = LogSoftmax.of(logits, cpu_kernel=True, top=20)
    rows = torch.tensor([0, 1, 3, 4, 5, 6])
    for ours, theirs in zip(other.top(rows, 20), native.top(rows, 20), strict=True):
        assert torch.equal(ours, theirs)
    assert other.argmax is not None and native.argmax is not None
    assert torch.equal(other.argmax, native.argmax)
    assert torch.equal(other.max[[0, 1, 3, 4, 5, 6]], native.max[[0, 1, 3, 4, 5, 6]])
    assert torch.equal(other.logsum.isnan(), native.logsum.isnan())
    finite = ~native.logsum.isnan()
    assert torch.equal(other.logsum[finite], native.logsum[finite])
