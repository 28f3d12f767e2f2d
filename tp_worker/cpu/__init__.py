"""The CPU kernels (tp_worker): the C++ in csrc/, compiled once per machine and loaded with
ctypes (kernels.py), and their Python side: packed linear layers and row ops (ops.py), paged
attention (attention.py), the layer stack as one native call (layer_stack.py), and the host
memory they run in (host_memory.py, huge_pages.py)."""
