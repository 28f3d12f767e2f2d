"""tp_worker/cpu/huge_pages.py: the packed weights' memory on 2 MiB pages, carved in order, given
back once its tensors are gone, and the packed panels the same either way."""

from __future__ import annotations

import gc

import pytest
import torch

from tokenmill.tp_worker.cpu import huge_pages
from tokenmill.tp_worker.cpu.ops import PackedLinear, pack

pytestmark = pytest.mark.skipif(not huge_pages.enabled(), reason="no MADV_HUGEPAGE here")


def test_tensors_are_carved_in_order_aligned_and_apart() -> None:
    pages = huge_pages.HugePages()
    shapes = [(3, 5), (1000,), (7, 33, 2), (0,), (4096, 64)]
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.float32, torch.bfloat16]
    tensors = [pages.empty(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    assert tensors[0].data_ptr() % huge_pages.HUGE_PAGE == 0  # a mapping's first
    for t, shape, dtype in zip(tensors, shapes, dtypes, strict=True):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % huge_pages.ALIGN == 0
    live = [t for t in tensors if t.numel()]
    for i, t in enumerate(live):
        t.view(torch.uint8).fill_(i + 1)
    for i, t in enumerate(live):  # NOTE: none overwrote another
        assert bool((t.view(torch.uint8) == i + 1).all())
    starts = [t.data_ptr() for t in live]
    assert starts == sorted(starts)


def test_a_tensor_larger_than_a_mapping_gets_its_own() -> None:
    pages = huge_pages.HugePages()
    small = pages.empty((16,), torch.float32)
    size = huge_pages.CHUNK + huge_pages.HUGE_PAGE + 1  # NOTE: more than a mapping's room
    big = pages.empty((size,), torch.uint8)
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0
    big.fill_(7)
    assert small.data_ptr() != big.data_ptr()


def test_the_memory_goes_once_its_tensors_do() -> None:
    pages = huge_pages.HugePages()
    a = pages.empty((1024,), torch.float32)
    b = a.view(32, 32)
    del a
    gc.collect()
    assert pages._mapping is not None and pages._mapping() is not None  # b holds it
    del b
    gc.collect()
    assert pages._mapping() is None
    again = pages.empty((8,), torch.float32)  # NOTE: a fresh mapping, from its first byte
    assert again.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_off_gives_torch_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CPU_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    t = huge_pages.empty((4, 4), torch.float32)
    assert t.shape == (4, 4) and t.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_panels_and_products_are_the_same_either_way(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 96, generator=gen).to(dtype)
    x = torch.randn(5, 96, generator=gen).to(dtype)
    on_pages, linear = pack(weight), PackedLinear(weight, None)
    y = linear(x)
    monkeypatch.setenv("TOKENMILL_CPU_HUGE_PAGES", "0")
    plain, plain_linear = pack(weight), PackedLinear(weight, None)
    assert torch.equal(on_pages.view(torch.uint8), plain.view(torch.uint8))
    assert torch.equal(y, plain_linear(x))
