"""A layer's own attention settings (tp_worker), beside the step's plan that every layer shares.

The plan (model/attention.py) says which keys each token may see in a step; what may differ
from layer to layer is here: Gemma's layers alternate between a sliding window and the whole
context, Gemma 2 soft-caps every score, and gpt-oss's heads have sinks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LayerAttention:
    scale: float  # NOTE: the scores' factor (head_dim ** -0.5, or the family's)
    window: int = 0  # NOTE: keys more than window - 1 positions back unseen; 0: none
    softcap: float = 0.0  # NOTE: > 0: each scaled score s becomes softcap * tanh(s / softcap)
    # NOTE: gpt-oss's sink logits, one per query head of this rank (float32, contiguous): a
    # key of that score and no value in every softmax; None: none
    sinks: torch.Tensor | None = field(default=None, compare=False)
