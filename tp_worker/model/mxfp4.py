"""gpt-oss's MXFP4 expert weights, dequantized at load (tp_worker).

OCP's microscaling format as gpt-oss's checkpoints hold it: a tensor W [..., rows, cols] is
`<name>_blocks` [..., rows, cols / 32, 16] uint8, two 4-bit E2M1 values a byte (the low
nibble first), and `<name>_scales` [..., rows, cols / 32] uint8, each block of 32 values'
power of two biased by 127. Every value of the format is exact in bfloat16 and float32, so
the weights served are the file's model exactly (transformers' dequantization gives the same
values); the kernels then run them as the checkpoint's dtype. Kept in their blocks in memory
is issue 59's work, not this file's.
"""

from __future__ import annotations

import torch

# NOTE: E2M1's sixteen values by their 4-bit code (sign bit first)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # NOTE: values sharing one scale


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., rows, G, 16] uint8 and scales [..., rows, G] uint8 -> W [..., rows, G * 32]
    float32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} / {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}"
        )
    table = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)
    values = values.flatten(-2)  # NOTE: [..., G, 32], the low nibble of each byte first
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)
