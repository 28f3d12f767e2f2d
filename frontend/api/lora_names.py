"""The LoRA adapters a request may name (main process, --enable-lora): each one's path and
weight version as the engine last confirmed them (the LoRA routes keep this current)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraNames:
    paths: dict[str, str] = field(default_factory=dict)  # name -> the directory it came from
    # name -> the weight_version its requests' responses carry: the load's own, else the
    # number of times it was loaded ("1", "2", ... with load_inplace)
    versions: dict[str, str] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def of(modules: tuple[tuple[str, str], ...]) -> LoraNames:
        names = LoraNames()
        for name, path in modules:
            names.loaded(name, path)
        return names

    def __contains__(self, name: object) -> bool:
        return name in self.paths

    def loaded(self, name: str, path: str, version: str | None = None) -> None:
        self.loads[name] = self.loads.get(name, 0) + 1
        self.paths[name] = path
        self.versions[name] = version if version is not None else str(self.loads[name])

    def unloaded(self, name: str) -> None:
        for held in (self.paths, self.versions, self.loads):
            held.pop(name, None)
