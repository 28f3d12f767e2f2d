"""The KV slot pool and the request->slot table's rows (controller process).

The controller owns every slot's state; workers only see slot numbers in step messages.
`check_integrity()` proves no slot is lost or handed out twice.
"""

from __future__ import annotations


class IndexPool:
    """A free list over 0..size-1 with O(1) alloc/free and a leak check."""

    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self._free = list(range(size - 1, -1, -1))  # pop() hands out low numbers first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> frozenset[int]:
        return frozenset(self._used)

    def alloc(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"{self.name}: {count} wanted, {len(self._free)} free")
        taken = [self._free.pop() for _ in range(count)]
        self._used.update(taken)
        return taken

    def free(self, items: list[int]) -> None:
        for item in items:
            self._used.remove(item)  # KeyError = double free: a broken invariant
        # NOTE: reversed, so that pop() hands them out again in their order: runs of slots
        # freed together come back as runs (a row's keys lie together).
        self._free.extend(reversed(items))

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.name}: duplicate in free list"
        assert not (free & self._used), f"{self.name}: an index is both free and used"
        assert len(free) + len(self._used) == self.size, f"{self.name}: indices lost"
