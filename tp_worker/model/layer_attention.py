"""A layer's own attention settings (tp_worker), beside the step's plan that every layer shares.

The plan (model/attention.py) says which keys each token may see in a step; what may differ
from layer to layer is here: Gemma's layers alternate between a sliding window and the whole
context, and Gemma 2 soft-caps every score.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerAttention:
    scale: float  # NOTE: the scores' factor (head_dim ** -0.5, or the family's)
    window: int = 0  # NOTE: keys more than window - 1 positions back unseen; 0: none
    softcap: float = 0.0  # NOTE: > 0: each scaled score s becomes softcap * tanh(s / softcap)
