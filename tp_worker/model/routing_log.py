"""The experts each token of a forward pass was routed to, kept for the step's result
(tp_worker; --enable-return-routed-experts).

Every MoE layer adds its tokens' top-k ids as it routes them (in passes, for a long chunk);
the runner takes them after each forward pass as one [T, moe layers, k] int16 array, the
tokens in the order of the pass.
"""

from __future__ import annotations

import numpy as np
import torch


class RoutingLog:
    def __init__(self, num_moe_layers: int, top_k: int) -> None:
        self.top_k = top_k
        self._parts: list[list[torch.Tensor]] = [[] for _ in range(num_moe_layers)]

    def add(self, layer: int, ids: torch.Tensor) -> None:
        """ids [t, k]: the next t tokens' experts in the layer-th MoE layer."""
        self._parts[layer].append(ids)

    def take(self) -> np.ndarray:
        """[T, moe layers, k] int16 of the pass since the last take; then empty again."""
        layers = [
            torch.cat(parts) if parts else torch.empty(0, self.top_k, dtype=torch.int64)
            for parts in self._parts
        ]
        for parts in self._parts:
            parts.clear()
        stacked = torch.stack(layers, dim=1).to(torch.int16)
        return stacked.cpu().numpy()
