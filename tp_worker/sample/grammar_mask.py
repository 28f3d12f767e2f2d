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


def forbidden_ids(bitmask: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[G, W] int32 bitmask -> [G, V] bool, True where the bit is clear (bit i % 32 of word
    i // 32 allows id i)."""
    if device.type == "cpu":
        # NOTE: numpy's unpackbits of the inverted bytes: one pass, ~20x faster here than
        # shifting int32 words in torch
        words = ~np.ascontiguousarray(bitmask).view(np.uint8)
        bits = np.unpackbits(words, axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits.view(np.bool_))
    return ~unpack_on_device(bitmask, vocab_size, device)


def unpack_on_device(bitmask: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[G, V] bool allowed ids, the way for a GPU: the words cross, the bits spread there."""
    packed = torch.from_numpy(np.ascontiguousarray(bitmask)).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    on = (packed.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]
    return on.flatten(1)[:, :vocab_size].bool()


class GrammarTensors:
    """A step's constrained rows; their bitmask comes with `apply`, once it is known (in the
    batch, or in the GrammarMask message after it)."""

    def __init__(self, grammar: GrammarRows, device: torch.device, per_iteration: bool) -> None:
        self.rows = torch.from_numpy(unpack(grammar.rows).astype(np.int64)).to(device)  # [G]
        # NOTE: a step that verifies drafts has masks for each of its iterations
        self.per_iteration = per_iteration

    def apply(self, logits: torch.Tensor, bitmask: np.ndarray, may_empty: bool) -> None:
        """logits [B, V] float32, in place: -inf where the row's grammar forbids the id.
        may_empty: a change before (a min_tokens ban on eos) may have left a row nothing the
        grammar allows; such a row samples uniformly from the grammar's ids (the grammar
        decides what can come next)."""
        forbidden = forbidden_ids(bitmask, logits.shape[1], logits.device)
        every = len(self.rows) == len(logits)
        sub = logits if every else logits[self.rows]  # [G, V]
        sub.masked_fill_(forbidden, float("-inf"))
        if may_empty:
            dead = torch.isneginf(sub).all(dim=1)  # [G]
            if bool(dead.any()):
                fresh = torch.zeros_like(sub[dead]).masked_fill_(forbidden[dead], float("-inf"))
                sub[dead] = fresh
        if not every:
            logits[self.rows] = sub
