"""Which engine replica serves a request, with --data-parallel-size > 1 (main process).

Each replica has its own radix cache, so a prompt is cheapest where its prefix was computed.
The router keeps an approximate index of what each replica has seen: the chained hashes of
every prompt's 16-token blocks, least recently used dropped past a bound. A request goes to
the replica holding the longest run of its leading blocks, unless that replica has
BALANCE_SLACK more requests in flight than the least loaded one; with no prefix seen
anywhere it goes to the least loaded (ties in turn). Approximate: the index does not know
what a replica's cache evicted, which costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK_TOKENS = 16
BALANCE_SLACK = 32  # requests in flight (SGLang's router balances at 32 too)
MAX_BLOCKS = 1 << 16  # per replica: about a million prompt tokens


class ReplicaRouter:
    def __init__(self, num_replicas: int, max_blocks: int = MAX_BLOCKS) -> None:
        self.blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.in_flight = [0] * num_replicas
        self.max_blocks = max_blocks
        self._turn = 0

    def pick(self, input_ids: bytes, itemsize: int = 4) -> int:
        """The replica for a prompt (its ids as raw bytes); counts it in flight there."""
        if len(self.blocks) == 1:
            self.in_flight[0] += 1
            return 0
        hashes = block_hashes(input_ids, itemsize)
        matched = [self._matched(d, hashes) for d in range(len(self.blocks))]
        least = min(self.in_flight)
        best = max(range(len(matched)), key=lambda d: (matched[d], -self.in_flight[d]))
        if matched[best] == 0 or self.in_flight[best] > least + BALANCE_SLACK:
            best = self._least_loaded(least)
        self._remember(best, hashes)
        self.in_flight[best] += 1
        return best

    def finished(self, replica: int) -> None:
        self.in_flight[replica] -= 1

    def _matched(self, replica: int, hashes: list[int]) -> int:
        seen = self.blocks[replica]
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        return n

    def _least_loaded(self, least: int) -> int:
        candidates = [d for d, n in enumerate(self.in_flight) if n == least]
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    def _remember(self, replica: int, hashes: list[int]) -> None:
        seen = self.blocks[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)


def block_hashes(input_ids: bytes, itemsize: int = 4) -> list[int]:
    """One hash per full block, each over the block and every block before it."""
    size = BLOCK_TOKENS * itemsize
    hashes: list[int] = []
    h = 0
    for start in range(0, len(input_ids) - size + 1, size):
        h = hash((h, input_ids[start : start + size]))
        hashes.append(h)
    return hashes
