"""A mixture of experts in place of a layer's MLP (tp_worker): Qwen3-MoE, OLMoE, Mixtral,
Qwen2-MoE with its shared expert, and gpt-oss (biases on the router and the experts, the
softmax over the chosen k, the clamped SwiGLU).

The router's logits are the model's dtype, as transformers computes them; each token's top-k
experts and weights come from csrc/route.cpp (softmax in float32, a fixed tie rule). Each
expert multiplies the rows routed to it at once (its weights stream once a step for all of
them), and a row's sums follow from its own elements only (csrc/linear.cpp's rule), so its
output does not depend on which other rows share the expert. A token's k expert outputs
(float32) are then added in the order of its top-k, weighted: never in the order the
experts ran; a shared expert (Qwen2-MoE) is added last, scaled by the sigmoid of its gate
(csrc/activation.cpp's). So a token's bits are its own in any batch, chunk or schedule.

On the CPU kernels a layer's experts run in one call (csrc/moe.cpp, the loop below with its
bits), and without a shared expert the whole layer runs inside the layer stack's call
(cpu/layer_stack.py). Tensor parallelism shards every expert's intermediate dimension: each
rank's partial sums of a token's k outputs, all-reduced once.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.tp_worker.cpu.kernels import library
from tokenmill.tp_worker.cpu.ops import (
    ACTIVATION_CODES,
    DTYPE_CODES,
    PackedLinear,
    glu_mul_cpu,
    product_input,
    row_stride,
    sigmoid_cpu,
)
from tokenmill.tp_worker.model.config import ModelConfig
from tokenmill.tp_worker.model.parallel import TpGroup, invariant_linear
from tokenmill.tp_worker.model.routing_log import RoutingLog

# NOTE: tokens a pass of the experts takes (a prefill chunk goes through in passes): each pass
# holds its tokens' k float32 outputs, [TOKENS_PER_PASS, k, hidden], so the memory is bounded
# (Qwen3-30B-A3B's 8 x 2,048 take 64 MiB a pass); a token's bits do not depend on its pass.
TOKENS_PER_PASS = 1024
# NOTE: gpt-oss's clamped SwiGLU's constants (csrc/silu.h's; config.py refuses others)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class Routing:
    ids: torch.Tensor  # [T, k] int64 each token's experts, best first
    weights: torch.Tensor  # [T, k] float32 their weights


# NOTE: csrc/route.cpp's modes: the softmax over all E then the top-k, as they are or
# renormalized; or gpt-oss's top-k of the logits weighed by the softmax of those k
ROUTING_MODES = {"softmax": 0, "renormalized": 1, "chosen_softmax": 2}


def route(logits: torch.Tensor, k: int, mode: int) -> Routing:
    """Each row of logits [T, E] (float32, on the CPU) -> its top-k experts and weights
    (csrc/route.cpp; mode: ROUTING_MODES)."""
    logits = logits.float().contiguous().cpu()
    tokens, experts = logits.shape
    ids = torch.empty(tokens, k, dtype=torch.int64)
    weights = torch.empty(tokens, k, dtype=torch.float32)
    status = library().tm_route(
        logits.data_ptr(), tokens, experts, k, mode, ids.data_ptr(), weights.data_ptr()
    )
    assert status == 0, f"tm_route: k={k} of {experts} experts"
    return Routing(ids, weights)


class SparseMoe(nn.Module):
    """The experts of one layer: router [E, hidden], gate_up [E, 2 inter, hidden] (gate rows
    then up rows, this rank's share of each), down [E, hidden, inter]; with config.moe_bias
    (gpt-oss), their biases: the router's, gate_up's [E, 2 inter] (this rank's share) and
    down's [E, hidden] (added by rank 0 alone, before the all-reduce)."""

    def __init__(
        self, config: ModelConfig, group: TpGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        inter = config.moe_intermediate_size // group.size
        self.group = group
        self.top_k = config.experts_per_token
        self.routing = ROUTING_MODES[config.moe_routing]
        self.activation = config.activation
        self.router = nn.Parameter(
            torch.empty(experts, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.gate_up = nn.Parameter(
            torch.empty(experts, 2 * inter, hidden, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.down = nn.Parameter(
            torch.empty(experts, hidden, inter, dtype=dtype, device=device), requires_grad=False
        )
        biases = ((experts,), (experts, 2 * inter), (experts, hidden)) if config.moe_bias else ()
        self.biases = nn.ParameterList(
            nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
            for shape in biases
        )
        self.adds_down_bias = group.rank == 0
        # NOTE: Qwen2-MoE's shared expert (every token's), this rank's share, and its gate
        shared = config.shared_expert_size // group.size
        self.shared = (
            nn.ParameterList(
                nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
                for shape in ((2 * shared, hidden), (hidden, shared), (1, hidden))
            )
            if shared
            else None
        )
        # NOTE: where the server returns routed experts, the log this layer adds its routing
        # to, as its `log_index`-th MoE layer (CausalLM.log_routing)
        self.log: RoutingLog | None = None
        self.log_index = 0
        # NOTE: csrc/linear.cpp's panels per expert (use_cpu_kernel), or None: torch's products
        self.kernels: list[tuple[PackedLinear, PackedLinear]] | None = None
        self.router_kernel: PackedLinear | None = None
        # NOTE: every expert's packed gate/up and down panels' addresses, for csrc/moe.cpp
        # (use_cpu_kernel, where every gate/up takes its activation in the epilogue)
        self.panels: tuple[ctypes.Array[ctypes.c_void_p], ...] | None = None
        # NOTE: the experts' packed biases' addresses (gate/up, down) where they have biases
        self.bias_panels: tuple[ctypes.Array[ctypes.c_void_p], ...] | None = None
        self.shared_kernels: tuple[PackedLinear, PackedLinear, PackedLinear] | None = None

    def use_cpu_kernel(self) -> None:
        """Every expert's products through csrc/ from now on (after the weights are loaded);
        the unpacked weights are freed, as ShardedLinear frees its own."""
        glu = self.gate_up.shape[1] % 32 == 0
        router_bias, gate_up_bias, down_bias = self._bias_parts()
        self.kernels = [
            (
                PackedLinear(g, gate_up_bias[e], glu=glu, activation=self.activation),
                PackedLinear(d, down_bias[e]),
            )
            for e, (g, d) in enumerate(zip(self.gate_up.data, self.down.data, strict=True))
        ]
        self.router_kernel = PackedLinear(self.router.data, router_bias)
        if glu:
            self.panels = tuple(
                (ctypes.c_void_p * len(self.kernels))(
                    *(k[i].packed.data_ptr() for k in self.kernels)
                )
                for i in (0, 1)
            )
        if glu and self.biases:
            self.bias_panels = tuple(
                (ctypes.c_void_p * len(self.kernels))(*(_bias_address(k[i]) for k in self.kernels))
                for i in (0, 1)
            )
        if self.shared is not None:
            gate_up, down, gate = (p.data for p in self.shared)
            glu = gate_up.shape[0] % 32 == 0
            self.shared_kernels = (
                PackedLinear(gate_up, None, glu=glu, activation=self.activation),
                PackedLinear(down, None),
                PackedLinear(gate, None),
            )
        # NOTE: the biases stay: a packed kernel may hold a float32 bias itself, not a copy
        kept = {id(p) for p in self.biases}
        for param in self.parameters():
            if id(param) not in kept:
                param.data = param.data.new_empty(0)

    def _bias_parts(self) -> tuple[torch.Tensor | None, list[Any], list[Any]]:
        """The router's bias, and each expert's gate/up and down biases (Nones where the
        experts have none; down's on rank 0 alone)."""
        if not self.biases:
            return None, [None] * self.num_experts, [None] * self.num_experts
        router, gate_up, down = (p.data for p in self.biases)
        downs = list(down) if self.adds_down_bias else [None] * self.num_experts
        return router, list(gate_up), downs

    @property
    def num_experts(self) -> int:
        return int(self.router.shape[0]) if self.kernels is None else len(self.kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the MLP's normed input, the model's dtype) -> [T, hidden] float32."""
        if x.shape[0] > TOKENS_PER_PASS:
            parts = [self._routed(part) for part in x.split(TOKENS_PER_PASS)]
            return self.group.all_reduce(torch.cat(parts))
        return self.group.all_reduce(self._routed(x))

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums for the tokens x [T, hidden] -> [T, hidden] float32."""
        routing = route(self._router_logits(x), self.top_k, self.routing)
        if self.log is not None:
            self.log.add(self.log_index, routing.ids)
        out = self._native_experts(x, routing) if self.panels else self._experts(x, routing)
        if self.shared is not None:
            out = out + self._shared_expert(x)
        return out

    def _native_experts(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts' weighted sum through csrc/moe.cpp: the loop of _experts in one call,
        with its bits (tested)."""
        assert self.panels is not None and self.kernels is not None
        x = product_input(x)
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32)
        gate_up, down = self.kernels[0]
        status = library().tm_moe_experts(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            row_stride(x),
            routing.ids.data_ptr(),
            routing.weights.data_ptr(),
            self.top_k,
            *self.panels,
            *(self.bias_panels or (None, None)),
            len(self.kernels),
            down.in_features,
            DTYPE_CODES[x.dtype],
            ACTIVATION_CODES[self.activation],
            int(gate_up.amx),
            out.data_ptr(),
            None,
            0,
            0,
        )
        assert status == 0, f"tm_moe_experts: {x.dtype}, experts {routing.ids.unique()}"
        return out

    def _experts(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts' weighted sum, expert by expert from Python (the torch path, and
        gate/up widths whose activation runs apart)."""
        outputs = x.new_zeros(x.shape[0], self.top_k, x.shape[1], dtype=torch.float32)
        ids = routing.ids.to(x.device)
        for expert in torch.unique(ids).tolist():
            tokens, slots = (ids == expert).nonzero(as_tuple=True)
            outputs[tokens, slots] = self._expert(expert, x[tokens])
        weights = routing.weights.to(x.device)
        out = outputs[:, 0] * weights[:, :1]
        for slot in range(1, self.top_k):  # NOTE: in the order of the top-k, every time
            out = out + outputs[:, slot] * weights[:, slot : slot + 1]
        return out

    def _shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """Qwen2-MoE's shared expert over every token, times the sigmoid of its gate (the gate's
        logit in the model's dtype, as transformers computes it) -> [T, hidden] float32."""
        assert self.shared is not None
        if self.shared_kernels is not None:
            gate_up, down, gate = self.shared_kernels
            scale = sigmoid_cpu(gate(x, torch.float32).to(x.dtype).float().contiguous())
            return self._packed_mlp((gate_up, down), x) * scale
        shared = self._torch_mlp(self.shared[0], self.shared[1], x)
        return shared * torch.sigmoid(invariant_linear(x, self.shared[2]).float())

    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E] as transformers computes them: in the model's dtype (then float32)."""
        if self.router_kernel is not None:
            return self.router_kernel(x, torch.float32).to(x.dtype).float()
        bias = self.biases[0] if self.biases else None
        return invariant_linear(x, self.router, bias).float()

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """One expert's MLP over the rows routed to it -> [R, hidden] float32 (this rank's
        partial sums)."""
        if self.kernels is not None:
            return self._packed_mlp(self.kernels[expert], rows)
        biases = (None, None)
        if self.biases:
            down = self.biases[2][expert] if self.adds_down_bias else None
            biases = (self.biases[1][expert], down)
        return self._torch_mlp(self.gate_up[expert], self.down[expert], rows, biases)

    def _packed_mlp(
        self, kernels: tuple[PackedLinear, PackedLinear], rows: torch.Tensor
    ) -> torch.Tensor:
        """act(rows Wg) * (rows Wu) through csrc/ (in the gate/up epilogue where the width
        allows), then its down product -> [R, hidden] float32."""
        gate_up, down = kernels
        if gate_up.glu:
            activated = gate_up(rows)
        else:
            activated = glu_mul_cpu(gate_up(rows, torch.float32), rows.dtype, self.activation)
        return down(activated, torch.float32)

    def _torch_mlp(
        self,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        rows: torch.Tensor,
        biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    ) -> torch.Tensor:
        """The same with torch's products (act(gate) * up in float32, rounded once)."""
        gate, up = invariant_linear(rows, gate_up, biases[0]).float().chunk(2, dim=-1)
        activated = torch_glu(self.activation, gate, up).to(rows.dtype)
        return invariant_linear(activated, down, biases[1]).float()


def torch_glu(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up in torch (float32 in, float32 out): csrc/silu.h's activations."""
    if activation == "swiglu_oai":  # NOTE: gpt-oss's, as transformers' GptOssExperts has it
        gate = gate.clamp(max=SWIGLU_LIMIT)
        up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


def _bias_address(kernel: PackedLinear) -> int | None:
    return None if kernel.bias is None else int(kernel.bias.data_ptr())
