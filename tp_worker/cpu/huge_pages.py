"""Memory for the CPU kernels' packed weights on 2 MiB pages (tp_worker).

A decode step streams every weight once: with 4 KiB pages SmolLM2's 269 MB are ~66,000 pages
a token, each a TLB miss and a page walk the prefetchers do not hide, since no TLB holds
more than a few thousand. Linux backs anonymous memory with 2 MiB pages where a mapping asks
for them (madvise MADV_HUGEPAGE; "transparent huge pages" in the default "madvise" mode), so
the packed panels go, one after another in packing order, into mappings that ask, 2 MiB
aligned. benchmarks/product_stream.py's driver (at c8228a0) read a token's one-row products
1.02-1.04x faster so (docs/performance.md, "The kernels"). Where the system gives no such
pages the same memory is plain pages; TOKENMILL_CPU_HUGE_PAGES=0 asks for none (an A/B).

A mapping lives while any tensor carved from it does (torch.frombuffer keeps it), so
dropping a model's packed weights gives their memory back to the system at once.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import weakref

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # bytes a mapping holds, at least: many packed weights share one
ALIGN = 64  # each tensor starts on a cache line


def enabled() -> bool:
    return os.environ.get("TOKENMILL_CPU_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


class HugePages:
    """Carves tensors out of mappings that ask for 2 MiB pages, in the order asked."""

    def __init__(self) -> None:
        # NOTE: the mapping being filled, held weakly: once the tensors carved from it are
        # gone, so is it (its memory back to the system), and the next ask maps anew.
        self._mapping: weakref.ref[mmap.mmap] | None = None
        self._next = 0  # offset of the next tensor in that mapping

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor."""
        nbytes = math.prod(shape) * dtype.itemsize
        mapping = self._mapping() if self._mapping is not None else None
        if mapping is None or self._next + nbytes > len(mapping):
            mapping = self._map(nbytes)
        start = self._next
        self._next = -(-(start + nbytes) // ALIGN) * ALIGN
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        return whole[start : start + nbytes].view(dtype).view(shape)

    def _map(self, nbytes: int) -> mmap.mmap:
        """A new private anonymous mapping of at least `nbytes` past its first 2 MiB
        boundary, asking for huge pages; the next tensor starts on that boundary."""
        size = max(CHUNK, -(-nbytes // HUGE_PAGE) * HUGE_PAGE) + HUGE_PAGE
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # NOTE: a kernel without transparent huge pages refuses: plain pages, as torch's.
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE)
        address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
        self._next = -address % HUGE_PAGE
        self._mapping = weakref.ref(mapping)
        return mapping


_PAGES = HugePages()


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on 2 MiB pages where enabled() (else torch's
    own allocation)."""
    if not enabled():
        return torch.empty(shape, dtype=dtype)
    return _PAGES.empty(shape, dtype)
