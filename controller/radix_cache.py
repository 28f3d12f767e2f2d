"""The radix prefix cache: token-id prefixes -> KV slots (controller process).

Edges hold runs of token ids with the slot of each. A request that uses a cached prefix
locks its path (reference counts), so eviction, which frees least-recently-used unlocked
leaves, never takes slots a running request reads. The tree owns the slots it holds; the
slot pool sees them as used until they are evicted.

Each cache space has its own root: the base model's is 0, each LoRA adapter load its own
(controller/lora_registry.py), so that no prefix computed with one set of weights is read
with another's.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from tokenmill.controller.slot_pool import IndexPool
from tokenmill.controller.token_prefix import common_prefix_len

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    tokens: list[int]  # the edge's token ids, from the parent to this node
    slots: list[int]  # KV slot of each of those tokens
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    lock_count: int = 0  # running requests whose matched path ends at or below this node
    last_access: int = 0

    def touch(self) -> None:
        self.last_access = next(_clock)


@dataclass(frozen=True)
class Match:
    slots: list[int]  # KV slots of the matched prefix
    node: Node  # deepest node of the match (lock it while the slots are in use)


BASE_SPACE = 0  # the base model's cache space


class RadixCache:
    def __init__(self, pool: IndexPool) -> None:
        self.pool = pool
        self.root = Node([], [])
        self.root.lock_count = 1  # NOTE: roots are never evicted
        self.roots: dict[int, Node] = {BASE_SPACE: self.root}  # cache space -> its root
        self.num_cached = 0  # slots the tree holds
        self.num_locked = 0  # of those, slots on a locked path

    @property
    def num_evictable(self) -> int:
        return self.num_cached - self.num_locked

    def _root(self, space: int) -> Node:
        root = self.roots.get(space)
        if root is None:
            root = self.roots[space] = Node([], [], lock_count=1)
        return root

    def drop_space(self, space: int) -> int:
        """Frees every prefix cached in `space` (an adapter unloaded or replaced: none of its
        requests may hold any); returns how many slots it freed."""
        root = self.roots.pop(space, None)
        if root is None:
            return 0
        nodes = [n for n in self._nodes_under(root) if n is not root]
        assert all(n.lock_count == 0 for n in nodes), f"cache space {space} is in use"
        freed = [s for n in nodes for s in n.slots]
        self.pool.free(freed)
        self.num_cached -= len(freed)
        return len(freed)

    def match(self, tokens: list[int], space: int = BASE_SPACE) -> Match:
        """The longest cached prefix of `tokens` in `space` (splitting an edge where the match
        ends)."""
        node, slots, i = self._root(space), [], 0
        while i < len(tokens) and tokens[i] in node.children:
            child = node.children[tokens[i]]
            n = common_prefix_len(child.tokens, tokens, i)
            if n < len(child.tokens):
                child = self._split(child, n)
            slots += child.slots
            node, i = child, i + n
            node.touch()
        return Match(slots, node)

    def insert(self, tokens: list[int], slots: list[int], space: int = BASE_SPACE) -> Match:
        """Caches `slots` for `tokens` in `space`. Where the tree already holds a slot for a
        position, the tree's is kept and the caller's duplicate is freed: the returned match
        holds the slots to use from now on."""
        match = self.match(tokens, space)
        existing = len(match.slots)
        if existing < len(tokens):
            self.pool.free(
                [s for s, own in zip(slots[:existing], match.slots, strict=True) if s != own]
            )
            leaf = Node(tokens[existing:], slots[existing:], parent=match.node)
            leaf.touch()
            match.node.children[tokens[existing]] = leaf
            self.num_cached += len(leaf.tokens)
            return Match(match.slots + leaf.slots, leaf)
        self.pool.free([s for s, own in zip(slots, match.slots, strict=True) if s != own])
        return match

    def lock(self, node: Node) -> None:
        self._add_locks(node, +1)

    def unlock(self, node: Node) -> None:
        self._add_locks(node, -1)

    def evict(self, num_slots: int) -> int:
        """Frees at least `num_slots` slots from unlocked leaves, oldest first, if it can;
        returns how many it freed."""
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_slots and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self.pool.free(leaf.slots)
            self.num_cached -= len(leaf.slots)
            freed += len(leaf.slots)
            if self._evictable_leaf(parent):
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def slots(self) -> set[int]:
        return {s for n in self._nodes() for s in n.slots}

    def check_integrity(self) -> None:
        held = [s for n in self._nodes() for s in n.slots]
        assert len(held) == len(set(held)) == self.num_cached, "radix: slot held twice"
        locked = sum(len(n.slots) for n in self._nodes() if n.lock_count > 0 and n.parent)
        assert locked == self.num_locked, f"radix: {locked} locked != {self.num_locked}"
        for node in self._nodes():
            assert node.lock_count >= 0, "radix: negative lock count"
            assert len(node.tokens) == len(node.slots), "radix: tokens and slots differ"
            for first, child in node.children.items():
                assert child.parent is node and child.tokens[0] == first, "radix: bad link"

    def _split(self, child: Node, n: int) -> Node:
        """Cuts `child`'s edge after n tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = Node(
            child.tokens[:n],
            child.slots[:n],
            parent=parent,
            lock_count=child.lock_count,
            last_access=child.last_access,
        )
        parent.children[upper.tokens[0]] = upper
        child.tokens, child.slots, child.parent = child.tokens[n:], child.slots[n:], upper
        upper.children[child.tokens[0]] = child
        return upper

    def _add_locks(self, node: Node | None, delta: int) -> None:
        while node is not None and node.parent is not None:
            if delta > 0 and node.lock_count == 0:
                self.num_locked += len(node.slots)
            node.lock_count += delta
            if delta < 0 and node.lock_count == 0:
                self.num_locked -= len(node.slots)
            node = node.parent

    def _evictable_leaf(self, node: Node) -> bool:
        return node.parent is not None and not node.children and node.lock_count == 0

    def _nodes(self) -> list[Node]:
        return [n for root in self.roots.values() for n in self._nodes_under(root)]

    @staticmethod
    def _nodes_under(root: Node) -> list[Node]:
        out, stack = [], [root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
