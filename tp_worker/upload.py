"""A step's host arrays on its device, in one copy on a GPU (tp_worker).

A step's inputs are ~25 small host arrays (ids, positions, slots, row indices, sampling
parameters). On a GPU, `torch.from_numpy(a).to(device)` for each is a copy from pageable
memory that the host waits for. Here each array is written into one pinned host buffer and
handed out at once as a view of one device buffer at the same offset; flush() queues the one
copy, which the stream runs before any kernel that reads those views. Each step takes fresh
buffers from torch's caching allocators, so views a later step still holds (the persistent
batch's row inputs) are never overwritten, and a pinned buffer is reused only once its copy
is done (torch records the copy's event). On the CPU the arrays are used where they lie,
unless `staged` asks for the GPU's path (tests run it there).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

# NOTE: the dtypes a step's arrays come in, both ways
NUMPY_OF: dict[torch.dtype, np.dtype] = {
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.float32: np.dtype(np.float32),
    torch.bool: np.dtype(np.bool_),
}
TORCH_OF = {numpy: torch_dtype for torch_dtype, numpy in NUMPY_OF.items()}
ARENA_BYTES = 1 << 20  # NOTE: a decode step of 64 rows takes ~10 KiB; a prefill chunk more
ALIGN = 64  # NOTE: every view starts aligned for any dtype (view(dtype) requires it)


class Upload:
    def __init__(self, device: torch.device, staged: bool | None = None) -> None:
        self.device = device
        self.staged = device.type != "cpu" if staged is None else staged
        self._host: np.ndarray | None = None  # the pinned buffer's bytes, uint8
        self._pinned: torch.Tensor | None = None
        self._on_device: torch.Tensor | None = None
        self._used = 0

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        """A writable host array (int64, int32, float32 or bool) as a tensor on the device:
        the same memory on the CPU; on a GPU a view whose values arrive with flush()."""
        if not array.size:
            return empty(array.shape, TORCH_OF[array.dtype], self.device)
        if not self.staged:
            tensor = torch.from_numpy(array)
            return tensor if self.device.type == "cpu" else tensor.to(self.device)
        data = np.ascontiguousarray(array)
        if self._host is None or self._used + data.nbytes > len(self._host):
            self.flush()
            self._new_buffers(max(ARENA_BYTES, data.nbytes))
        assert self._host is not None and self._on_device is not None
        at, end = self._used, self._used + data.nbytes
        self._host[at:end] = data.reshape(-1).view(np.uint8)
        self._used = -(-end // ALIGN) * ALIGN
        return self._on_device[at:end].view(TORCH_OF[data.dtype]).view(data.shape)

    def cast(self, values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """A copy of `values` (a message's read-only bytes too) in `dtype`, handed out as
        __call__ hands out an array."""
        return self(np.asarray(values).astype(NUMPY_OF[dtype]))

    def flush(self) -> None:
        """Queues the copy of every array handed out since the last flush."""
        if self._pinned is not None and self._on_device is not None and self._used:
            self._on_device[: self._used].copy_(self._pinned[: self._used], non_blocking=True)
        self._host = self._pinned = self._on_device = None
        self._used = 0

    def _new_buffers(self, size: int) -> None:
        self._pinned = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self._host = self._pinned.numpy()
        self._on_device = torch.empty(size, dtype=torch.uint8, device=self.device)


@functools.cache
def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """NOTE: made once: a decode step has ~10 empty inputs (no fills, no prompt scores, no
    caller-given ids), and nothing writes into an empty tensor."""
    return torch.empty(shape, dtype=dtype, device=device)
