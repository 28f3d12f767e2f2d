"""Grammar masks on the logits a row samples from (tp_worker).

The controller's bitmask allows, per constrained row, the ids its grammar accepts next; the
others get -inf in the logits sampled from. Raw logprobs are taken from the logits before
any change, so a constrained row's raw numbers are the bits it would have without the mask.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.protocol.arrays import unpack
from tokenmill.protocol.step import GrammarRows


def allowed_ids(bitmask: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[G, W] int32 bitmask -> [G, V] bool (bit i % 32 of word i // 32 allows id i)."""
    if device.type == "cpu":
        # NOTE: numpy's unpackbits: ~20x faster here than shifting int32 words in torch
        words = np.ascontiguousarray(bitmask).view(np.uint8)
        bits = np.unpackbits(words, axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits.view(np.bool_))
    packed = torch.from_numpy(np.ascontiguousarray(bitmask)).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    on = (packed.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]
    return on.flatten(1)[:, :vocab_size].bool()


class GrammarTensors:
    """A step's constrained rows; their bitmask is set once it is known (`with_mask`)."""

    def __init__(self, grammar: GrammarRows, device: torch.device) -> None:
        self.rows = torch.from_numpy(unpack(grammar.rows).astype(np.int64)).to(device)
        self.inline = None if grammar.bitmask is None else unpack(grammar.bitmask)

    def apply(self, logits: torch.Tensor, bitmask: np.ndarray) -> None:
        """logits [B, V] float32, in place: -inf where the row's grammar forbids the id. A row
        that its other changes (a min_tokens ban on eos) left with nothing allowed samples
        uniformly from the grammar's ids: the grammar decides what can come next."""
        allowed = allowed_ids(bitmask, logits.shape[1], logits.device)
        sub = logits[self.rows]  # [G, V]
        masked = sub.masked_fill(~allowed, float("-inf"))
        dead = torch.isneginf(masked).all(dim=1, keepdim=True)  # [G, 1]
        if bool(dead.any()):
            masked = torch.where(dead & allowed, torch.zeros_like(sub), masked)
        logits[self.rows] = masked
