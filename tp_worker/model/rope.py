"""Rotary position embeddings, with the scalings Llama- and Qwen-family checkpoints use
(tp_worker).

Frequencies are computed in float32 exactly as `transformers` does, so that positions far
into a long prompt rotate identically on both sides.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SCALINGS = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(
    head_dim: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim / 2] and the factor cos and sin are multiplied by
    (transformers' `attention_scaling`: 1 but for YaRN)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type")
    if not kind:
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling)
    # NOTE: transformers' dynamic NTK picks its frequencies from the longest position of each
    # forward call, so a token's numbers would follow its schedule (LongRoPE's choice is made
    # once per server instead: config.py's longrope_factors).
    raise ValueError(f"rope_type {kind!r} is not supported (supported: {', '.join(SCALINGS)})")


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


def _yarn(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN as transformers' _compute_yarn_parameters computes it, float32 throughout."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # NOTE: transformers' guard against a zero-width ramp
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _longrope(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """LongRoPE as transformers' _compute_longrope_parameters computes it, with the factor set
    config.py's longrope_factors chose."""
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    chosen = scaling["long_factor" if scaling.get("use_long_factor") else "short_factor"]
    ext = torch.tensor(chosen, dtype=torch.float32)
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * theta**shape), float(attention_factor)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class Rotary:
    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any], device: torch.device
    ) -> None:
        inv_freq, self.attention_factor = rope_parameters(head_dim, theta, scaling)
        self.inv_freq = inv_freq.to(device)
        # NOTE: on the CPU, cos and sin of every position so far, float32 [N, D]; see _table.
        self._cos = self._sin = torch.empty(0, head_dim)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [T] -> cos, sin [T, 1, D] in the model's dtype."""
        if positions.device.type != "cpu":
            cos, sin = self._scaled(float32_cos_sin(positions, self.inv_freq))
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
                table = float32_cos_sin(torch.arange(size), self.inv_freq.cpu())
                self._cos, self._sin = self._scaled(table)
            finally:
                torch.set_num_threads(threads)
        return self._cos, self._sin

    def _scaled(self, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """cos and sin times the attention factor, in float32 (transformers' order)."""
        if self.attention_factor == 1.0:
            return cos_sin
        return tuple(c * self.attention_factor for c in cos_sin)


def float32_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [T, D] of positions [T], as transformers computes them."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos and sin [T, 1, R]: the first R of each head rotated, the rest as they
    are (R < D: partial rotary, transformers' apply_rotary_pos_emb)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
