"""The CPU kernels in csrc/, compiled once per machine and loaded with ctypes (tp_worker).

NOTE: a plain shared library, not a torch extension: it needs no torch headers (so it builds
in seconds with the machine's g++), takes raw pointers, and shares torch's OpenMP runtime
(the loader reuses the libgomp.so.1 that torch has already loaded). It is built with
-march=native into a cache keyed by the source, the flags and the CPU's feature flags (the
code fixes its own reduction order, so what -march changes is speed, never a result);
`python -m tokenmill.tp_worker.cpu.kernels` builds it ahead of time (make install does).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "attention.cpp",
        "attention_amx.cpp",
        "linear.cpp",
        "linear_amx.cpp",
        "rms_norm.cpp",
        "activation.cpp",
        "rope.cpp",
        "log_softmax.cpp",
        "sample.cpp",
        "layer_stack.cpp",
        "route.cpp",
        "moe.cpp",
        "lora.cpp",
    )
)
HEADERS = tuple(
    CSRC / name
    for name in (
        "amx.h",
        "argmax.h",
        "attention_common.h",
        "bf16.h",
        "dequant.h",
        "epilogue.h",
        "exp.h",
        "kernels.h",
        "panel_queue.h",
        "quant_exact.h",
        "quant_kernels.h",
        "silu.h",
    )
)
# NOTE: -ffp-contract=off and no -ffast-math: the compiler may vectorise but never fuse or
# reassociate, so the reduction order written in the source is the one that runs.
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-std=c++17", "-fPIC")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "tokenmill" / "kernels"


def cpu_flags() -> list[str]:
    """This CPU's feature flags (avx512f, avx512_bf16, amx_bf16, ...); [] where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return []
    return line.partition(":")[2].split()


def _key(compiler: str, arch: str) -> str:
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join((compiler, arch, *FLAGS, *cpu_flags())).encode())
    return digest.hexdigest()[:16]


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError(
            "tokenmill's CPU kernels need a C++ compiler: install g++ (Debian: apt-get install "
            "g++) or set CXX"
        )
    return compiler


def build(arch: str = "native") -> Path:
    """The compiled library's path, compiling it first if this machine has no copy yet.
    `arch` is gcc's -march: the tests build an x86-64-v2 copy (no AVX at all) to show that
    it computes the same bits as the native one."""
    compiler = _compiler()
    target = cache_root() / _key(compiler, arch) / "libtokenmill_cpu.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: compiled to a temporary name and renamed, so ranks that build at once never load
    # a half-written file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    command = [compiler, f"-march={arch}", *FLAGS, "-shared", *map(str, SOURCES), "-o", tmp]
    logger.info("building CPU kernels: %s", " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building tokenmill's CPU kernels failed:\n{result.stderr}")
    os.replace(tmp, target)
    return target


_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int
_F = ctypes.c_float


@functools.cache
def library() -> ctypes.CDLL:
    """This machine's build, loaded once per process."""
    return load(build())


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    # NOTE: the soft-cap, a float, rides in a vector register: builds of older sources,
    # which lack it, read the same integer arguments and ignore it.
    lib.tm_paged_attention.argtypes = [*[_P] * 9, *[_I] * 8, _F, _F, _P, ctypes.c_int]
    lib.tm_paged_attention.restype = ctypes.c_int
    lib.tm_paged_attention_amx.argtypes = lib.tm_paged_attention.argtypes
    lib.tm_paged_attention_amx.restype = ctypes.c_int
    lib.tm_linear.argtypes = [_P, _I, _I, _I, _P, _I, _P, _P, _I, _C, _C, _P, _C]
    lib.tm_linear.restype = ctypes.c_int
    lib.tm_linear_amx.argtypes = lib.tm_linear.argtypes
    lib.tm_linear_amx.restype = ctypes.c_int
    # NOTE: the two with the product that runs next (csrc/kernels.h); builds of older
    # sources (benchmarks/kernels/kernel_ab.py loads them) lack them.
    for name in ("tm_linear_then", "tm_linear_amx_then"):
        if hasattr(lib, name):
            getattr(lib, name).argtypes = [*lib.tm_linear.argtypes, _P, _I, _I]
            getattr(lib, name).restype = ctypes.c_int
    if hasattr(lib, "tm_quant_linear_then"):
        lib.tm_quant_linear_then.argtypes = lib.tm_linear_then.argtypes
        lib.tm_quant_linear_then.restype = ctypes.c_int
        lib.tm_quant_rows.argtypes = [_P, _P, _I, _I, _C, _P]
        lib.tm_quant_rows.restype = ctypes.c_int
    lib.tm_amx_ready.argtypes = []
    lib.tm_amx_ready.restype = ctypes.c_int
    lib.tm_rms_norm.argtypes = [_P, _P, _P, _I, _I, _I, _F, _C, _C]
    lib.tm_rms_norm.restype = ctypes.c_int
    if hasattr(lib, "tm_head_norm"):  # NOTE: as the two above
        lib.tm_head_norm.argtypes = [_P, *[_I] * 6, _P, _P, ctypes.c_float, ctypes.c_int]
        lib.tm_head_norm.restype = ctypes.c_int
        lib.tm_norm_add.argtypes = [_P, _P, _P, _I, _I, _I, ctypes.c_float, ctypes.c_int]
        lib.tm_norm_add.restype = ctypes.c_int
        lib.tm_cast_rows.argtypes = [_P, _P, _I, _I, _I, ctypes.c_int]
        lib.tm_cast_rows.restype = ctypes.c_int
    if hasattr(lib, "tm_slice_sums"):
        lib.tm_slice_sums.argtypes = [_P, _I, _I, _I, _P, _C]
        lib.tm_slice_sums.restype = ctypes.c_int
        lib.tm_scale_slices.argtypes = [_P, _I, _I, _I, _P, _I, _P, _F, _C]
        lib.tm_scale_slices.restype = ctypes.c_int
    if hasattr(lib, "tm_glu_mul"):
        lib.tm_glu_mul.argtypes = [_P, _P, _I, _I, *[ctypes.c_int] * 3]
        lib.tm_glu_mul.restype = ctypes.c_int
        lib.tm_glu_mul_panels.argtypes = [_P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int]
        lib.tm_glu_mul_panels.restype = ctypes.c_int
        lib.tm_soft_cap.argtypes = [_P, _I, _F]
        lib.tm_soft_cap.restype = None
    if hasattr(lib, "tm_sigmoid"):
        lib.tm_sigmoid.argtypes = [_P, _I]
        lib.tm_sigmoid.restype = None
    lib.tm_rope_store.argtypes = [*[_P] * 7, *[_I] * 6, ctypes.c_int]
    lib.tm_rope_store.restype = ctypes.c_int
    if hasattr(lib, "tm_rope_store_partial"):
        lib.tm_rope_store_partial.argtypes = [*[_P] * 7, *[_I] * 7, ctypes.c_int]
        lib.tm_rope_store_partial.restype = ctypes.c_int
    lib.tm_log_softmax_stats.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I, _P, _P]
    lib.tm_log_softmax_stats.restype = None
    lib.tm_row_argmax.argtypes = [_P, _I, _I, _I, _P, _P]
    lib.tm_row_argmax.restype = None
    lib.tm_sample.argtypes = [_P, _I, _I, _P, _I, *[_P] * 7]
    lib.tm_sample.restype = None
    lib.tm_layer_stack.argtypes = [
        _P,
        _I,
        _P,
        _F,
        _F,
        _F,
        _P,
        _I,
        *[_P] * 6,
        _I,
        *[_P] * 4,
        _I,
        _P,
        _P,  # NOTE: the tokens' adapter slots (--enable-lora), or null
        _I,
    ]
    lib.tm_layer_stack.restype = ctypes.c_int
    if hasattr(lib, "tm_route"):
        lib.tm_route.argtypes = [_P, _I, _I, _I, _C, _P, _P]
        lib.tm_route.restype = ctypes.c_int
    if hasattr(lib, "tm_moe_experts"):
        lib.tm_moe_experts.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, _I, _I, _C]
        lib.tm_moe_experts.argtypes += [_C, _C, _P, _P, _I, _I]
        lib.tm_moe_experts.restype = ctypes.c_int
    if hasattr(lib, "tm_lora"):
        lib.tm_lora.argtypes = [_P, _I, _I, _I, _C, _P, _I, _P, _P, _I, _P, _I, _C, _C]
        lib.tm_lora.restype = ctypes.c_int
    lib.tm_linear_isa.argtypes = []
    lib.tm_linear_isa.restype = ctypes.c_int
    return lib


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build())
