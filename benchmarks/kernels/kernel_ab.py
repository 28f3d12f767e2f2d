"""A/B of the CPU kernels in one process: the working tree's csrc/ against the same sources at
a git revision, both built here and called alternately on the same inputs, minimum (and 25th
percentile and median) over the rounds, and whether the two give the same bits.

On a shared host whose speed swings 2x within minutes, two runs of a benchmark compare noise;
two builds called in turn within one run compare the code. Cases: bfloat16 attention at the
medium checkpoint's shapes (64 scoring items of 32 tokens after one shared 1,024-token query,
64 decode rows at a context of 300, 8 prompts of 256; each also with each row's slots in runs,
as a fresh server's slot pool hands them out, the others scattered; one decode row at a context
of 7,000, one user's long conversation, also with SmolLM2's 3 KV heads) and bfloat16 linear
layers (a prefill's gate/up and down products, each gate/up also with its fused silu(gate) x up
epilogue, a scoring step's 8,192-row down product, a 64-row decode product, and a whole decode
step's products at 1, 32 and 64 rows with weights of their own, streamed from memory; on the
AMX kernels where the machine has tiles, else on the AVX-512 ones) and a decode step's small
ones (RMSNorm of 32 and 64 rows, RoPE with the KV write of 32 and 64 tokens), and random
sampling of 32 rows (flat and peaked logits), their greedy argmax and their log-softmax
statistics with the top 5. `--dtype float32` runs the linear cases in float32 (the AVX-512
kernels), and TOKENMILL_CPU_AMX=0 the bfloat16 ones on the AVX-512 kernels where the machine
has tiles.

--busy N starts N stand-ins for the server's other processes (frontend, detokenizer,
controller, the client) for the run: each wakes every few milliseconds and burns 0.5 ms of CPU
at niceness 10, as they do on the model's cores under load. Then the median says more than the
minimum: how much of a stolen core each build turns into lost time.

    python benchmarks/kernels/kernel_ab.py [--against HEAD] [--rounds 20]
        [--only attention|linear|small|sampling] [--busy N] [--dtype float32]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from cpu_kernels import DIM, HEADS, HIDDEN, KV_HEADS, LAYER, LAYERS, attention_case

import tokenmill.tp_worker.cpu.attention as attention_cpu
from tokenmill.tp_worker.cpu import kernels as cpu_kernels
from tokenmill.tp_worker.cpu.ops import DTYPE_CODES, amx_enabled, gate_up_panels, pack
from tokenmill.tp_worker.model.rope import Rotary

CSRC = Path(cpu_kernels.__file__).parent / "csrc"
Out = TypeVar("Out")  # what a case writes into: a tensor, or a list of them
# (M, K, N, glu): glu is an MLP's gate_up with the silu(gate) x up epilogue (N / 2 columns out)
LINEAR_SHAPES = [
    (2048, 768, 4096, False),
    (2048, 768, 4096, True),
    (2048, 2048, 768, False),
    (8192, 2048, 768, False),  # a scoring step's down projection: x (32 MiB) past L2 and L3
    (64, 768, 4096, False),
    (64, 768, 4096, True),
]
SMALL_ROWS = (32, 64)  # a decode step's batch
STREAMED_ROWS = (1, 32, 64)  # a decode step's products with its weights streamed from memory
ATTENTION_CASES = {
    "attention, 64 x 32 after a shared 1024": (64, 1024, 32, True, False),
    "attention, the same, slots in runs": (64, 1024, 32, True, True),
    "attention, 64 decode rows x 300": (64, 300, 1, False, False),
    "attention, 64 decode rows x 300, slots in runs": (64, 300, 1, False, True),
    "attention, 8 x 256 prompt": (8, 0, 256, False, False),
    "attention, 8 x 256 prompt, slots in runs": (8, 0, 256, False, True),
    "attention, 1 decode row x 7000, slots in runs": (1, 7000, 1, False, True),
    "attention, the same, 3 KV heads (SmolLM2's)": (1, 7000, 1, False, True, 3),
}


def sources_at(rev: str, into: Path) -> Path:
    """csrc/ as it is at `rev` (every file it had then: headers come and go), under `into`."""
    root = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=CSRC, capture_output=True, text=True
    ).stdout.strip()
    into.mkdir(parents=True)
    # NOTE: csrc/ was tp_worker/csrc/ before tp_worker/ took its subfolders (e0e5c1b)
    for prefix in (CSRC.relative_to(root).as_posix(), "tp_worker/csrc"):
        listed = subprocess.run(
            ["git", "ls-tree", "--name-only", f"{rev}:{prefix}"],
            cwd=root,
            capture_output=True,
            text=True,
        )
        if listed.returncode == 0:
            break
    listed.check_returncode()
    names = listed.stdout.split()
    for name in names:
        text = subprocess.run(
            ["git", "show", f"{rev}:{prefix}/{name}"], cwd=root, capture_output=True, check=True
        ).stdout
        (into / name).write_bytes(text)
    return into


def build(csrc: Path, out: Path) -> ctypes.CDLL:
    """All of csrc's sources into one library, with the flags the worker's build uses."""
    sources = [str(csrc / p.name) for p in cpu_kernels.SOURCES]
    command = ["g++", "-march=native", *cpu_kernels.FLAGS, "-shared", *sources, "-o", str(out)]
    subprocess.run(command, check=True)
    return cpu_kernels.load(out)


def timed(fn: Callable[[], torch.Tensor], times: list[float]) -> torch.Tensor:
    started = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - started)
    return out


def attention_runs(libs: list[ctypes.CDLL]) -> dict[str, list[Callable[[], torch.Tensor]]]:
    """Each case's call, once per build: the plan calls whichever library it is handed."""
    runs = {}
    for name, (rows, context, new, shared, in_runs, *kv_heads) in ATTENTION_CASES.items():
        fn = attention_case(rows, context, new, shared, in_runs, *kv_heads)

        def with_lib(lib: ctypes.CDLL, fn: Callable[[], object] = fn) -> torch.Tensor:
            attention_cpu.library = lambda: lib  # type: ignore[assignment]
            out = fn()
            assert isinstance(out, torch.Tensor)
            return out

        runs[name] = [lambda lib=lib, f=with_lib: f(lib) for lib in libs]
    return runs


def per_build(
    libs: list[ctypes.CDLL],
    outs: list[Out],
    call: Callable[[ctypes.CDLL, Out], torch.Tensor],
) -> list[Callable[[], torch.Tensor]]:
    """One case's call for each build, each writing its own output (allocated once: page
    faults are not the kernel's time)."""
    return [lambda lib=lib, out=out: call(lib, out) for lib, out in zip(libs, outs, strict=True)]


# The product that runs next (its packed weights, n, k), for the builds that stream its first
# panels in under this one's last (tm_linear_then, tm_linear_amx_then).
Then = tuple[torch.Tensor, int, int]


def linear_call(
    amx: bool, x: torch.Tensor, w: torch.Tensor, n: int, glu: bool, then: Then | None = None
) -> Callable[[ctypes.CDLL, torch.Tensor], torch.Tensor]:
    """One product through the AMX kernel (where the machine has tiles and x is bfloat16) or
    the AVX-512 one, in x's dtype; told of the product after it where the build takes that."""

    def call(lib: ctypes.CDLL, out: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape
        # NOTE: the residual (null) and glu are past older builds' signature: they ignore
        # them (a glu case needs a build that has it).
        args = (x.data_ptr(), rows, k, k, w.data_ptr(), n, None, out.data_ptr(), out.shape[1])
        code = DTYPE_CODES[x.dtype]
        args += (code, code, None, int(glu))
        name = "tm_linear_amx" if amx else "tm_linear"
        if then is not None and hasattr(lib, name + "_then"):
            fn = getattr(lib, name + "_then")
            args += (then[0].data_ptr(), then[1], then[2])
        else:
            fn = getattr(lib, name)
        assert fn(*args) == 0
        return out

    return call


def linear_runs(
    libs: list[ctypes.CDLL], amx: bool, dtype: torch.dtype
) -> dict[str, list[Callable[[], torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    runs = {}
    amx = amx and dtype == torch.bfloat16
    kind = ("AMX" if amx else "AVX-512") + ("" if dtype == torch.bfloat16 else ", float32")
    for m, k, n, glu in LINEAR_SHAPES:
        x = torch.randn(m, k, generator=gen).to(dtype)
        weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
        w = pack(gate_up_panels(weight) if glu else weight)
        cols = n // 2 if glu else n
        name = f"{'gate_up + silu' if glu else 'linear'} ({kind}) [{m} x {k} x {n}]"
        outs = [torch.empty(m, cols, dtype=dtype) for _ in libs]
        runs[name] = per_build(libs, outs, linear_call(amx, x, w, n, glu))
    for rows in STREAMED_ROWS:
        runs[f"decode step ({kind}), {rows} rows, streamed"] = streamed_runs(libs, amx, rows, dtype)
    return runs


def streamed_runs(
    libs: list[ctypes.CDLL], amx: bool, rows: int, dtype: torch.dtype
) -> list[Callable[[], torch.Tensor]]:
    """Every projection of the medium checkpoint's 12 layers at `rows` rows, each weight its
    own (~150 MB: they stream from memory, as in a decode step), each told of the next as
    layer_stack.cpp tells them; the last layer's down projection is the output."""
    gen = torch.Generator().manual_seed(rows)
    shapes = LAYER * LAYERS
    weights = [pack((torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)) for k, n in shapes]
    calls = []
    for i, (k, n) in enumerate(shapes):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        then = (weights[i + 1], shapes[i + 1][1], shapes[i + 1][0]) if i + 1 < len(shapes) else None
        calls.append((linear_call(amx, x, weights[i], n, False, then), n))

    def call(lib: ctypes.CDLL, outs: list[torch.Tensor]) -> torch.Tensor:
        for (fn, _), out in zip(calls, outs, strict=True):
            fn(lib, out)
        return outs[-1]

    outs = [[torch.empty(rows, n, dtype=dtype) for _, n in calls] for _ in libs]
    return per_build(libs, outs, call)


def norm_runs(libs: list[ctypes.CDLL], rows: int) -> list[Callable[[], torch.Tensor]]:
    """RMSNorm of `rows` bfloat16 rows; each build writes its own output, allocated once.
    NOTE: builds before b0d9189 take no output row stride, so they read this call's stride
    as the dtype and refuse it: this case then stops the run (`--only` another group skips it).
    The input is bfloat16, which builds before and after the float32 residual stream take
    (the model now passes float32); the weight bfloat16, or float32 for builds that have
    tm_glu_mul (from b1d8059 every norm weight is float32)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    weight = torch.randn(HIDDEN, generator=gen).bfloat16()
    code = DTYPE_CODES[x.dtype]

    wide = weight.float()

    def call(lib: ctypes.CDLL, out: torch.Tensor) -> torch.Tensor:
        w = wide if hasattr(lib, "tm_glu_mul") else weight
        status = lib.tm_rms_norm(
            x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, HIDDEN, HIDDEN, 1e-5, code, code
        )
        assert status == 0, "a build before b0d9189: tm_rms_norm takes no out_stride there"
        return out

    outs = [torch.empty_like(x) for _ in libs]
    return per_build(libs, outs, call)


def rope_runs(libs: list[ctypes.CDLL], rows: int) -> list[Callable[[], torch.Tensor]]:
    """RoPE of `rows` tokens' fused q/k/v with the keys and values written to their slots;
    each build writes its own queries and cache, allocated once."""
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).bfloat16()
    positions = torch.randint(0, 300, (rows,), generator=gen)
    cos_sin = Rotary(DIM, 500000.0, {}, torch.device("cpu")).cos_sin(positions, qkv.dtype)
    cos, sin = (c.reshape(rows, DIM).contiguous() for c in cos_sin)
    slots = torch.randperm(8192, generator=gen)[:rows].contiguous()
    code = DTYPE_CODES[qkv.dtype]

    def call(lib: ctypes.CDLL, out: torch.Tensor) -> torch.Tensor:
        # NOTE: one buffer holds the queries and the cache, so the result is a single tensor.
        q, kv = out[: rows * HEADS * DIM], out[rows * HEADS * DIM :].view(2, KV_HEADS, -1, DIM)
        k, v = kv.unbind(0)
        ptrs = [t.data_ptr() for t in (qkv, cos, sin, slots, q, k, v)]
        lib.tm_rope_store(*ptrs, rows, HEADS, KV_HEADS, DIM, k.stride(0), k.stride(1), code)
        return out

    size = rows * HEADS * DIM + 2 * KV_HEADS * 8192 * DIM
    outs = [torch.zeros(size, dtype=qkv.dtype) for _ in libs]
    return per_build(libs, outs, call)


def sample_runs(
    libs: list[ctypes.CDLL], logits: torch.Tensor, temperature: float, top_p: float
) -> list[Callable[[], torch.Tensor]]:
    """Random sampling of every row of `logits` (seeds and positions fixed): the ids."""
    rows = logits.shape[0]
    index, seeds, positions = torch.arange(rows), torch.arange(rows), torch.arange(rows) + 100
    columns = (
        torch.full((rows,), temperature),
        torch.zeros(rows, dtype=torch.int64),
        torch.full((rows,), top_p),
        torch.zeros(rows),
    )

    def call(lib: ctypes.CDLL, out: torch.Tensor) -> torch.Tensor:
        ptrs = [t.data_ptr() for t in (index, *columns, seeds, positions, out)]
        lib.tm_sample(logits.data_ptr(), logits.shape[1], logits.shape[1], ptrs[0], rows, *ptrs[1:])
        return out

    outs = [torch.empty(rows, dtype=torch.int64) for _ in libs]
    return per_build(libs, outs, call)


def greedy_runs(libs: list[ctypes.CDLL], logits: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    """Each row's max and its first index (a greedy step's ids): [max, index] as floats."""
    rows, vocab = logits.shape

    def call(lib: ctypes.CDLL, out: torch.Tensor) -> torch.Tensor:
        ids = torch.empty(rows, dtype=torch.int64)
        lib.tm_row_argmax(logits.data_ptr(), rows, vocab, vocab, out.data_ptr(), ids.data_ptr())
        return torch.cat([out, ids.float()])

    outs = [torch.empty(rows) for _ in libs]
    return per_build(libs, outs, call)


def log_softmax_runs(
    libs: list[ctypes.CDLL], logits: torch.Tensor, top: int
) -> list[Callable[[], torch.Tensor]]:
    """The log-softmax statistics of every row and its top `top`: max, logsum, top values."""
    rows, vocab = logits.shape

    def call(lib: ctypes.CDLL, out: torch.Tensor) -> torch.Tensor:
        argmax = torch.empty(rows, dtype=torch.int64)
        ids = torch.empty(rows, top, dtype=torch.int32)
        max_, logsum, values = out[:rows], out[rows : 2 * rows], out[2 * rows :]
        lib.tm_log_softmax_stats(
            logits.data_ptr(), rows, vocab, vocab, max_.data_ptr(), argmax.data_ptr(),
            logsum.data_ptr(), top, ids.data_ptr(), values.data_ptr(),
        )  # fmt: skip
        return torch.cat([out, argmax.float(), ids.flatten().float()])

    outs = [torch.empty(rows * (2 + top)) for _ in libs]
    return per_build(libs, outs, call)


def sampling_runs(libs: list[ctypes.CDLL]) -> dict[str, list[Callable[[], torch.Tensor]]]:
    """32 rows of a 32,768 vocabulary: flat logits (normal, scale 3: most tokens within reach
    of the top, as a random-weight checkpoint's) and peaked ones (8 tokens near 0, the rest
    20-60 below: a trained model's shape, most of the vocabulary out of reach)."""
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(32, 32768, generator=gen) * 3
    peaked = -20.0 - 40.0 * torch.rand(32, 32768, generator=gen)
    peaked.scatter_(1, torch.randint(0, 32768, (32, 8), generator=gen), torch.randn(32, 8))
    runs = {}
    for name, logits in (("flat", flat), ("peaked", peaked)):
        runs[f"sample 32 x 32768 {name}, T=1"] = sample_runs(libs, logits, 1.0, 1.0)
        runs[f"sample 32 x 32768 {name}, T=0.7 top_p=0.9"] = sample_runs(libs, logits, 0.7, 0.9)
        runs[f"argmax 32 x 32768 {name}"] = greedy_runs(libs, logits)
        runs[f"log-softmax + top 5, 32 x 32768 {name}"] = log_softmax_runs(libs, logits, 5)
    return runs


def small_runs(libs: list[ctypes.CDLL]) -> dict[str, list[Callable[[], torch.Tensor]]]:
    runs = {}
    for rows in SMALL_ROWS:
        runs[f"rms_norm [{rows} x {HIDDEN}]"] = norm_runs(libs, rows)
        runs[f"rope + KV write [{rows} tokens]"] = rope_runs(libs, rows)
    return runs


# One stand-in serving process: a short burst of Python every few milliseconds, niced as
# ServingPriority nices the real ones under load.
BUSY_LOOP = """
import os, sys, time
os.nice(10)
period = float(sys.argv[1])
while True:
    time.sleep(period)
    start = time.thread_time()
    while time.thread_time() - start < 0.0005:
        pass
"""


def start_busy(count: int) -> list[subprocess.Popen[bytes]]:
    # NOTE: different periods, so that their bursts do not line up.
    periods = [0.003 + 0.0017 * i for i in range(count)]
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(p)]) for p in periods]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default="HEAD", help="git revision to compare with (HEAD)")
    p.add_argument("--rounds", type=int, default=20, help="alternating rounds (default 20)")
    kinds = ["attention", "linear", "small", "sampling"]
    p.add_argument("--only", choices=kinds, help="one kind of case")
    p.add_argument(
        "--busy", type=int, default=0, help="stand-ins for the serving processes to run meanwhile"
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the linear cases' dtype (float32: the AVX-512 kernels)",
    )
    args = p.parse_args()
    busy = start_busy(args.busy)
    try:
        return run(args)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        base = build(sources_at(args.against, Path(tmp) / "base"), Path(tmp) / "base.so")
        ours = build(CSRC, Path(tmp) / "ours.so")
        libs = [base, ours]
        amx = amx_enabled(base)  # NOTE: TOKENMILL_CPU_AMX=0: the AVX-512 kernels here too
        cases = {}
        if args.only in (None, "attention"):
            cases.update(attention_runs(libs))
        if args.only in (None, "linear"):
            cases.update(linear_runs(libs, amx, getattr(torch, args.dtype)))
        if args.only in (None, "small"):
            cases.update(small_runs(libs))
        if args.only in (None, "sampling"):
            cases.update(sampling_runs(libs))
        kind = "AMX tiles" if amx else "no AMX tiles: the AVX-512 kernels"
        print(
            f"{args.against} against the working tree, {args.rounds} rounds, alternating ({kind})"
            + (f", {args.busy} busy stand-ins" if args.busy else "")
        )
        for name, (theirs, mine) in cases.items():
            times: tuple[list[float], list[float]] = ([], [])
            first, second = theirs(), mine()
            for _ in range(args.rounds):
                timed(theirs, times[0])
                timed(mine, times[1])
            a, b = (sorted(t) for t in times)
            q, h = args.rounds // 4, args.rounds // 2
            print(
                f"{name:<40} {args.against} {a[0] * 1e3:8.3f} ms (p25 {a[q] * 1e3:.3f}, "
                f"median {a[h] * 1e3:.3f})  tree {b[0] * 1e3:8.3f} ms (p25 {b[q] * 1e3:.3f}, "
                f"median {b[h] * 1e3:.3f})  {a[0] / b[0]:5.2f}x (median {a[h] / b[h]:.2f}x)"
                f"  same bits: {torch.equal(first, second)}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
