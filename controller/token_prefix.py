"""How many leading tokens two token lists share (controller: the radix cache's edge walk)."""

from __future__ import annotations

# NOTE: list slices compare in C; only the last, differing block is scanned in Python (a
# token at a time, a 1,024-token edge cost ~1,000 interpreter steps per lookup).
_BLOCK = 64


def common_prefix_len(a: list[int], b: list[int], start: int = 0) -> int:
    """The length of the longest common prefix of a and b[start:]."""
    limit = min(len(a), len(b) - start)
    n = 0
    while n + _BLOCK <= limit and a[n : n + _BLOCK] == b[start + n : start + n + _BLOCK]:
        n += _BLOCK
    while n < limit and a[n] == b[start + n]:
        n += 1
    return n
