"""KV slots for requests: the slot pool plus the radix prefix cache (controller process).

A request's `slots` list its KV slot per position. Those of the cached prefix it matched
belong to the tree (locked while the request runs); the rest belong to the request until it
releases them, when the computed ones are inserted into the tree for the next request.
Without a cache (--disable-prefix-cache) the same calls simply allocate and free.
"""

from __future__ import annotations

from tokenmill.controller.radix_cache import Match, RadixCache
from tokenmill.controller.request import Request
from tokenmill.controller.slot_pool import IndexPool


class KvAllocator:
    def __init__(self, pool: IndexPool, enable_cache: bool) -> None:
        self.pool = pool
        self.cache = RadixCache(pool) if enable_cache else None
        self.queried_tokens = 0  # prompt tokens looked up (first admission of each request)
        self.hit_tokens = 0  # of those, found in the cache

    @property
    def num_available(self) -> int:
        """Slots an allocation can get: free ones plus unlocked cached ones."""
        return self.pool.num_free + (self.cache.num_evictable if self.cache else 0)

    def lookup(self, request: Request) -> Match | None:
        """The cached prefix of a waiting request's tokens (None without a cache, or where
        nothing may be reused), for admit."""
        if self.cache is None or request.max_cached_prefix <= 0:
            return None
        return self.cache.match(request.tokens(0, request.max_cached_prefix), request.cache_space)

    def admit(self, request: Request, headroom: int, match: Match | None) -> bool:
        """Gives a waiting request its cached prefix (`match`, lookup's, the tree unchanged
        since) and slots for every other known token, if that leaves `headroom` slots
        available; else changes nothing."""
        cached = match.slots if match else []
        if match:
            self.cache.lock(match.node)  # type: ignore[union-attr]
        needed = request.num_tokens - len(cached)
        if needed + headroom > self.num_available:
            if match:
                self.cache.unlock(match.node)  # type: ignore[union-attr]
            return False
        request.slots = cached + self.alloc(needed)
        request.num_computed_tokens = len(cached)
        request.cache_node = match.node if match else None
        request.fill_table = bool(cached)
        if not request.admitted_before:
            request.admitted_before = True
            request.num_cached_tokens = min(len(cached), request.num_prompt_tokens)
            self.queried_tokens += request.num_prompt_tokens
            self.hit_tokens += request.num_cached_tokens
        return True

    def alloc(self, count: int) -> list[int]:
        if count > self.pool.num_free and self.cache is not None:
            self.cache.evict(count - self.pool.num_free)
        return self.pool.alloc(count)

    def cache_computed(self, request: Request) -> None:
        """Puts the request's computed tokens into the tree now (after its prefill), so that
        requests sharing its prompt hit while it still runs."""
        if self.cache is None or request.num_computed_tokens == 0:
            return
        n = request.num_computed_tokens
        match = self.cache.insert(request.tokens(0, n), request.slots[:n], request.cache_space)
        self.cache.lock(match.node)
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
        request.cache_node = match.node
        if match.slots != request.slots[:n]:
            request.slots[:n] = match.slots  # the tree kept its own copy of some positions
            request.fill_table = True

    def release(self, request: Request) -> None:
        """Takes back what a request holds: computed tokens go to the cache, the rest is
        freed."""
        n = request.num_computed_tokens if self.cache is not None else 0
        if n:
            self.cache.insert(  # type: ignore[union-attr]
                request.tokens(0, n), request.slots[:n], request.cache_space
            )
        own_from = n if n else len(self._cached_slots(request))
        self.pool.free(request.slots[own_from:])
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)  # type: ignore[union-attr]
        request.slots, request.cache_node = [], None

    def _cached_slots(self, request: Request) -> list[int]:
        """The prefix of request.slots that the tree owns (its locked path)."""
        node, length = request.cache_node, 0
        while node is not None and node.parent is not None:
            length += len(node.slots)
            node = node.parent
        return request.slots[:length]

    def check_integrity(self, running: list[Request]) -> None:
        """Every used slot belongs to the tree or to exactly one running request."""
        self.pool.check_integrity()
        tree = set()
        if self.cache is not None:
            self.cache.check_integrity()
            tree = self.cache.slots()
        owned: list[int] = []
        for request in running:
            owned += request.slots[len(self._cached_slots(request)) :]
        assert len(owned) == len(set(owned)), "a slot is owned by two requests"
        assert not (tree & set(owned)), "a slot is in the tree and owned by a request"
        assert tree | set(owned) == self.pool.used, "used slots that nobody holds (a leak)"
