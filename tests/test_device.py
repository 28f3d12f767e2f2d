"""Which dtype `--dtype auto` picks: bfloat16 where the CPU multiplies it natively."""

from __future__ import annotations

import torch

from tokenmill.tp_worker.device import cpu_has_native_bf16, resolve_dtype


def test_auto_dtype_follows_the_cpu() -> None:
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
