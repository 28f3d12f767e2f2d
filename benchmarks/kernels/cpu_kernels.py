"""The CPU kernels on this machine, side by side: bfloat16 linear layers (our AVX-512 kernel,
our AMX kernel where the CPU has it, torch's F.linear) and bfloat16 attention (AVX-512 and
AMX), at the medium checkpoint's shapes, rounds interleaved, medians printed.

Linear: a decode step's weights (every projection of the 12 layers, each weight distinct so
that it streams from memory as in a real step) at 1, 12 (one block of rows), 32 and 64 rows,
one prefill product of [2048 x 768 x 4096] (gate/up); products whose x has rows of 4 KiB (the
prefill's down [2048 x 2048 x 768], Llama-8B's o projection at 32 and 512 rows) with the rows
laid out as the engine lays them (cpu/ops.py's product_input: a cache line apart) and as they were
before (4 KiB apart: a block's rows in one L1 set). Attention:
64 decode rows at a context of 300, 8 prompts of 256 tokens, and 64 scoring items of 32
tokens after one shared 1,024-token query.
GFLOP/s count 2 x multiply-adds; GB/s count the weights' bytes.

    python benchmarks/kernels/cpu_kernels.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.tp_worker.cpu.attention import PagedAttention
from tokenmill.tp_worker.cpu.kernels import library
from tokenmill.tp_worker.cpu.ops import PackedLinear, amx_enabled, product_input
from tokenmill.tp_worker.model.layer_attention import LayerAttention

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, DIM = 768, 2048, 12, 12, 4, 64
# (in, out) of each projection of one layer: q/k/v fused, o, gate/up fused, down
LAYER = [(HIDDEN, (HEADS + 2 * KV_HEADS) * DIM), (HEADS * DIM, HIDDEN), (HIDDEN, 2 * INTER)]
LAYER.append((INTER, HIDDEN))


def kernels() -> dict[str, str]:
    """Label -> TOKENMILL_CPU_AMX value for each kernel kind this machine has."""
    os.environ["TOKENMILL_CPU_AMX"] = "1"
    found = {"avx512": "0"}
    if amx_enabled():
        found["amx"] = "1"
    return found


def median_ms(fn: Callable[[], object], rounds: list[float]) -> None:
    fn()
    started = time.perf_counter()
    fn()
    rounds.append((time.perf_counter() - started) * 1e3)


def linear_cases(kinds: dict[str, str]) -> dict[str, dict[str, Callable[[], object]]]:
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * k**-0.5).bfloat16() for k, n in LAYER * LAYERS]
    packed = {}
    for label, flag in kinds.items():
        os.environ["TOKENMILL_CPU_AMX"] = flag
        packed[label] = [PackedLinear(w, None) for w in weights]
    cases: dict[str, dict[str, Callable[[], object]]] = {}
    for rows in (1, 12, 32, 64):
        xs = {
            k: product_input(torch.randn(rows, k, generator=gen).bfloat16())
            for k in (HIDDEN, INTER)
        }

        def ours(layers: list[PackedLinear], xs: dict = xs) -> None:
            for layer in layers:
                layer(xs[layer.in_features])

        def theirs(xs: dict = xs) -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        step = {
            label: (lambda layers=layers, f=ours: f(layers)) for label, layers in packed.items()
        }
        cases[f"decode step, {rows} rows"] = {**step, "torch F.linear": theirs}
    x = torch.randn(2048, HIDDEN, generator=gen).bfloat16()
    w = (torch.randn(2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5).bfloat16()
    prefill = {}
    for label, flag in kinds.items():
        os.environ["TOKENMILL_CPU_AMX"] = flag
        layer = PackedLinear(w, None)
        prefill[label] = lambda layer=layer: layer(x)
    cases["prefill [2048 x 768 x 4096]"] = {**prefill, "torch F.linear": lambda: F.linear(x, w)}
    # NOTE: medium's prefill down product; Llama-8B's o projection (32 heads of 128) at a
    # decode step and in a prefill.
    for m, k, n in ((2048, INTER, HIDDEN), (32, 4096, 4096), (512, 4096, 4096)):
        cases[f"rows of 4 KiB, [{m} x {k} x {n}]"] = rows_case(kinds, gen, m, k, n)
    return cases


def rows_case(
    kinds: dict[str, str], gen: torch.Generator, m: int, k: int, n: int
) -> dict[str, Callable[[], object]]:
    """[m x k x n] with x's rows laid out, and 4 KiB apart as they come in a contiguous tensor
    (the kernel called directly: PackedLinear would copy them a line apart)."""
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
    padded, out = product_input(x), torch.empty(m, n, dtype=torch.bfloat16)
    variants: dict[str, Callable[[], object]] = {}
    for label, flag in kinds.items():
        os.environ["TOKENMILL_CPU_AMX"] = flag
        layer = PackedLinear(w, None)
        kernel = library().tm_linear_amx if layer.amx else library().tm_linear
        variants[label] = lambda layer=layer: layer(padded)

        def in_place(layer: PackedLinear = layer, kernel: Callable[..., int] = kernel) -> None:
            # NOTE: reads x and out when it runs, so the closure keeps both alive.
            pointers = (x.data_ptr(), m, k, k, layer.packed.data_ptr(), n, None, out.data_ptr())
            assert kernel(*pointers, n, 1, 1, None, 0) == 0

        variants[f"{label}, 4K rows"] = in_place
    return {**variants, "torch F.linear": lambda: F.linear(x, w)}


def attention_case(
    rows: int,
    context: int,
    new: int,
    shared: bool = False,
    runs: bool = False,
    kv_heads: int = KV_HEADS,
) -> Callable[[], object]:
    """`rows` rows of `new` tokens after `context` cached ones: each row's own slots, or
    (`shared`) the same context slots for every row, as scoring items after one query. The
    slots are scattered at random, or (`runs`) in runs as the controller's pool hands them
    out to a fresh server: each row's positions on consecutive slots. `kv_heads`, each with
    the medium checkpoint's three query heads (SmolLM2 has 3 of them)."""
    gen = torch.Generator().manual_seed(1)

    def order(n: int) -> torch.Tensor:
        return torch.arange(n) if runs else torch.randperm(n, generator=gen)

    if shared:
        slots = context + rows * new
        own = context + order(rows * new).view(rows, new)
        prefix = order(context).expand(rows, context)
        table = torch.cat([prefix, own], 1).int().contiguous()
    else:
        slots = rows * (context + new)
        table = order(slots).view(rows, context + new).int()
    k, v = (torch.randn(kv_heads, slots, DIM, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(rows * new, HEADS // KV_HEADS * kv_heads, DIM, generator=gen).bfloat16()
    batch = torch.arange(rows)
    plan = PagedAttention(
        table,
        batch,
        batch * new,
        torch.full((rows,), new),
        torch.full((rows,), context),
        torch.zeros(0, dtype=torch.int64),
    )
    settings = LayerAttention(DIM**-0.5)
    return lambda: plan.attend(q, k, v, settings)


def run(name: str, variants: dict[str, Callable[[], object]], flags: dict[str, str], n: int):
    times: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(n):
        for label, fn in variants.items():
            os.environ["TOKENMILL_CPU_AMX"] = flags.get(label, "0")
            median_ms(fn, times[label])
    return {label: statistics.median(t) for label, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    args = p.parse_args()
    kinds = kernels()
    print(f"threads {torch.get_num_threads()}; kernels here: {', '.join(kinds)}")
    weight_bytes = sum(k * n * 2 for k, n in LAYER) * LAYERS
    for name, variants in linear_cases(kinds).items():
        medians = run(name, variants, kinds, args.rounds)
        if name.startswith("decode"):
            rows = int(name.split(", ")[1].split()[0])
            flop = 2 * rows * weight_bytes / 2
            extra = {label: f"{weight_bytes / ms / 1e6:.1f} GB/s" for label, ms in medians.items()}
        else:
            m, k, n = (int(d) for d in re.findall(r"\d+", name.split("[")[1]))
            flop = 2 * m * k * n
            extra = dict.fromkeys(medians, "")
        for label, ms in medians.items():
            print(
                f"{name:<36}{label:<16}{ms:8.2f} ms {flop / ms / 1e6:8.0f} GFLOP/s {extra[label]}"
            )
    cases = {
        "attention, 64 decode rows x 300": (64, 300, 1, False),
        "attention, 8 x 256 prompt": (8, 0, 256, False),
        "attention, 64 x 32 after 1024": (64, 1024, 32, True),
    }
    for name, (rows, context, new, shared) in cases.items():
        fn = attention_case(rows, context, new, shared)
        medians = run(name, dict.fromkeys(kinds, fn), kinds, args.rounds)
        for label, ms in medians.items():
            print(f"{name:<36}{label:<16}{ms:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
