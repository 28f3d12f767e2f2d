"""The CPU kernels' Python sides for the dense layers (tp_worker): linear layers through
csrc/linear.cpp (or, in bfloat16 on a CPU with AMX, csrc/linear_amx.cpp on the same panels),
with weights packed once at load time; RMSNorm through csrc/rms_norm.cpp;
the MLP's act(gate) x up and the logits' soft-cap through csrc/activation.cpp; RoPE and the
KV-cache write through
csrc/rope.cpp. Attention is cpu/attention.py.

Every output element sums its products in float32 in an order fixed by K alone, whatever
the number of rows (the rule is at the top of csrc/linear.cpp), so a row's result does not
depend on its batch and no row padding is needed: a decode step multiplies its own rows only.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import torch

from tokenmill.tp_worker.cpu import huge_pages
from tokenmill.tp_worker.cpu.kernels import library

PANEL = 32  # NR in csrc/linear.cpp: output features per packed panel
AMX_TILE_K = 32  # TILE_K in csrc/linear_amx.cpp: bfloat16 k per tile product
# NOTE: the dtypes every kernel in csrc/ takes, with the codes they take them by.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# NOTE: the MLP's gate activations, by csrc/silu.h's codes (config.py's ModelConfig.activation)
ACTIVATION_CODES = {"silu": 1, "gelu_tanh": 2, "swiglu_oai": 3}


# NOTE: a product reads x a block of 12 rows at a time, one word of each row per step (csrc/
# linear.cpp). Rows a multiple of 4 KiB long put those 12 words in one set of the L1 data
# cache (64 sets of 64 B lines: 8 ways on Zen 4, 12 on recent Xeons), so the block's own x
# evicted itself at every step: [64 x 2048 x 768] in bfloat16 ran 1.09x, 32 rows 1.22x, faster
# with its rows one line longer (a 2-core Zen 4). Llama shapes hit it everywhere (4,096 hidden,
# 14,336 intermediate); the medium preset in the down product (2,048). 2 KiB rows (6 words a
# set) read the same either way.
ALIASING_ROW_BYTES = 4096
CACHE_LINE_BYTES = 64


def rows_alias(stride: int, dtype: torch.dtype) -> bool:
    """Whether rows `stride` elements apart fall in one L1 set (see above)."""
    return (stride * dtype.itemsize) % ALIASING_ROW_BYTES == 0


def product_rows(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty [rows, width] on the CPU for a product to read as x: rows whose length is a
    multiple of 4 KiB get one cache line more between them (the view hides it; PackedLinear
    reads the row stride), so that a block of rows does not fall in one cache set."""
    stride = width + (CACHE_LINE_BYTES // dtype.itemsize if rows_alias(width, dtype) else 0)
    return torch.empty(rows, stride, dtype=dtype, device="cpu")[:, :width]


def product_input(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the products read it: unit-stride rows that do not alias (see above), x
    itself where its rows already are, else one copy into product_rows."""
    stride = row_stride(x)
    if (
        x.stride(1) == 1
        and stride >= x.shape[1]
        and not (x.shape[0] > 1 and rows_alias(stride, x.dtype))
    ):
        return x
    # NOTE: where a producer does not lay its rows out (attention's output, for Llama's 32
    # heads of 128), the copy costs ~4% of a [512 x 4096 x 4096] product that then runs ~1.2x
    # faster.
    return product_rows(x.shape[0], x.shape[1], x.dtype).copy_(x)


def row_stride(x: torch.Tensor) -> int:
    """The distance between x's rows [M, K] as the kernels take it (K where M is 1: a lone
    row has no next one, and a view's stride may then be anything)."""
    return x.stride(0) if x.shape[0] > 1 else x.shape[1]


def supports(dtype: torch.dtype) -> bool:
    """Whether the csrc/ kernels (dense layers and attention) take this dtype."""
    return dtype in DTYPE_CODES


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> panels [N/32, K, 32] (float32) or [N/32, K/2, 32, 2] (bfloat16),
    zero-padded to whole panels and, in bfloat16, to a multiple of 32 in k (an AMX tile's
    depth: both bfloat16 kernels take the same panels), in CPU memory."""
    n, k = weight.shape
    n_pad = -(-n // PANEL) * PANEL
    if weight.dtype == torch.float32:
        padded = weight.new_zeros(n_pad, k)
        padded[:n] = weight
        panels = padded.view(n_pad // PANEL, PANEL, k).permute(0, 2, 1)
    else:
        k_pad = -(-k // AMX_TILE_K) * AMX_TILE_K
        padded = weight.new_zeros(n_pad, k_pad)
        padded[:n, :k] = weight
        panels = padded.view(n_pad // PANEL, PANEL, k_pad // 2, 2).permute(0, 2, 1, 3)
    # NOTE: on 2 MiB pages (cpu/huge_pages.py): a decode step streams every weight once.
    return huge_pages.empty(tuple(panels.shape), panels.dtype).copy_(panels)


def amx_enabled(lib: ctypes.CDLL | None = None) -> bool:
    """Whether bfloat16 linear layers and attention run on AMX tiles (csrc/linear_amx.cpp,
    attention_amx.cpp): where the CPU and the build (`lib`, default this machine's) have
    them, unless TOKENMILL_CPU_AMX=0. NOTE: AMX rounds inside a tile product as the hardware
    does, so an AMX machine gets its own bits (invariant to batch, chunk and thread all the
    same); 0 gives the AVX-512 kernels' bits there instead."""
    if os.environ.get("TOKENMILL_CPU_AMX", "1") == "0":
        return False
    return _amx_ready(lib or library())


@functools.cache
def _amx_ready(lib: ctypes.CDLL) -> bool:
    # NOTE: asked once per build: attention asks every layer of every step.
    return bool(lib.tm_amx_ready())


def gate_up_panels(rows: torch.Tensor) -> torch.Tensor:
    """An MLP's gate_up rows [2 * inter, ...] (gate, then up) reordered so that each panel of
    32 holds 16 gate features and the same 16 up features (the kernels' `glu` epilogue)."""
    gate, up = rows.view(2, -1, PANEL // 2, *rows.shape[1:]).unbind(0)
    return torch.stack([gate, up], dim=1).reshape(rows.shape)


def fuses_gate_up(out_features: int) -> bool:
    """Whether a gate_up product of this width can run with the silu(gate) x up epilogue."""
    return out_features % PANEL == 0


class PanelProduct:
    """What a product by packed panels does with its rows, whatever the panels hold (float
    weights: PackedLinear; GGUF blocks: cpu/quantized.py's QuantLinear): y = x W^T (+ b) for
    x [M, K] in `dtype`, with a residual or the gate/up epilogue. A subclass sets the fields
    below and c_function, the C function its products call (tm_linear's arguments)."""

    out_features: int
    in_features: int
    dtype: torch.dtype
    glu: bool
    activation: str
    packed: torch.Tensor  # NOTE: what the kernel and layer_stack.py's tables take
    bias: torch.Tensor | None
    amx: bool  # NOTE: on AMX tiles (layer_stack.py's Shape.linear_amx)

    def c_function(self) -> Callable[..., int]:
        raise NotImplementedError

    def __call__(
        self,
        x: torch.Tensor,
        out_dtype: torch.dtype | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """With `residual` [M, N] (the output's dtype): residual + y, with the bits of that
        add in torch, in the kernel's epilogue (no second pass over the output)."""
        assert x.dtype == self.dtype and x.shape[-1] == self.in_features, (x.dtype, x.shape)
        assert not (self.glu and residual is not None), "a glu product takes no residual"
        assert x.dim() == 2, x.shape
        x = product_input(x)
        width = self.out_features // 2 if self.glu else self.out_features
        dtype = out_dtype or self.dtype
        # NOTE: a glu product's output is the next product's x (an MLP's down projection).
        out = (
            product_rows(x.shape[0], width, dtype)
            if self.glu
            else x.new_empty(x.shape[0], width, dtype=dtype)
        )
        if residual is not None:
            assert residual.shape == out.shape and residual.dtype == out.dtype, residual.shape
            residual = residual.contiguous()
            # NOTE: the kernel reads residual with out's row stride.
            assert row_stride(residual) == row_stride(out), (residual.stride(), out.stride())
        self._run(x, out, residual, ACTIVATION_CODES[self.activation] if self.glu else 0)
        return out

    def float_sums(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) [M, N] in float32, unrounded, the weight's rows in their own order (a
        glu layer's too: gate then up, before the activation), each element the bits the
        epilogues start from."""
        assert x.dtype == self.dtype and x.dim() == 2 and x.shape[-1] == self.in_features
        x = product_input(x)
        out = x.new_empty(x.shape[0], self.out_features, dtype=torch.float32)
        self._run(x, out, None, 0)
        if not self.glu:
            return out
        # NOTE: the panels hold 16 gate then 16 up features each (gate_up_panels)
        rows = out.shape[0]
        return out.view(rows, -1, 2, PANEL // 2).transpose(1, 2).reshape(rows, -1)

    def _run(
        self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None, act: int
    ) -> None:
        if x.shape[0] == 0:
            return
        status = self.c_function()(
            x.data_ptr(),
            x.shape[0],
            self.in_features,
            row_stride(x),
            self.packed.data_ptr(),
            self.out_features,
            None if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(),
            row_stride(out),
            DTYPE_CODES[x.dtype],
            DTYPE_CODES[out.dtype],
            None if residual is None else residual.data_ptr(),
            act,
        )
        assert status == 0, f"{type(self).__name__}: unsupported {x.dtype} -> {out.dtype}"


class PackedLinear(PanelProduct):
    """y = x W^T (+ b) for x [M, K] in the weight's dtype; with `glu` (W an MLP's gate_up,
    gate rows then up rows, fuses_gate_up), y = act(x Wg^T) * (x Wu^T) [M, N / 2], act the
    `activation` (ACTIVATION_CODES), with the bits of glu_mul_cpu over the unfused product's
    float32 output."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        glu: bool = False,
        activation: str = "silu",
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.glu = glu
        self.activation = activation
        if glu:
            assert fuses_gate_up(self.out_features), self.out_features
            weight = gate_up_panels(weight)
            bias = None if bias is None else gate_up_panels(bias)
        self.packed = pack(weight)
        self.bias = None if bias is None else bias.float().contiguous()
        # NOTE: chosen once per layer, so every call of a layer runs the same kernel.
        self.amx = weight.dtype == torch.bfloat16 and amx_enabled()

    def c_function(self) -> Callable[..., int]:
        lib = library()
        return lib.tm_linear_amx if self.amx else lib.tm_linear


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """RMSNorm of x [..., hidden] (float32, or `dtype`) by weight [hidden] (float32) through
    csrc/rms_norm.cpp (its rule is at the file's top), in `dtype`, into rows laid out for the
    products that read it (product_rows)."""
    assert weight.dtype == torch.float32, weight.dtype
    x = x.contiguous()
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    out = product_rows(rows, hidden, dtype)
    status = library().tm_rms_norm(
        x.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        row_stride(out),
        eps,
        DTYPE_CODES[dtype],
        DTYPE_CODES[x.dtype],
    )
    assert status == 0, f"tm_rms_norm: unsupported {x.dtype} -> {dtype}"
    return out.view(*x.shape[:-1], hidden)


def head_norm_cpu(
    rows: torch.Tensor,
    q: tuple[int, int],
    k: tuple[int, int],
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> None:
    """In place, through csrc/rms_norm.cpp: rows [T, width] (contiguous) hold, from their
    first column, q = (count, dim) slices normed by q_weight [dim], then k = (count, dim)
    slices normed by k_weight [dim] (Qwen3: heads; OLMo 2: one slice of all of q, of all of k);
    the weights float32."""
    assert rows.is_contiguous() and q_weight.dtype == k_weight.dtype == torch.float32
    status = library().tm_head_norm(
        rows.data_ptr(),
        rows.shape[0],
        rows.shape[1],
        *q,
        *k,
        q_weight.data_ptr(),
        k_weight.data_ptr(),
        eps,
        DTYPE_CODES[rows.dtype],
    )
    assert status == 0, f"tm_head_norm: unsupported {rows.dtype}"


def norm_add_cpu(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """x [T, hidden] float32 += RMSNorm(y [T, hidden], weight) rounded to y's dtype, in
    place (csrc/rms_norm.cpp's tm_norm_add: a norm after a sublayer, before its residual add);
    weight float32."""
    assert x.dtype == torch.float32 and x.is_contiguous() and weight.dtype == torch.float32
    assert y.stride(-1) == 1 and y.shape == x.shape
    status = library().tm_norm_add(
        y.data_ptr(),
        weight.data_ptr(),
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        row_stride(y),
        eps,
        DTYPE_CODES[y.dtype],
    )
    assert status == 0, f"tm_norm_add: unsupported {y.dtype}"


def slice_sums_cpu(rows: torch.Tensor) -> torch.Tensor:
    """rows [T, width] (unit stride within a row, any row stride) -> [T] float32: each row's
    sum of squares in csrc/rms_norm.cpp's order (a rank's share of a norm split across ranks)."""
    assert rows.dim() == 2 and rows.stride(1) == 1 and rows.dtype in DTYPE_CODES
    sums = torch.empty(rows.shape[0], dtype=torch.float32)
    status = library().tm_slice_sums(
        rows.data_ptr(), rows.shape[0], rows.stride(0), rows.shape[1], sums.data_ptr(),
        DTYPE_CODES[rows.dtype],
    )  # fmt: skip
    assert status == 0, f"tm_slice_sums: unsupported {rows.dtype}"
    return sums


def scale_slices_cpu(
    rows: torch.Tensor, sums: torch.Tensor, whole: int, weight: torch.Tensor, eps: float
) -> None:
    """In place: rows [T, width] = weight * (x * r), r from the whole row's sums [T] (every
    rank's slice_sums_cpu added) over `whole` elements (csrc/rms_norm.cpp's rule)."""
    assert rows.stride(1) == 1 and sums.dtype == weight.dtype == torch.float32
    sums = sums.contiguous()
    status = library().tm_scale_slices(
        rows.data_ptr(), rows.shape[0], rows.stride(0), rows.shape[1], sums.data_ptr(), whole,
        weight.data_ptr(), eps, DTYPE_CODES[rows.dtype],
    )  # fmt: skip
    assert status == 0, f"tm_scale_slices: unsupported {rows.dtype}"


def cast_rows_cpu(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, hidden] float32 in `dtype`, into rows laid out for the products that read it
    (product_rows): a sublayer's input where no norm comes before it (OLMo 2)."""
    x = x.contiguous()
    out = product_rows(x.shape[0], x.shape[1], dtype)
    status = library().tm_cast_rows(
        x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], row_stride(out), DTYPE_CODES[dtype]
    )
    assert status == 0, f"tm_cast_rows: unsupported {dtype}"
    return out


def glu_mul_cpu(
    gate_up: torch.Tensor, out_dtype: torch.dtype | None = None, activation: str = "silu"
) -> torch.Tensor:
    """act(gate) * up for gate_up [N, 2 * inter] through csrc/activation.cpp -> [N, inter]
    in out_dtype (default gate_up's), computed in float32 and rounded once; act is
    `activation` (ACTIVATION_CODES)."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, gate_up.shape
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter, dtype=out_dtype or gate_up.dtype)
    status = library().tm_glu_mul(
        gate_up.data_ptr(),
        out.data_ptr(),
        rows,
        inter,
        DTYPE_CODES[gate_up.dtype],
        DTYPE_CODES[out.dtype],
        ACTIVATION_CODES[activation],
    )
    assert status == 0, f"tm_glu_mul: unsupported {gate_up.dtype} -> {out.dtype}"
    return out


def sigmoid_cpu(x: torch.Tensor) -> torch.Tensor:
    """x (float32) = sigmoid(x) in place through csrc/activation.cpp (our exp: torch's vector
    kernel follows the machine and an element's place in the tensor)."""
    assert x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"
    library().tm_sigmoid(x.data_ptr(), x.numel())
    return x


def soft_cap_cpu(x: torch.Tensor, cap: float) -> torch.Tensor:
    """x (float32) = cap * tanh(x / cap) in place through csrc/activation.cpp (its own tanh:
    torch's picks its vector kernel by the machine and an element's place in the tensor)."""
    assert x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"
    library().tm_soft_cap(x.data_ptr(), x.numel(), cap)
    return x


def rope_store_cpu(
    qkv: torch.Tensor,
    cos_sin: tuple[torch.Tensor, ...],
    kv: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """The fused projection qkv [T, (heads + 2 kv_heads) * D] -> rotated q [T, heads, D];
    the rotated keys and the values go straight into the layer's cache [Hkv, slots, D] at
    `slots` [T] (csrc/rope.cpp: the torch path's numbers, without its temporaries). cos and
    sin are [T, 1, R]: the first R of each head's D rotate (R < D: partial rotary)."""
    k_cache, v_cache = kv
    tokens, dim, rot = qkv.shape[0], k_cache.shape[2], cos_sin[0].shape[-1]
    assert qkv.shape[1] == (heads + 2 * kv_heads) * dim and qkv.dtype == k_cache.dtype
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
    assert slots.dtype == torch.int64 and slots.shape[0] == tokens
    qkv, slots = qkv.contiguous(), slots.contiguous()
    cos, sin = (c.reshape(tokens, rot).contiguous() for c in cos_sin)
    q = qkv.new_empty(tokens, heads, dim)
    status = library().tm_rope_store_partial(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tokens,
        heads,
        kv_heads,
        dim,
        rot,
        k_cache.stride(0),
        k_cache.stride(1),
        DTYPE_CODES[qkv.dtype],
    )
    assert status == 0, f"tm_rope_store_partial: unsupported {qkv.dtype} or rotary width {rot}"
    return q


def glu_mul_panels_cpu(
    panels: torch.Tensor, out_dtype: torch.dtype, activation: str = "silu"
) -> torch.Tensor:
    """glu_mul_cpu's act(gate) * up [N, inter] from a gate/up product's float32 sums
    [N, 2 * inter] in the panel order (gate_up_panels': csrc/layer_stack.cpp's adapted
    gate/up product); the same bits as glu_mul_cpu over the sums in gate-then-up order."""
    assert panels.dtype == torch.float32 and panels.dim() == 2, panels.shape
    panels = panels.contiguous()
    rows, inter = panels.shape[0], panels.shape[1] // 2
    out = panels.new_empty(rows, inter, dtype=out_dtype)
    status = library().tm_glu_mul_panels(
        panels.data_ptr(), out.data_ptr(), rows, inter, inter, DTYPE_CODES[out_dtype],
        ACTIVATION_CODES[activation],
    )  # fmt: skip
    assert status == 0, f"tm_glu_mul_panels: {out_dtype} or inter {inter}"
    return out


# NOTE: csrc/lora.cpp's table layout: per adapter slot, A's address and its rank, then up to
# LORA_SEGMENTS (B's address, first column, width, first u, rank) for a fused projection's parts
LORA_SEGMENTS = 3
LORA_TABLE_WORDS = 2 + 5 * LORA_SEGMENTS
LORA_SHRINK, LORA_EXPAND = 1, 2
LORA_PANELS = 4  # NOTE: y a gate/up product's sums in the panel order (gate_up_panels)
# NOTE: elements past the end of a bfloat16 A or B that csrc/lora.cpp may read (and drop)
LORA_SLACK = 16


def lora_cpu(
    x: torch.Tensor,
    slots: torch.Tensor,
    table: torch.Tensor,
    u: torch.Tensor,
    y: torch.Tensor,
    mode: int = LORA_SHRINK | LORA_EXPAND,
    weights: torch.dtype = torch.float32,
) -> None:
    """In place, through csrc/lora.cpp: u [M, R] = A x for each row of x [M, K] with an
    adapter slot (slots [M] int32, -1: none), then y [M, N] (float32) += B u per segment of
    the slot's entry in table [S, LORA_TABLE_WORDS] (int64), whose A and B are `weights`
    (bfloat16 ones with LORA_SLACK elements past their end); `mode` one half or both, with
    LORA_PANELS where y's columns are in gate_up_panels' order."""
    assert slots.dtype == torch.int32 and table.dtype == torch.int64
    assert u.dtype == y.dtype == torch.float32 and u.stride(1) == 1 and y.stride(1) == 1
    assert x.stride(1) == 1 and x.dtype in DTYPE_CODES
    slots, table = slots.contiguous(), table.contiguous()
    status = library().tm_lora(
        x.data_ptr(), x.shape[0], x.shape[1], row_stride(x), DTYPE_CODES[x.dtype],
        slots.data_ptr(), table.shape[0], table.data_ptr(), u.data_ptr(), row_stride(u),
        y.data_ptr(), row_stride(y), mode, DTYPE_CODES[weights],
    )  # fmt: skip
    assert status == 0, f"tm_lora: {status} (dtype {x.dtype})"
