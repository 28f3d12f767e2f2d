"""Rotary position embeddings, with the scalings Llama-family checkpoints use (tp_worker).

Frequencies are computed in float32 exactly as `transformers` does, so that positions far
into a long prompt rotate identically on both sides.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type")
    if not kind:
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3)")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any], device: torch.device
    ) -> None:
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
        # NOTE: on the CPU, cos and sin of every position so far, float32 [N, D]; see _table.
        self._cos = self._sin = torch.empty(0, head_dim)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [T] -> cos, sin [T, 1, D] in the model's dtype."""
        if positions.device.type != "cpu":
            cos, sin = float32_cos_sin(positions, self.inv_freq)
        else:
            cos, sin = self._table(int(positions.max()) + 1 if positions.numel() else 0)
            cos, sin = cos[positions], sin[positions]
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def _table(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU's table, grown to hold `size` positions. NOTE: computed on one thread:
        torch 2.13's CPU cos, split over two threads, sometimes returned values off by up to
        1.5e-4 from the second thread (cos(100) = 0.862375 instead of 0.862319, in about one
        fresh process in eight whose first step came after a pause), and every logprob of a
        prompt that long moved by ~1e-3. A table built once per size by this thread gives
        the same bits every time."""
        if size > len(self._cos):
            size = max(size, 2 * len(self._cos), 1024)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                self._cos, self._sin = float32_cos_sin(torch.arange(size), self.inv_freq.cpu())
            finally:
                torch.set_num_threads(threads)
        return self._cos, self._sin


def float32_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [T, D] of positions [T], as transformers computes them."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
