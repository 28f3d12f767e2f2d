"""The LoRA adapters a request may name (main process, --enable-lora): each one's path and
version as the engine last confirmed them (the LoRA routes keep this current)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraNames:
    paths: dict[str, str] = field(default_factory=dict)  # name -> the directory it came from
    versions: dict[str, int] = field(default_factory=dict)  # name -> 1, 2, ... (load_inplace)

    @staticmethod
    def of(modules: tuple[tuple[str, str], ...]) -> LoraNames:
        return LoraNames(dict(modules), dict.fromkeys((name for name, _ in modules), 1))

    def __contains__(self, name: object) -> bool:
        return name in self.paths

    def loaded(self, name: str, path: str) -> None:
        self.versions[name] = self.versions.get(name, 0) + 1
        self.paths[name] = path

    def unloaded(self, name: str) -> None:
        self.paths.pop(name, None)
        self.versions.pop(name, None)
