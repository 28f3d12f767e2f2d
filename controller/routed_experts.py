"""Each KV slot's routed experts, for the requests that ask for theirs (controller process;
--enable-return-routed-experts).

The workers send the experts of every token a step computed, in the order of its slots. The
table keeps them by slot, as the KV cache keeps the token's keys and values: a request's
positions read theirs through its slots, so a prefix it found in the cache (computed by
another request, with the same bits: tokenmill's kernels are row-invariant), a chunked
prompt, a preemption's recompute and a speculative step's kept drafts all read what their
tokens' KV was computed with. A slot written again (freed and reused, a rejected draft's)
holds the new token's experts.
"""

from __future__ import annotations

import numpy as np

from tokenmill.protocol.arrays import Array, unpack
from tokenmill.protocol.step import ForwardBatch, RoutingShape


class RoutedExperts:
    def __init__(self, shape: RoutingShape, num_slots: int) -> None:
        self.shape = shape
        # NOTE: int16, as they travel: 2 x moe layers x k bytes a slot (Qwen3-30B-A3B's 48
        # layers x 8: 768 bytes, 77 MB for 100,000 slots)
        self.table = np.zeros((num_slots, len(shape.moe_layers), shape.top_k), np.int16)
        self._moe_rows = np.asarray(shape.moe_layers, np.int64)

    @staticmethod
    def step_slots(batch: ForwardBatch) -> np.ndarray:
        """The slots of the tokens a step computes, in the order the workers log them."""
        slots = unpack(batch.out_slots)
        if batch.decode_slots is None:
            return slots
        return np.concatenate((slots, unpack(batch.decode_slots).reshape(-1)))

    def record(self, slots: np.ndarray, routed: Array | None) -> None:
        """A step's result: routed [S, moe layers, k] int16 of its slots [S]."""
        if routed is None:
            raise RuntimeError("--enable-return-routed-experts: a step came back without them")
        experts = unpack(routed)
        if experts.shape != (len(slots), *self.table.shape[1:]):
            raise RuntimeError(f"routed experts {experts.shape} for {len(slots)} slots")
        self.table[slots] = experts

    def gather(self, slots: list[int]) -> np.ndarray:
        """[N, num_layers, k] int16 the experts of the tokens in `slots`, -1 in the dense
        layers (SGLang's rows: every layer of the model)."""
        out = np.full((len(slots), self.shape.num_layers, self.shape.top_k), -1, np.int16)
        out[:, self._moe_rows] = self.table[np.asarray(slots, np.int64)]
        return out
