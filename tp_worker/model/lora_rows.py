"""Which LoRA adapter each row of a forward pass runs with (tp_worker): the slot of every
token (-1: the base model alone), as the step's tokens, and later its kept tokens, stand."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

BASE = -1  # NOTE: a row without an adapter


@dataclass(frozen=True)
class LoraRows:
    host: np.ndarray  # [T] int32 each row's adapter slot, BASE for none
    device: torch.device = field(default=torch.device("cpu"))

    @staticmethod
    def of(slots: np.ndarray | None, device: torch.device) -> LoraRows | None:
        """None where no row has an adapter: the forward pass is the base model's."""
        if slots is None or not (slots >= 0).any():
            return None
        return LoraRows(np.ascontiguousarray(slots, dtype=np.int32), device)

    @cached_property
    def slots(self) -> torch.Tensor:
        """[T] int32 on the host (what csrc/lora.cpp reads)."""
        return torch.from_numpy(self.host)

    @cached_property
    def used(self) -> tuple[int, ...]:
        """The slots in use, ascending."""
        return tuple(int(s) for s in np.unique(self.host) if s >= 0)

    @cached_property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, its rows [n] int64 on the device) for each slot in use, ascending (the
        torch path's: csrc/lora.cpp groups the rows itself)."""
        return [
            (s, torch.from_numpy(np.flatnonzero(self.host == s)).to(self.device)) for s in self.used
        ]

    def take(self, index: torch.Tensor | slice | None) -> LoraRows | None:
        """The rows at `index` (a gather of the step's tokens, or a run of them), or these
        where None; None where none of them has an adapter."""
        if index is None:
            return self
        picked = self.host[index] if isinstance(index, slice) else self.host[index.cpu().numpy()]
        return LoraRows.of(picked, self.device)
