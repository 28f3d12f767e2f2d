"""The CUDA side (tp_worker): Triton kernels with a fixed summation structure (attention.py,
linear.py, rowwise.py; tested on the CPU under TRITON_INTERPRET=1) and the profiling step
that sizes a GPU's KV cache (memory_profile.py)."""
