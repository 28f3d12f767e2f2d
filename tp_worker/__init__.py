"""The tensor-parallel worker processes: model shards, KV cache, sampling, logprobs.

NOTE: set before anything in this package imports torch (MKL reads it at its first call):
MKL's strict reproducibility mode makes a GEMM's result independent of the thread count and
of memory alignment. Our fixed 32-row blocks (parallel.py) fix the shape it sees; our own
kernels (csrc/) fix everything else. Set MKL_CBWR yourself to override it.
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
