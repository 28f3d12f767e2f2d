"""The CPU linear, RMSNorm, SiLU and RoPE kernels (csrc/linear.cpp, rms_norm.cpp,
activation.cpp, rope.cpp) against references, their invariance (a row is bitwise the same
alone or among any number of rows, with 1 or 2 threads), and the same bits from a build
without any AVX (x86-64-v2) as from this machine's native build, attention's two paths
included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.tp_worker.cpu import attention as attention_cpu
from tokenmill.tp_worker.cpu import kernels as cpu_kernels
from tokenmill.tp_worker.cpu import ops as cpu_ops
from tokenmill.tp_worker.cpu.ops import (
    PackedLinear,
    glu_mul_cpu,
    rms_norm_cpu,
    rope_store_cpu,
    soft_cap_cpu,
)
from tokenmill.tp_worker.model.layer_attention import LayerAttention
from tokenmill.tp_worker.model.lora import ProjectionDelta, ProjectionLora, Segment, stored
from tokenmill.tp_worker.model.parallel import ShardedLinear, TpGroup
from tokenmill.tp_worker.model.rope import Rotary, apply_rotary, float32_cos_sin

CPU = torch.device("cpu")

SHAPES = [(1, 64, 40), (13, 33, 70), (37, 256, 96), (300, 128, 64)]  # (M, K, N)
# (x and W, output; None = the same): every combination the linear kernels take.
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, None),
]


def _case(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x, weight, bias


ACTS = tuple(cpu_ops.ACTIVATION_CODES)  # NOTE: silu, gelu_tanh


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize(("dtype", "out_dtype"), DTYPE_PAIRS)
def test_matches_float64_reference(
    m: int, k: int, n: int, dtype: torch.dtype, out_dtype: torch.dtype | None, cpu_kernel: str
) -> None:
    x, weight, bias = _case(m, k, n, dtype)
    layer = PackedLinear(weight, bias)
    assert layer.amx == (cpu_kernel == "amx" and dtype == torch.bfloat16)
    out = layer(x, out_dtype)
    assert out.dtype == (out_dtype or dtype) and out.shape == (m, n)
    expected = x.double() @ weight.double().T + bias.double()
    if out.dtype == torch.bfloat16:  # only the final rounding: 2^-8 relative
        torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=2**-8)
    else:
        torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize(("dtype", "out_dtype"), DTYPE_PAIRS)
def test_a_residual_added_by_the_kernel_has_the_bits_of_torchs_add(
    m: int, k: int, n: int, dtype: torch.dtype, out_dtype: torch.dtype | None, cpu_kernel: str
) -> None:
    """The decoder layer's `x + o_proj(...)` and `x + down_proj(...)` in the epilogue: the
    output rounded to its dtype, then one float32 add, as torch adds two such tensors."""
    x, weight, bias = _case(m, k, n, dtype)
    gen = torch.Generator().manual_seed(5)
    residual = (4 * torch.randn(m, n, generator=gen)).to(out_dtype or dtype)
    layer = PackedLinear(weight, bias)
    fused = layer(x, out_dtype, residual=residual)
    assert torch.equal(fused, residual + layer(x, out_dtype))
    assert not torch.equal(fused, layer(x, out_dtype))


@pytest.mark.parametrize(("m", "k"), [(1, 64), (13, 33), (37, 256), (300, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_fused_gate_up_has_the_bits_of_silu_mul_after_the_product(
    m: int, k: int, dtype: torch.dtype, bias: bool, cpu_kernel: str
) -> None:
    """An MLP's gate_up with the silu(gate) x up epilogue (panels of 16 gate and 16 up
    features) gives what glu_mul_cpu gives over the plain product's [M, 2 x 96] output."""
    x, weight, b = _case(m, k, 192, dtype)
    b = b if bias else None
    fused = PackedLinear(weight, b, glu=True)
    assert fused.amx == (cpu_kernel == "amx" and dtype == torch.bfloat16)
    out = fused(x)
    assert out.shape == (m, 96) and out.dtype == dtype
    assert torch.equal(out, glu_mul_cpu(PackedLinear(weight, b)(x, torch.float32), dtype))


def _in_place(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """The product over contiguous x read where it lies (row stride K, no copy)."""
    out = torch.empty(x.shape[0], layer.out_features, dtype=x.dtype)
    lib = cpu_kernels.library()
    code = cpu_ops.DTYPE_CODES[x.dtype]
    status = (lib.tm_linear_amx if layer.amx else lib.tm_linear)(
        x.data_ptr(), x.shape[0], x.shape[1], x.shape[1], layer.packed.data_ptr(),
        layer.out_features, layer.bias.data_ptr(), out.data_ptr(), layer.out_features,
        code, code, None, 0,
    )  # fmt: skip
    assert status == 0
    return out


def _rows_of_4_kib(dtype: torch.dtype) -> tuple[int, int]:
    """(width, one cache line) in elements of `dtype`."""
    return 4096 // dtype.itemsize, 64 // dtype.itemsize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_product_reads_x_rows_a_cache_line_apart_with_the_same_bits(
    dtype: torch.dtype, cpu_kernel: str
) -> None:
    """product_rows gives 4 KiB rows one cache line more (cpu_ops' note); the product reads
    x's row stride (NaN in the padding: a read of it would show) and gives the bits of x
    read in place, contiguous; a contiguous x of such rows is copied so first."""
    width, line = _rows_of_4_kib(dtype)
    x, weight, bias = _case(37, width, 70, dtype)
    layer = PackedLinear(weight, bias)
    assert layer.amx == (cpu_kernel == "amx" and dtype == torch.bfloat16)
    padded = torch.full((37, width + line), float("nan"), dtype=dtype)[:, :width].copy_(x)
    expected = _in_place(layer, x)
    assert torch.equal(layer(padded), expected)
    assert torch.equal(layer(x), expected)
    assert cpu_ops.product_input(x).stride() == (width + line, 1)
    assert cpu_ops.product_rows(37, width, dtype).stride() == (width + line, 1)
    assert cpu_ops.product_rows(3, width - line, dtype).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_writes_rows_a_cache_line_apart_with_the_same_bits(dtype: torch.dtype) -> None:
    """The float32 residual stream in, the model's dtype out, in laid-out rows."""
    width, line = _rows_of_4_kib(dtype)
    x, weight, _ = _case(37, width, 1, dtype)
    x, gain = x.float(), weight[0].float()
    norm = rms_norm_cpu(x, gain, 1e-5, dtype)
    assert norm.stride() == (width + line, 1) and norm.dtype == dtype
    dense = torch.empty(37, width, dtype=dtype)
    code = cpu_ops.DTYPE_CODES[dtype]
    status = cpu_kernels.library().tm_rms_norm(
        x.data_ptr(), gain.data_ptr(), dense.data_ptr(), 37, width, width, 1e-5, code, 0
    )
    assert status == 0 and torch.equal(norm, dense)
    assert torch.equal(rms_norm_cpu(x.view(1, 37, width), gain, 1e-5, dtype)[0], dense)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_glu_product_writes_rows_a_cache_line_apart_with_the_same_bits(
    dtype: torch.dtype, cpu_kernel: str
) -> None:
    """The fused gate/up's output (the down product's x) in laid-out rows: silu_mul's bits
    over the unfused product's float32 sums."""
    width, line = _rows_of_4_kib(dtype)
    x, weight, _ = _case(13, 64, 2 * width, dtype)
    glu = PackedLinear(weight, None, glu=True)(x)
    assert glu.stride() == (width + line, 1)
    assert torch.equal(glu, glu_mul_cpu(PackedLinear(weight, None)(x, torch.float32), dtype))


@pytest.mark.parametrize("inter", [24, 32])
def test_a_gate_up_layer_gives_silu_mul_whether_or_not_it_fuses(inter: int) -> None:
    """ShardedLinear(glu=True) through the CPU kernel: fused where 2 x inter is a multiple of
    32 (inter 32), the product then glu_mul_cpu elsewhere (inter 24), the same numbers."""
    x, weight, _ = _case(13, 40, 2 * inter, torch.bfloat16)
    layer = ShardedLinear(40, 2 * inter, False, False, TpGroup(), torch.bfloat16, CPU, glu="silu")
    layer.weight.data.copy_(weight)
    layer.use_cpu_kernel()
    assert layer.kernel is not None and layer.kernel.glu == (inter == 32)
    expected = glu_mul_cpu(PackedLinear(weight, None)(x, torch.float32), torch.bfloat16)
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize(
    ("k", "dtype"),
    [(160, torch.float32), (160, torch.bfloat16), (200, torch.bfloat16), (2048, torch.bfloat16)],
)
def test_a_row_is_bitwise_the_same_in_any_company(
    k: int, dtype: torch.dtype, cpu_kernel: str
) -> None:
    """Every row count around the kernels' blocks (12 rows, passes over the panels of ~512 KiB
    of x: K = 2,048 splits 300 rows into three; AMX: 16-row tiles, 32-row blocks, chunks of
    up to 1 MiB of x: K = 2,048 splits 300 rows into two), x read in place or copied (AMX,
    K = 200 is not a multiple of 32)."""
    x, weight, bias = _case(300, k, 72, dtype)
    layer = PackedLinear(weight, bias)
    together = layer(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), together)
    finally:
        torch.set_num_threads(threads)
    for rows in (1, 5, 12, 13, 16, 17, 32, 33, 64, 257):
        for start in (0, 7, 300 - rows):
            assert torch.equal(layer(x[start : start + rows]), together[start : start + rows])


@pytest.mark.parametrize("n", [72, 1000])
def test_panels_taken_by_any_thread_give_the_same_bits(n: int, cpu_kernel: str) -> None:
    """More threads than cores (their shares of the panels taken by whichever thread is
    running: panel_queue.h), fewer panels than threads (empty shares) and several passes over
    x: the bits of one thread, every time."""
    x, weight, bias = _case(300, 2048, n, torch.bfloat16)
    layer = PackedLinear(weight, bias)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer(x)
        torch.set_num_threads(7)
        for _ in range(10):
            assert torch.equal(layer(x), alone)
            assert torch.equal(layer(x[:5]), alone[:5])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rounds_once_and_is_row_invariant(
    dtype: torch.dtype, x_dtype: torch.dtype
) -> None:
    """weight * (x * r) in float32, rounded once to the model's dtype (in float32 that is
    transformers' formula), from the float32 residual stream or x in the model's dtype; the
    weight float32 (a bfloat16 checkpoint's, exact)."""
    if dtype == torch.float32 and x_dtype == torch.bfloat16:
        pytest.skip("a float32 model's residual stream is float32")
    gen = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(70, 200, generator=gen)).to(x_dtype)
    weight = torch.randn(200, generator=gen).to(dtype).float()
    out = rms_norm_cpu(x, weight, 1e-5, dtype)
    x32 = x.float()
    exact = weight.double() * (
        x32.double() * (x32.double().pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt()
    )
    # NOTE: float32: within float32 rounding of the exact value. bfloat16: the exact value
    # rounded once, but for a few elements within float32 error of a rounding boundary.
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    else:
        once = exact.float().to(dtype)
        assert (out != once).float().mean() < 0.01
        torch.testing.assert_close(out, once, atol=0, rtol=2**-7)
    for rows in (slice(0, 1), slice(5, 6), slice(13, 70)):
        assert torch.equal(rms_norm_cpu(x[rows], weight, 1e-5, dtype), out[rows])


@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_silu_mul_rounds_once(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """silu(gate) * up in float32, rounded once to out_dtype. 37 columns: the vector body and
    the scalar tail; values far into both tails of exp."""
    gate_up = (8 * torch.randn(9, 74, generator=torch.Generator().manual_seed(4))).to(dtype)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30])
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    out = glu_mul_cpu(gate_up, out_dtype)
    assert out.dtype == out_dtype
    torch.testing.assert_close(
        out.double(), exact, atol=1e-6, rtol=1e-6 if out_dtype == torch.float32 else 2**-8
    )
    if out_dtype == torch.bfloat16:
        assert (out != exact.float().to(out_dtype)).float().mean() < 0.01


def test_rotary_tables_are_this_threads_float32_cos_and_sin(monkeypatch) -> None:
    """cos / sin of any positions, in any order and step: the bits of one thread computing
    transformers' float32 formula, and within 1e-6 of float64 (torch's two-thread cos
    once returned 1.5e-4 errors from its second thread: rope.py's _table)."""
    rotary = Rotary(64, 500000.0, {}, torch.device("cpu"))
    positions = torch.tensor([4095, 0, 100, 7, 2048, 100, 1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = float32_cos_sin(torch.arange(4096), rotary.inv_freq)
    finally:
        torch.set_num_threads(threads)
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rotary.cos_sin(positions, dtype)
        assert torch.equal(cos[:, 0], want[0][positions].to(dtype))
        assert torch.equal(sin[:, 0], want[1][positions].to(dtype))
    built_with: list[int] = []

    def spy(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple:
        built_with.append(torch.get_num_threads())
        return float32_cos_sin(positions, inv_freq)

    monkeypatch.setattr("tokenmill.tp_worker.model.rope.float32_cos_sin", spy)
    grown = rotary.cos_sin(torch.tensor([9000, 3]), torch.float32)  # past the table: it grows
    assert built_with == [1] and torch.get_num_threads() == threads
    angles = torch.tensor([9000.0, 3.0], dtype=torch.float64)[:, None] * rotary.inv_freq.double()
    angles = torch.cat((angles, angles), -1).float().double()  # the float32 angle, exactly
    np.testing.assert_allclose(grown[0][:, 0].double(), angles.cos(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(grown[1][:, 0].double(), angles.sin(), atol=1e-6, rtol=0)


def _rope_case(dtype: torch.dtype) -> tuple:
    """13 tokens at scattered positions and slots; 4 query and 2 KV heads of 64."""
    gen = torch.Generator().manual_seed(5)
    qkv = (4 * torch.randn(13, 8 * 64, generator=gen)).to(dtype)
    qkv[:2] = torch.tensor([0.0, -0.0]).repeat(8 * 32)  # signed zeros, at position 0 too
    positions = torch.randint(0, 5000, (13,), generator=gen)
    positions[0] = 0
    rotary = Rotary(64, 500000.0, {}, torch.device("cpu"))
    slots = torch.randperm(40, generator=gen)[:13]
    return qkv, rotary.cos_sin(positions, dtype), slots


def _rope_store(qkv: torch.Tensor, cos_sin: tuple, slots: torch.Tensor) -> tuple:
    kv = (qkv.new_zeros(2, 40, 64), qkv.new_zeros(2, 40, 64))
    return (rope_store_cpu(qkv, cos_sin, kv, slots, 4, 2), *kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_gives_the_torch_paths_bits(dtype: torch.dtype) -> None:
    qkv, cos_sin, slots = _rope_case(dtype)
    q, k_cache, v_cache = _rope_store(qkv, cos_sin, slots)
    q_ref, k_ref, v_ref = qkv.view(13, 8, 64).split([4, 2, 2], dim=1)
    assert torch.equal(q, apply_rotary(q_ref, *cos_sin))
    assert torch.equal(k_cache[:, slots].transpose(0, 1), apply_rotary(k_ref, *cos_sin))
    assert torch.equal(v_cache[:, slots].transpose(0, 1), v_ref)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[:, untouched].any() and not v_cache[:, untouched].any()


def _one_row_two_ways(table: torch.Tensor) -> tuple[attention_cpu.PagedAttention, ...]:
    """Table row 0's first 20 positions as one prompt chunk, and as 20 decode rows (the
    kernel's other path)."""
    one, steps = torch.ones(1, dtype=torch.int64), torch.arange(20)
    no_slots = torch.zeros(0, dtype=torch.int64)
    chunk = attention_cpu.PagedAttention(table, 0 * one, 0 * one, 20 * one, 0 * one, no_slots)
    rows = attention_cpu.PagedAttention(table, 0 * steps, steps, steps**0, steps, no_slots)
    return chunk, rows


def test_a_build_without_avx_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable loops do what the AVX-512 (and AVX512_BF16) microkernels do, in the same
    order: an x86 CPU of any generation computes the same numbers (AMX apart: its tile
    products round as the hardware does, so an AMX CPU is compared with AMX off)."""
    monkeypatch.setenv("TOKENMILL_CPU_AMX", "0")
    # NOTE: K = 200: float32's three blocks of 64 k and a short last one (linear.cpp's rule).
    shapes = [*SHAPES[:3], (7, 200, 40)]
    cases = [(_case(m, k, n, dtype), dtype) for m, k, n in shapes for dtype in cpu_ops.DTYPE_CODES]
    native = [PackedLinear(w, b)(x, torch.float32) for (x, w, b), _ in cases]
    residuals = [torch.randn(x.shape[0], w.shape[0]).to(dtype) for (x, w, _), dtype in cases]
    added = [
        PackedLinear(w, b)(x, residual=r)
        for ((x, w, b), _), r in zip(cases, residuals, strict=True)
    ]
    # NOTE: the model's own case: x in its dtype, the float32 residual stream out.
    widened = [
        PackedLinear(w, b)(x, torch.float32, r.float())
        for ((x, w, b), _), r in zip(cases, residuals, strict=True)
    ]
    glu_cases = [_case(13, 33, 64, dtype) for dtype in cpu_ops.DTYPE_CODES]
    glus = [PackedLinear(w, b, glu=True, activation=a)(x) for x, w, b in glu_cases for a in ACTS]
    norms = [rms_norm_cpu(x.float(), w[0].float(), 1e-6, x.dtype) for (x, w, _), _ in cases]
    activations = [
        glu_mul_cpu(4 * x[:, :32].float(), x.dtype, a) for (x, _, _), _ in cases for a in ACTS
    ]
    logits = 40 * torch.randn(5, 1003)
    capped = soft_cap_cpu(logits.clone(), 30.0)
    ropes = [_rope_store(*_rope_case(dtype)) for dtype in cpu_ops.DTYPE_CODES]
    q = torch.randn(20, 8, 64)
    caches = (torch.randn(2, 64, 64), torch.randn(2, 64, 64))  # [Hkv, slots, D]
    paged, decode = _one_row_two_ways(torch.randperm(64).view(1, 64).int())
    settings = [LayerAttention(64**-0.5), LayerAttention(64**-0.5, 9, 3.0)]
    native_attention = [paged.attend(q, *caches, s) for s in settings]
    for s, attended in zip(settings, native_attention, strict=True):
        assert torch.equal(decode.attend(q, *caches, s), attended)

    portable = cpu_kernels.load(cpu_kernels.build("x86-64-v2"))
    assert portable.tm_linear_isa() == 0
    monkeypatch.setattr(cpu_ops, "library", lambda: portable)
    monkeypatch.setattr(attention_cpu, "library", lambda: portable)
    for ((x, w, b), _), expected, norm in zip(cases, native, norms, strict=True):
        assert torch.equal(PackedLinear(w, b)(x, torch.float32), expected)
        assert torch.equal(rms_norm_cpu(x.float(), w[0].float(), 1e-6, x.dtype), norm)
    for ((x, w, b), _), r, expected in zip(cases, residuals, added, strict=True):
        assert torch.equal(PackedLinear(w, b)(x, residual=r), expected)
    for ((x, w, b), _), r, expected in zip(cases, residuals, widened, strict=True):
        assert torch.equal(PackedLinear(w, b)(x, torch.float32, r.float()), expected)
    acts = [(x, a) for (x, _, _), _ in cases for a in ACTS]
    for (x, a), activation in zip(acts, activations, strict=True):
        assert torch.equal(glu_mul_cpu(4 * x[:, :32].float(), x.dtype, a), activation)
    glu_acts = [(c, a) for c in glu_cases for a in ACTS]
    for ((x, w, b), a), glu in zip(glu_acts, glus, strict=True):
        assert torch.equal(PackedLinear(w, b, glu=True, activation=a)(x), glu)
    assert torch.equal(soft_cap_cpu(logits.clone(), 30.0), capped)
    for dtype, rope in zip(cpu_ops.DTYPE_CODES, ropes, strict=True):
        for ours, native in zip(_rope_store(*_rope_case(dtype)), rope, strict=True):
            assert torch.equal(ours, native)
    for s, attended in zip(settings, native_attention, strict=True):
        assert torch.equal(paged.attend(q, *caches, s), attended)
        assert torch.equal(decode.attend(q, *caches, s), attended)


def test_the_avx2_float32_kernel_gives_the_portable_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build for an AVX2 CPU without AVX-512 (haswell) runs linear.cpp's AVX2 float32
    tiles; its products (1 to 12 rows a block, 13 and 40 rows, a short last k block) are the
    portable build's, bit for bit."""
    flags = cpu_kernels.cpu_flags()
    if "avx2" not in flags or "fma" not in flags:
        pytest.skip("this CPU runs no AVX2 code")
    shapes = [(m, k, n) for m in (1, 5, 6, 7, 12, 13, 40) for k, n in ((200, 40), (64, 96))]
    cases = [_case(m, k, n, torch.float32, seed=m) for m, k, n in shapes]
    outputs = {}
    for arch, isa in (("x86-64-v2", 0), ("haswell", 4)):
        lib = cpu_kernels.load(cpu_kernels.build(arch))
        assert lib.tm_linear_isa() == isa
        monkeypatch.setattr(cpu_ops, "library", lambda lib=lib: lib)
        outputs[arch] = [PackedLinear(w, b)(x, torch.float32) for x, w, b in cases]
    for portable, avx2 in zip(outputs["x86-64-v2"], outputs["haswell"], strict=True):
        assert torch.equal(portable, avx2)


# NOTE: plain attention, and Gemma's window and soft-cap (low enough to bite)
SETTINGS = (LayerAttention(64**-0.5), LayerAttention(64**-0.5, 9, 3.0))


def _attention_both_paths(
    dtype: torch.dtype, settings: LayerAttention
) -> tuple[torch.Tensor, torch.Tensor]:
    """20 tokens of one row as one prompt chunk, and as 20 decode rows (the other path)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(20, 8, 64, generator=gen).to(dtype)
    caches = tuple(torch.randn(2, 64, 64, generator=gen).to(dtype) for _ in range(2))
    chunk, rows = _one_row_two_ways(torch.randperm(64, generator=gen).view(1, 64).int())
    return chunk.attend(q, *caches, settings), rows.attend(q, *caches, settings)


@pytest.mark.parametrize("arch", ["x86-64-v2", "skylake-avx512"])
def test_attention_from_other_builds_gives_the_same_bits(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both attention paths, both dtypes, from a build without AVX and from one with AVX-512
    but no AVX512_BF16 (bfloat16 scores by two roundings per pair instead of VDPBF16PS); an
    AMX CPU's native build with AMX off (its tiles round as the hardware does)."""
    monkeypatch.setenv("TOKENMILL_CPU_AMX", "0")
    if arch == "skylake-avx512" and "avx512f" not in cpu_kernels.cpu_flags():
        pytest.skip("this CPU runs no AVX-512 code")
    native = {
        (dtype, s): _attention_both_paths(dtype, s)
        for dtype in cpu_ops.DTYPE_CODES
        for s in SETTINGS
    }
    for chunk, rows in native.values():
        assert torch.equal(chunk, rows)
    other = cpu_kernels.load(cpu_kernels.build(arch))
    monkeypatch.setattr(attention_cpu, "library", lambda: other)
    for (dtype, s), (chunk, _) in native.items():
        ours_chunk, ours_rows = _attention_both_paths(dtype, s)
        assert torch.equal(ours_chunk, chunk) and torch.equal(ours_rows, chunk)


def _order_probe() -> tuple[torch.Tensor, ...]:
    """bfloat16 scores whose value depends on the order of a pair's two products: with
    q = (1, 0, 4096, 4096, 0...) and a key (1, 0, -4096, 4096, 0...), VDPBF16PS adds the odd
    product first, 1 + 2^24 rounds to 2^24, and the score is 0; even first it would be 1.
    Even keys are that key, odd keys are zero (score 0 either way); their values +1 and -1."""
    q = torch.zeros(20, 8, 64)
    q[:, :, 0], q[:, :, 2], q[:, :, 3] = 1.0, 4096.0, 4096.0
    keys = torch.zeros(2, 64, 64)
    keys[:, 0::2, 0], keys[:, 0::2, 2], keys[:, 0::2, 3] = 1.0, -4096.0, 4096.0
    values = torch.ones(2, 64, 64)
    values[:, 1::2] = -1.0
    return q.bfloat16(), keys.bfloat16(), values.bfloat16()


@pytest.mark.parametrize("arch", ["native", "x86-64-v2", "skylake-avx512"])
def test_bfloat16_scores_add_a_pairs_odd_product_first(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if arch == "skylake-avx512" and "avx512f" not in cpu_kernels.cpu_flags():
        pytest.skip("this CPU runs no AVX-512 code")
    monkeypatch.setenv("TOKENMILL_CPU_AMX", "0")  # attention.cpp's order, not AMX's
    lib = cpu_kernels.load(cpu_kernels.build(arch))
    monkeypatch.setattr(attention_cpu, "library", lambda: lib)
    q, k, v = _order_probe()
    chunk, rows = _one_row_two_ways(torch.arange(64).view(1, 64).int())
    # every score 0: each token averages its keys' values, +1 and -1 alternating
    seen = torch.arange(20) + 1
    expected = ((seen + 1) // 2 - seen // 2) / seen
    for attention in (chunk, rows):
        out = attention.attend(q, k, v, LayerAttention(1.0)).float().view(20, 8, 64)
        expanded = expected.view(20, 1, 1).expand(20, 8, 64).float()
        torch.testing.assert_close(out, expanded, atol=2e-3, rtol=0)  # bfloat16 outputs


def _lora_case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, ProjectionLora]:
    """x [21, 40] in dtype and each row's slot: 9 rows on slot 0 (two of csrc/lora.cpp's
    blocks of 8), the rest over slots 1 and 2 and the base (-1); a gate/up-shaped projection
    (two parts of 48 columns), adapters in dtype: slot 0 rank 8 a part, slot 1 rank 5 a part
    (lanes under a mask), slot 2 the up part alone, rank 4."""
    gen = torch.Generator().manual_seed(5)
    slots = torch.tensor([0, -1, 1, 0, 2, 0, 0, -1, 1, 0, 0, 2, 0, 1, 0, -1, 1, 2, 0, 1, 1])
    lora = ProjectionLora(3)

    def part(rank: int, col: int, u_start: int) -> Segment:
        return Segment(stored(torch.randn(rank, 48, generator=gen) / 4, dtype), col, u_start)

    for slot, parts in enumerate(((8, 0), (5, 0), (4, 48))):
        rank, first = parts
        cols = (0, 48) if first == 0 else (48,)
        a = stored(torch.randn(40, rank * len(cols), generator=gen) / 4, dtype)
        segments = tuple(part(rank, c, i * rank) for i, c in enumerate(cols))
        lora.set(slot, ProjectionDelta(a, segments))
    return torch.randn(21, 40, generator=gen).to(dtype), slots.int(), lora


def _to_panels(y: torch.Tensor) -> torch.Tensor:
    return cpu_ops.gate_up_panels(y.t()).t().contiguous()


def _lora_outputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The deltas added to y in the table's column order and in the panel order, and the
    activation of the latter (glu_mul_panels_cpu)."""
    x, slots, lora = _lora_case(dtype)
    y = torch.randn(21, 96, generator=torch.Generator().manual_seed(6))
    contiguous, panels = y.clone(), _to_panels(y)
    for out, mode in ((contiguous, 3), (panels, 3 | cpu_ops.LORA_PANELS)):
        u = torch.zeros(21, 16)
        cpu_ops.lora_cpu(x, slots, lora.table, u, out, mode, lora.dtype)
    return y, contiguous, panels, cpu_ops.glu_mul_panels_cpu(panels, dtype)


def _lora_reference(dtype: torch.dtype, y: torch.Tensor) -> torch.Tensor:
    """y + each row's B (A x) in float64."""
    x, slots, lora = _lora_case(dtype)
    out = y.double()
    for m, slot in enumerate(slots.tolist()):
        delta = lora.entries[slot] if slot >= 0 else None
        if delta is None:
            continue
        u = x[m].double() @ delta.a.double()
        for seg in delta.segments:
            rank, n = seg.b.shape
            out[m, seg.col : seg.col + n] += u[seg.u_start : seg.u_start + rank] @ seg.b.double()
    return out


def test_lora_deltas_in_either_column_order_and_from_the_portable_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """csrc/lora.cpp near float64, the base's rows untouched, the panel order
    (LORA_PANELS) the same sums in gate_up_panels' places, glu_mul_panels_cpu glu_mul_cpu's
    bits; and a build without any AVX gives every bit of this machine's."""
    native = {dtype: _lora_outputs(dtype) for dtype in cpu_ops.DTYPE_CODES}
    base = _lora_case(torch.float32)[1] == -1
    for dtype, (y, contiguous, panels, glu) in native.items():
        torch.testing.assert_close(
            contiguous.double(), _lora_reference(dtype, y), atol=1e-5, rtol=1e-5
        )
        assert torch.equal(contiguous[base], y[base])
        assert torch.equal(panels, _to_panels(contiguous))
        assert torch.equal(glu, glu_mul_cpu(contiguous, dtype))
    portable = cpu_kernels.load(cpu_kernels.build("x86-64-v2"))
    monkeypatch.setattr(cpu_ops, "library", lambda: portable)
    for dtype, outputs in native.items():
        for ours, expected in zip(_lora_outputs(dtype), outputs, strict=True):
            assert torch.equal(ours, expected)
