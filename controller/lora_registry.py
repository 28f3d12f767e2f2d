"""The LoRA adapters the server holds (controller process, --enable-lora): each one's name,
the ranks' slot it is in, its version and its prefix-cache space.

A request names its adapter (GenerateRequest.lora_name) and is bound at arrival to the
adapter's slot and cache space (radix_cache.py): prefixes cached with one adapter's load are
never read by another's, nor by the base model's. Replacing an adapter in place gives it a
new space (what its old weights computed is dropped) and the next version.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tokenmill.controller.radix_cache import BASE_SPACE


@dataclass
class Adapter:
    name: str
    path: str
    slot: int
    space: int  # its cache space: one per load
    version: int = 1  # 1 at its first load, one more at each load_inplace


class LoraRegistry:
    def __init__(self, max_loras: int, modules: tuple[tuple[str, str], ...] = ()) -> None:
        """modules: (name, path) of the adapters the ranks loaded at start, slots 0, 1, ..."""
        assert len(modules) <= max_loras, (modules, max_loras)
        self.max_loras = max_loras
        self._spaces = itertools.count(BASE_SPACE + 1)
        self.adapters: dict[str, Adapter] = {
            name: Adapter(name, path, slot, next(self._spaces))
            for slot, (name, path) in enumerate(modules)
        }

    def get(self, name: str) -> Adapter | None:
        return self.adapters.get(name)

    def free_slot(self) -> int | None:
        used = {a.slot for a in self.adapters.values()}
        return next((s for s in range(self.max_loras) if s not in used), None)

    def add(self, name: str, path: str, slot: int) -> Adapter:
        adapter = self.adapters[name] = Adapter(name, path, slot, next(self._spaces))
        return adapter

    def replace(self, name: str, path: str) -> tuple[Adapter, int]:
        """The adapter `name` with new weights from `path`: (it, its old cache space)."""
        adapter = self.adapters[name]
        old = adapter.space
        adapter.path, adapter.space = path, next(self._spaces)
        adapter.version += 1
        return adapter, old

    def remove(self, name: str) -> Adapter:
        return self.adapters.pop(name)
