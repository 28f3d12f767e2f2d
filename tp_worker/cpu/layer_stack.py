"""A step's decoder layers as one native call (tp_worker): csrc/layer_stack.cpp.

It calls the kernels model/decoder.py's DecoderLayer calls through ctypes one at a time, in the same
order, on the same operands and into rows laid out the same way, so every bit is the Python
loop's. What it takes away is what lay between those calls: at one decode row on SmolLM2 a
layer's eight kernels run in ~0.14 ms, and the Python and ctypes around them (argument
conversion, torch's allocations and views) added ~0.08 ms more, 30 layers deep (a 2-core Zen
5; docs/performance.md, "One user at a time").

Used where the whole layer runs in csrc/: one rank (a row-parallel product's all-reduce is
torch.distributed's, between kernels), our paged attention, the MLP's gate/up product with
its fused activation epilogue, or a mixture of experts without a shared expert (its router,
top-k and experts: csrc/moe.cpp); biases where a family has them (q/k/v, the output
product's, gpt-oss's router and experts) and gpt-oss's attention sinks.
TOKENMILL_CPU_LAYER_STACK=0 turns it off (the Python loop, for an A/B or a test: the two give
the same bits).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from weakref import ReferenceType, ref

import torch

from tokenmill.tp_worker.cpu.attention import PagedAttention, uses_amx
from tokenmill.tp_worker.cpu.kernels import library
from tokenmill.tp_worker.cpu.ops import (
    ACTIVATION_CODES,
    DTYPE_CODES,
    PackedLinear,
    product_rows,
    rows_alias,
)
from tokenmill.tp_worker.cpu.quantized import QuantLinear
from tokenmill.tp_worker.model import moe as moe_module

if TYPE_CHECKING:
    from tokenmill.tp_worker.model.decoder import DecoderLayer
    from tokenmill.tp_worker.model.lora_rows import LoraRows
    from tokenmill.tp_worker.model.moe import SparseMoe

# NOTE: a layer's row of the weights table, csrc/layer_stack.cpp's Field order.
FIELDS = (
    "input_norm",
    "qkv",
    "qkv_bias",
    "o",
    "post_norm",
    "gate_up",
    "down",
    "k",
    "v",
    "q_norm",
    "k_norm",
    "attn_out_norm",
    "mlp_out_norm",
    "window",
    "local_rope",
    "router",
    "experts",
    "moe_index",
    "sinks",
    "o_bias",
    "router_bias",
    "expert_biases",
    "lora_qkv",
    "lora_o",
    "lora_gate_up",
    "lora_down",
    "quantized",
)
# NOTE: csrc/layer_stack.cpp's QuantBit: the products whose weights are a GGUF file's blocks
QUANT_BITS = {"qkv_proj": 1, "o_proj": 2, "gate_up_proj": 4, "down_proj": 8}
# NOTE: the products whose adapters' tables (model/lora.py's ProjectionLora) the stack reads
LORA_PRODUCTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
K_COLUMN, V_COLUMN = FIELDS.index("k"), FIELDS.index("v")
# NOTE: csrc/layer_stack.cpp's Shape.qk_norm
QK_NORM_CODES = {"": 0, "head": 1, "projection": 2}
# NOTE: steps of at most this many tokens keep their scratch rows for the next step (decode
# steps come one after another with the same count); a prefill chunk's are freed with it.
KEEP_SCRATCH_TOKENS = 64


def enabled() -> bool:
    return os.environ.get("TOKENMILL_CPU_LAYER_STACK", "1") != "0"


class LayerStack:
    """The layers' packed weights and norms as a table of addresses (made once, after the CPU
    kernels packed them), the KV caches' added per cache allocation."""

    def __init__(self, layers: Sequence[DecoderLayer], dtype: torch.dtype) -> None:
        first = layers[0]
        self.dtype = dtype
        self.hidden = _kernel(first.qkv_proj).in_features
        self.heads, self.kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim = first.head_dim
        self.rotary_dim = first.rotary_dim
        self.layers = list(layers)
        dense = [layer for layer in layers if layer.moe is None]
        self.moe = [layer.moe for layer in layers if layer.moe is not None]
        self.inter = _kernel(dense[0].gate_up_proj).out_features // 2 if dense else 0
        self.eps = first.eps
        self.scale = first.attention_settings.scale
        self.softcap = first.attention_settings.softcap
        activation = _kernel(dense[0].gate_up_proj).activation if dense else self.moe[0].activation
        self.activation = ACTIVATION_CODES[activation]
        # NOTE: every dense product's choice (PackedLinear.amx); one in blocks never is
        self.linear_amx = any(
            _kernel(getattr(layer, name)).amx
            for layer in layers
            for name in QUANT_BITS
            if getattr(layer, name) is not None
        )
        self.attention_amx = uses_amx(dtype, self.head_dim)  # NOTE: as PagedAttention.attend
        # NOTE: the experts' panels' addresses, gate/up then down, one array per MoE layer
        self._panels = [_expert_panels(moe) for moe in self.moe]
        self._biases = [_expert_biases(moe) for moe in self.moe]
        self.table = torch.zeros(len(layers), len(FIELDS), dtype=torch.int64)
        moe_indices = {id(moe): index for index, moe in enumerate(self.moe)}
        for row, layer in zip(self.table, layers, strict=True):
            bias = _kernel(layer.qkv_proj).bias
            moe = layer.moe
            index = -1 if moe is None else moe_indices[id(moe)]
            addresses = {
                "input_norm": _address(layer.input_layernorm),
                "qkv": _kernel(layer.qkv_proj).packed.data_ptr(),
                "qkv_bias": 0 if bias is None else bias.data_ptr(),
                "o": _kernel(layer.o_proj).packed.data_ptr(),
                "post_norm": _address(layer.post_attention_layernorm),
                "gate_up": 0 if moe else _kernel(layer.gate_up_proj).packed.data_ptr(),
                "down": 0 if moe else _kernel(layer.down_proj).packed.data_ptr(),
                "router": 0 if moe is None else _router(moe).packed.data_ptr(),
                "experts": 0 if moe is None else ctypes.addressof(self._panels[index]),
                "moe_index": max(index, 0),
                "sinks": _tensor_address(layer.attention_settings.sinks),
                "o_bias": _tensor_address(_kernel(layer.o_proj).bias),
                "router_bias": 0 if moe is None else _tensor_address(_router(moe).bias),
                "expert_biases": _biases_address(self._biases[index] if moe else None),
                "q_norm": _address(layer.q_norm),
                "k_norm": _address(layer.k_norm),
                "attn_out_norm": _address(layer.attn_out_norm),
                "mlp_out_norm": _address(layer.mlp_out_norm),
                "window": layer.attention_settings.window,
                "local_rope": int(layer.local_rope),
                "quantized": sum(
                    bit
                    for name, bit in QUANT_BITS.items()
                    if isinstance(getattr(getattr(layer, name), "kernel", None), QuantLinear)
                ),
            }
            for name, address in addresses.items():
                row[FIELDS.index(name)] = address
        self.qk_norm = QK_NORM_CODES[first.qk_norm_scope]
        # NOTE: the cache the table's K and V columns point into, known by its first tensor
        # (held weakly: a released cache must be freed, and a new one is a new tensor).
        self._cache_key: ReferenceType[torch.Tensor] | None = None
        self._scratch: Scratch | None = None
        # NOTE: --enable-lora (model/lora_slots.py): u's width (3 x --max-lora-rank covers
        # q, k and v side by side) and the tables' slots; 0 while LoRA is off
        self.lora_width = 0
        self.num_lora_slots = 0
        self.point_at_lora()  # NOTE: new kernels (new weights) keep the layers' adapters
        self._shape: tuple[tuple[int, ...], ctypes.Array[ctypes.c_int64]] | None = None

    def point_at_lora(self) -> None:
        """The LORA_* columns at the layers' adapter tables (their addresses never change:
        an adapter loads into its table in place), 0 where a product has none."""
        for row, layer in zip(self.table, self.layers, strict=True):
            for name in LORA_PRODUCTS:
                lora = getattr(getattr(layer, name), "lora", None)
                row[FIELDS.index("lora_" + name.removesuffix("_proj"))] = (
                    0 if lora is None else lora.table.data_ptr()
                )
                if lora is not None:
                    self.lora_width, self.num_lora_slots = lora.u_width, len(lora.entries)

    @staticmethod
    def of(layers: Sequence[DecoderLayer], dtype: torch.dtype, tp_size: int) -> LayerStack | None:
        """The stack where every part of every layer runs in csrc/ (see the top), else None."""
        if not enabled() or tp_size != 1 or dtype not in DTYPE_CODES or not layers:
            return None
        for layer in layers:
            moe = layer.moe
            if moe is not None and (not moe.panels or moe.shared is not None):
                return None  # NOTE: experts from Python, or a shared expert (Qwen2-MoE's)
            mlp = (layer.gate_up_proj, layer.down_proj) if moe is None else ()
            linears = (layer.qkv_proj, layer.o_proj, *mlp)
            if any(getattr(linear, "kernel", None) is None for linear in linears):
                return None
            if moe is None and not _kernel(layer.gate_up_proj).glu:
                return None
            if moe is None and layer.down_proj.bias is not None:
                return None
        return LayerStack(layers, dtype)

    def run(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        local_cos_sin: tuple[torch.Tensor, ...] | None,
        attention: PagedAttention,
        kv_cache: Sequence[tuple[torch.Tensor, torch.Tensor]],
        count: int,
        lora: LoraRows | None = None,
    ) -> None:
        """The first `count` layers over the float32 residual stream x [T, hidden] (in place);
        local_cos_sin: the RoPE table of the layers that rotate by the local one (or None);
        lora: the tokens' adapters (model/lora_rows.py; None: the base's alone)."""
        assert lora is None or self.lora_width, "adapters in a stack without LoRA"
        assert attention.query_index is None, "a plan that drops queries is the last layer's"
        assert x.dtype == torch.float32 and x.is_contiguous(), (x.dtype, x.stride())
        # NOTE: the kernels take raw pointers: what they read must be laid out as they expect.
        assert attention.table.dtype == torch.int32 and attention.table.is_contiguous()
        tokens = x.shape[0]
        if tokens == 0 or count == 0:
            return
        k_cache = kv_cache[0][0]
        self._point_at(kv_cache)
        cos, sin = (c.reshape(tokens, self.rotary_dim).contiguous() for c in cos_sin)
        local_cos, local_sin = (
            (c.reshape(tokens, self.rotary_dim).contiguous() for c in local_cos_sin)
            if local_cos_sin is not None
            else (None, None)
        )
        slots = attention.out_slots.contiguous()
        scratch = self._scratch_for(tokens, lora is not None)  # NOTE: held until it returns
        status = library().tm_layer_stack(
            self.table.data_ptr(),
            count,
            self._shape_for(k_cache),
            self.eps,
            self.scale,
            self.softcap,
            x.data_ptr(),
            tokens,
            cos.data_ptr(),
            sin.data_ptr(),
            None if local_cos is None else local_cos.data_ptr(),
            None if local_sin is None else local_sin.data_ptr(),
            slots.data_ptr(),
            attention.table.data_ptr(),
            attention.table.shape[1],
            attention.rows.data_ptr(),
            attention.token_starts.data_ptr(),
            attention.num_tokens.data_ptr(),
            attention.first_pos.data_ptr(),
            attention.rows.shape[0],
            scratch.addresses,
            None if lora is None else lora.slots.data_ptr(),
            self.num_lora_slots,
        )
        assert status == 0, f"tm_layer_stack failed ({status})"
        if scratch.routed is not None:
            self._log_routing(scratch.routed, count)

    def _log_routing(self, routed: torch.Tensor, count: int) -> None:
        """The routing of the MoE layers among the first `count` into their log."""
        ran = sum(layer.moe is not None for layer in self.layers[:count])
        for index, moe in enumerate(self.moe[:ran]):
            if moe.log is not None:
                moe.log.add(moe.log_index, routed[index].clone())

    def _shape_for(self, k_cache: torch.Tensor) -> ctypes.Array[ctypes.c_int64]:
        """Shape's fields (csrc/layer_stack.cpp), made again only where the cache's layout
        changed."""
        fields = (
            self.hidden,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.inter,
            DTYPE_CODES[self.dtype],
            int(self.linear_amx),
            int(self.attention_amx),
            self.activation,
            k_cache.stride(0),
            k_cache.stride(1),
            self.rotary_dim,
            self.qk_norm,
            *self._moe_shape(),
        )
        if self._shape is None or self._shape[0] != fields:
            self._shape = (fields, (ctypes.c_int64 * len(fields))(*fields))
        return self._shape[1]

    def _moe_shape(self) -> tuple[int, int, int, int, int]:
        """Shape's expert fields: count, k, width, renormalized, tokens a pass (0s without)."""
        if not self.moe:
            return 0, 0, 0, 0, moe_module.TOKENS_PER_PASS
        moe = self.moe[0]
        assert moe.kernels is not None
        width = moe.kernels[0][1].in_features
        passes = moe_module.TOKENS_PER_PASS
        return len(moe.kernels), moe.top_k, width, moe.routing, passes

    def _point_at(self, kv_cache: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The table's K and V columns at this cache (written again only for a new cache)."""
        first = kv_cache[0][0]
        if self._cache_key is not None and self._cache_key() is first:
            return
        assert len(kv_cache) == len(self.table), (len(kv_cache), len(self.table))
        for row, (k, v) in zip(self.table, kv_cache, strict=True):
            assert k.stride() == v.stride() == first.stride() and k.dtype == self.dtype
            row[K_COLUMN], row[V_COLUMN] = k.data_ptr(), v.data_ptr()
        self._cache_key = ref(first)

    def _scratch_for(self, tokens: int, adapted: bool = False) -> Scratch:
        """The rows a layer's intermediates go to, laid out as the Python loop lays them out
        (cpu/ops.py's product_rows where a product reads them); `adapted`: with the rows
        the adapters' deltas go through."""
        cached = self._scratch
        if cached is not None and cached.tokens == tokens and cached.adapted == adapted:
            return cached
        dtype, q_width = self.dtype, self.heads * self.head_dim
        normed = product_rows(tokens, self.hidden, dtype)
        qkv = torch.empty(tokens, q_width + 2 * self.kv_heads * self.head_dim, dtype=dtype)
        q = torch.empty(tokens, q_width, dtype=dtype)
        attended = torch.empty(tokens, q_width, dtype=dtype)
        # NOTE: cpu/ops.py's product_input's copy, where attention's rows would alias in L1.
        aliased = tokens > 1 and rows_alias(q_width, dtype)
        attended_rows = product_rows(tokens, q_width, dtype) if aliased else None
        activated = product_rows(tokens, max(self.inter, 1), dtype)
        experts = self._moe_scratch(tokens)
        fields = (
            normed.data_ptr(),
            normed.stride(0),
            qkv.data_ptr(),
            q.data_ptr(),
            attended.data_ptr(),
            0 if attended_rows is None else attended_rows.data_ptr(),
            0 if attended_rows is None else attended_rows.stride(0),
            activated.data_ptr(),
            activated.stride(0),
            *(0 if t is None else t.data_ptr() for t in experts),
        )
        lora = self._lora_scratch(tokens, q_width) if adapted else (None, None, None)
        fields += (
            0 if lora[0] is None else lora[0].data_ptr(),
            self.lora_width,
            *(0 if t is None else t.data_ptr() for t in lora[1:]),
        )
        held = [t for t in (normed, qkv, q, attended, attended_rows, activated) if t is not None]
        held += [t for t in (*experts, *lora) if t is not None]
        fields_array = (ctypes.c_int64 * len(fields))(*fields)
        scratch = Scratch(tokens, fields_array, held, experts[4], adapted)
        self._scratch = scratch if tokens <= KEEP_SCRATCH_TOKENS else None
        return scratch

    def _lora_scratch(self, tokens: int, q_width: int) -> tuple[torch.Tensor, ...]:
        """u [T, lora_width] (zeros: a row of no adapter is never read), a product's float32
        output [T, widest], the gate/up product's in panel order [T, 2 inter]."""
        widest = max(q_width + 2 * self.kv_heads * self.head_dim, self.hidden)
        return (
            torch.zeros(tokens, self.lora_width, dtype=torch.float32),
            torch.empty(tokens, widest, dtype=torch.float32),
            torch.empty(tokens, max(2 * self.inter, 1), dtype=torch.float32),
        )

    def _moe_scratch(self, tokens: int) -> tuple[torch.Tensor | None, ...]:
        """The experts' rows (csrc/layer_stack.cpp's Scratch: logits, ids, weights, their sum,
        every MoE layer's ids where a routing log keeps them), or Nones without experts."""
        if not self.moe:
            return (None,) * 5
        experts, k = len(self.moe[0].kernels or ()), self.moe[0].top_k
        routed = self.moe[0].log is not None
        return (
            torch.empty(tokens, experts, dtype=torch.float32),
            torch.empty(tokens, k, dtype=torch.int64),
            torch.empty(tokens, k, dtype=torch.float32),
            torch.empty(tokens, self.hidden, dtype=torch.float32),
            torch.empty(len(self.moe), tokens, k, dtype=torch.int64) if routed else None,
        )


@dataclass(frozen=True)
class Scratch:
    tokens: int
    addresses: ctypes.Array[ctypes.c_int64]  # csrc/layer_stack.cpp's Scratch fields
    tensors: list[torch.Tensor]  # what the addresses point into
    routed: torch.Tensor | None = None  # [MoE layers, T, k] their ids, where a log keeps them
    adapted: bool = False  # with the adapters' rows (csrc/layer_stack.cpp's lora_* fields)


def _address(norm: torch.nn.Module | None) -> int:
    """A norm's weight, or 0 where the layer has none there."""
    if norm is None:
        return 0
    weight = norm.weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.data_ptr())


def _tensor_address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else int(tensor.data_ptr())


def _biases_address(biases: ctypes.Array[ctypes.c_void_p] | None) -> int:
    return 0 if biases is None else ctypes.addressof(biases)


def _expert_biases(moe: SparseMoe) -> ctypes.Array[ctypes.c_void_p] | None:
    """gate/up bias addresses of every expert, then down ones (csrc/layer_stack.cpp's
    EXPERT_BIASES), or None where the experts have none."""
    if moe.bias_panels is None:
        return None
    gate_up, down = moe.bias_panels
    return (ctypes.c_void_p * (2 * len(gate_up)))(*gate_up, *down)


def _router(moe: SparseMoe) -> PackedLinear:
    assert moe.router_kernel is not None
    return moe.router_kernel


def _expert_panels(moe: SparseMoe) -> ctypes.Array[ctypes.c_void_p]:
    """gate/up addresses of every expert, then down ones (csrc/layer_stack.cpp's EXPERTS)."""
    assert moe.panels is not None
    gate_up, down = moe.panels
    return (ctypes.c_void_p * (2 * len(gate_up)))(*gate_up, *down)


def _kernel(linear: torch.nn.Module | None) -> PackedLinear | QuantLinear:
    kernel = getattr(linear, "kernel", None)
    assert isinstance(kernel, (PackedLinear, QuantLinear)), linear
    return kernel
