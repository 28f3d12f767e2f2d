"""Host memory that a CPU worker frees stays with the process for the next step (tp_worker).

glibc hands a freed block back to the OS when it was mapped on its own (anything above the
mmap threshold, which rises only as far as 32 MiB) or when it leaves enough free memory at
the heap's top, so the next step maps the same activations afresh and takes a page fault
for every 4 KiB it touches first. Measured on the 2-core Xeon (medium checkpoint's gate_up
with its SiLU epilogue, bfloat16): ~1,070 minor faults a call at 2,048 rows, ~14,400 at 8,192,
where the product itself takes 7-70 ms; the faults cost 2-16 ms of that (and ~150,000-220,000
faults a 256-item scoring request). With both thresholds raised a step reuses what the last
one freed: the process keeps its peak steps' memory, as a caching allocator would. NOTE: not
at once: torch's 64-byte-aligned allocations ask for a little more than the block they freed,
so the first few steps of a shape grow the heap until freed blocks merge (that gate_up on
8,192 rows: 0 faults from its 4th-7th call on, the process 130-260 MB larger than without;
tests/test_host_memory.py). Blocks above KEEP_BYTES (the KV cache) are still mapped on their
own.
"""

from __future__ import annotations

import ctypes
import logging

import torch

logger = logging.getLogger(__name__)

# NOTE: mallopt's parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Raises glibc's mmap and trim thresholds to KEEP_BYTES for this process; returns whether
    the C library took both (False where it is not glibc: nothing changes there)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    took = bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    )
    if not took:
        logger.info("the C library kept its own malloc thresholds")
    return took


def give_memory_back(device: torch.device) -> None:
    """Memory freed a moment ago back to the system, though keep_freed_memory keeps it
    otherwise: malloc_trim on the host (glibc), the caching allocator's blocks on a GPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        logger.info("no malloc_trim here: freed memory stays with the process")
