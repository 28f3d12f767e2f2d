"""The decoder shared by the Llama-shaped families (tp_worker): Llama, Mistral, Qwen2, Qwen3,
Phi-3, Granite, OLMo 2, Gemma 2 and 3, and the mixtures of experts (model/moe.py) Qwen3-MoE,
Qwen2-MoE, OLMoE, Mixtral and gpt-oss.

The families differ only in fields of ModelConfig (q/k/v bias, q/k norms, where the norms sit,
tied embeddings, sliding windows, RoPE tables and scaling, multipliers, soft-caps, attention
sinks, the MLP's activation), so one module runs them all.
Layers are tensor-parallel (parallel.py); q/k/v and gate/up projections are fused into one
matmul each.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.tp_worker.cpu.attention import PagedAttention
from tokenmill.tp_worker.cpu.layer_stack import LayerStack
from tokenmill.tp_worker.cpu.ops import (
    PackedLinear,
    cast_rows_cpu,
    head_norm_cpu,
    norm_add_cpu,
    rms_norm_cpu,
    scale_slices_cpu,
    slice_sums_cpu,
    soft_cap_cpu,
)
from tokenmill.tp_worker.cpu.quantized import QuantLinear
from tokenmill.tp_worker.cuda import rowwise as rowwise_triton
from tokenmill.tp_worker.cuda.linear import triton_linear
from tokenmill.tp_worker.model.attention import Attention
from tokenmill.tp_worker.model.config import ModelConfig, layer_window
from tokenmill.tp_worker.model.layer_attention import LayerAttention
from tokenmill.tp_worker.model.lora import EmbeddingLora, ProjectionLora
from tokenmill.tp_worker.model.lora_rows import LoraRows
from tokenmill.tp_worker.model.moe import SparseMoe
from tokenmill.tp_worker.model.parallel import (
    ShardedLinear,
    TpGroup,
    VocabEmbedding,
    invariant_linear,
)
from tokenmill.tp_worker.model.rope import Rotary
from tokenmill.tp_worker.model.routing_log import RoutingLog


class RMSNorm(nn.Module):
    """Its weight is float32 in every dtype (csrc/rms_norm.cpp: a bfloat16 checkpoint's is exact
    in float32; Gemma's 1 + w, folded at load, is a float32 sum in transformers); its output
    is `dtype`."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.dtype = dtype
        self.weight = nn.Parameter(
            torch.ones(hidden, dtype=torch.float32, device=device), requires_grad=False
        )
        self.cpu_kernel = False  # csrc/rms_norm.cpp, switched on by CausalLM.use_cpu_kernels
        self.triton = False  # cuda/rowwise.py on CUDA, switched on by use_triton_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] (the float32 residual stream) -> `dtype`."""
        if self.cpu_kernel:
            return rms_norm_cpu(x, self.weight, self.eps, self.dtype)
        if self.triton and rowwise_triton.runs_on(x):
            # NOTE: torch's mean splits a row by the batch's shape (cuda/rowwise.py)
            return rowwise_triton.rms_norm(x, self.weight, self.eps, self.dtype)
        # NOTE: in float32 throughout, rounded once to the model's dtype (csrc/rms_norm.cpp's
        # rule; transformers in bfloat16 also rounds x * r before the weight multiplies it).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(self.dtype)


def local_kv_heads(config: ModelConfig, group: TpGroup) -> int:
    """KV heads on this rank: a share, or one replicated head when there are fewer than ranks."""
    return max(1, config.num_kv_heads // group.size)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        group: TpGroup,
        dtype: torch.dtype,
        device: torch.device,
        index: int = 0,
    ) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads = config.num_heads // group.size
        self.num_kv_heads = local_kv_heads(config, group)
        self.head_dim = head_dim
        self.rotary_dim = config.rotary_dim or head_dim
        window = layer_window(config, index)
        # NOTE: gpt-oss's sink logits, this rank's heads' (float32, as norms' weights are)
        self.sinks = (
            nn.Parameter(
                torch.zeros(self.num_heads, dtype=torch.float32, device=device),
                requires_grad=False,
            )
            if config.attention_sinks
            else None
        )
        self.attention_settings = LayerAttention(
            config.attention_scale or head_dim**-0.5, window, config.attention_softcap, self.sinks
        )
        # NOTE: the sliding layers rotate by the local RoPE table where the model has one
        self.local_rope = bool(window) and config.local_rope_theta > 0
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        inter = config.intermediate_size // group.size
        eps = config.rms_norm_eps
        pre, post = config.norms in ("pre", "both"), config.norms in ("post", "both")
        self.eps = eps  # NOTE: every norm's of the layer (cpu/layer_stack.py)
        # NOTE: None where the family has no norm there (OLMo 2 norms outputs, not inputs)
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device) if pre else None
        self.qkv_proj = ShardedLinear(
            hidden, qkv_out, config.attention_bias, False, group, dtype, device
        )
        self.o_proj = ShardedLinear(
            self.num_heads * head_dim, hidden, config.o_bias, True, group, dtype, device
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device) if pre else None
        self.attn_out_norm = RMSNorm(hidden, eps, dtype, device) if post else None
        self.mlp_out_norm = RMSNorm(hidden, eps, dtype, device) if post else None
        # NOTE: a mixture of experts in the family's MoE layers (model/moe.py), else the MLP
        self.moe = SparseMoe(config, group, dtype, device) if index in config.moe_layers else None
        dense = self.moe is None
        self.gate_up_proj = (
            ShardedLinear(
                hidden, 2 * inter, False, False, group, dtype, device, glu=config.activation
            )
            if dense
            else None
        )
        self.down_proj = (
            ShardedLinear(inter, hidden, False, True, group, dtype, device) if dense else None
        )
        self.qk_norm_scope = config.qk_norm
        self.q_norm = self.k_norm = None
        # NOTE: OLMo 2's norms over the whole q and k, split across the ranks' heads
        self.split_norm = config.qk_norm == "projection" and group.size > 1
        self.group = group
        self.whole_widths = (config.num_heads * head_dim, config.num_kv_heads * head_dim)
        if config.qk_norm:
            whole = config.qk_norm == "projection"
            if self.split_norm and config.num_kv_heads % group.size:
                raise ValueError(
                    f"{config.architecture}'s k norm spans every KV head: its "
                    f"{config.num_kv_heads} KV heads do not divide among "
                    f"--tensor-parallel-size {group.size}"
                )
            q_width = self.num_heads * head_dim if whole else head_dim
            k_width = self.num_kv_heads * head_dim if whole else head_dim
            self.q_norm = RMSNorm(q_width, eps, dtype, device)
            self.k_norm = RMSNorm(k_width, eps, dtype, device)
        # NOTE: the last layer's keys and values alone (use_kv_kernel), for the steps where
        # it attends from a few tokens only: their q/k/v then go through qkv_proj, and every
        # other token's q is never computed.
        self.kv_kernel: PackedLinear | QuantLinear | None = None

    def use_kv_kernel(self) -> None:
        """Packs the k and v rows of qkv_proj on their own (before its weights are freed).
        Each output column sums its own products in one order whichever panel holds it
        (csrc/linear.cpp's rule), so k and v get the fused product's bits."""
        q_out = self.num_heads * self.head_dim
        bias = self.qkv_proj.bias
        kv_bias = None if bias is None else bias.data[q_out:]
        segments = self.qkv_proj.block_segments(q_out)
        if segments:  # NOTE: a GGUF file's blocks (model/blocks.py)
            self.kv_kernel = QuantLinear(segments, self.qkv_proj.weight.dtype, kv_bias)
            return
        self.qkv_proj.dequantize_blocks()
        self.kv_kernel = PackedLinear(self.qkv_proj.weight.data[q_out:], kv_bias)

    def norm_heads(self, rows: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """rows [T, width], heads side by side from the first column: the first `heads` (q)
        and the next `kv_heads` (k) through q_norm and k_norm (each head: Qwen3; all of q,
        all of k: OLMo 2), or rows as they are."""
        if self.q_norm is None or self.k_norm is None:
            return rows
        if self.split_norm:
            return self._split_norm_heads(rows, heads, kv_heads)
        dim, tokens = self.head_dim, rows.shape[0]
        whole = self.qk_norm_scope == "projection"
        q = (min(heads, 1), heads * dim) if whole else (heads, dim)
        k = (min(kv_heads, 1), kv_heads * dim) if whole else (kv_heads, dim)
        if self.q_norm.cpu_kernel:
            rows = rows.contiguous()
            head_norm_cpu(rows, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            return rows
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        q_rows = self.q_norm(rows[:, :q_end].reshape(-1, q[1])) if heads else rows[:, :0]
        k_rows = self.k_norm(rows[:, q_end:k_end].reshape(-1, k[1])) if kv_heads else rows[:, :0]
        parts = (q_rows.reshape(tokens, q_end), k_rows.reshape(tokens, k_end - q_end))
        return torch.cat((*parts, rows[:, k_end:]), dim=1)

    def _split_norm_heads(self, rows: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """OLMo 2's q and k norms at TP > 1, each over the whole projection that the ranks
        share: this rank's sums of squares of its heads, all-reduced, then its heads scaled by
        the whole row's r (csrc/rms_norm.cpp's tm_slice_sums and tm_scale_slices)."""
        assert self.q_norm is not None and self.k_norm is not None
        rows = rows.contiguous()
        q_end, k_end = heads * self.head_dim, (heads + kv_heads) * self.head_dim
        parts = [
            (x, norm, whole)
            for x, norm, whole in (
                (rows[:, :q_end], self.q_norm, self.whole_widths[0]),
                (rows[:, q_end:k_end], self.k_norm, self.whole_widths[1]),
            )
            if x.shape[1]
        ]
        cpu = self.q_norm.cpu_kernel
        sums = torch.stack(
            [slice_sums_cpu(x) if cpu else x.float().pow(2).sum(-1) for x, _, _ in parts], 1
        )
        self.group.all_reduce(sums)
        for i, (x, norm, whole) in enumerate(parts):
            if cpu:
                scale_slices_cpu(x, sums[:, i], whole, norm.weight, norm.eps)
            else:
                inv = torch.rsqrt(sums[:, i : i + 1] / whole + norm.eps)
                x.copy_((norm.weight * (x.float() * inv)).to(x.dtype))
        return rows

    def layer_input(self, x: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """A sublayer's input: x [T, hidden] (float32) through its norm, or, where it has
        none (OLMo 2), rounded to the model's dtype."""
        if norm is not None:
            return norm(x)
        if self.qkv_proj.kernel is not None:
            return cast_rows_cpu(x, self.qkv_proj.weight.dtype)
        return x.to(self.qkv_proj.weight.dtype)

    def add_output(
        self,
        proj: ShardedLinear,
        rows: torch.Tensor,
        x: torch.Tensor,
        norm: RMSNorm | None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """x + proj(rows): in proj's epilogue, or, with an output norm (OLMo 2), x + the norm
        of proj(rows) rounded to the model's dtype."""
        if norm is None:
            return proj(rows, residual=x, lora=lora)
        out = proj(rows, lora=lora)
        if norm.cpu_kernel:
            x = x.contiguous()
            norm_add_cpu(x, out, norm.weight, norm.eps)
            return x
        return x + norm(out).float()

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        attention: Attention,
        kv: tuple[torch.Tensor, torch.Tensor],
        keep: torch.Tensor | None = None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] float32 -> [T, hidden] float32; with `keep` [K] (the tokens
        `attention` attends), every token's key and value into the cache and [K, hidden] out.
        `lora`: the rows' adapters (lora_rows.py; None: the base model's alone)."""
        normed = self.layer_input(x, self.input_layernorm)
        rest = (cos_sin, kv, self.num_heads, self.num_kv_heads, self.attention_settings)
        # NOTE: kv_kernel's k and v are the base's: with adapters, every row's through qkv_proj
        if keep is not None and self.kv_kernel is not None and lora is None:
            assert isinstance(attention, PagedAttention)
            kept = self.norm_heads(self.qkv_proj(normed[keep]), self.num_heads, 0)
            kv_rows = self.norm_heads(self.kv_kernel(normed), 0, self.num_kv_heads)
            attended = attention.attend_projection(kept, *rest, kv_rows=kv_rows)
        else:
            qkv = self.qkv_proj(normed, lora=lora)
            qkv = self.norm_heads(qkv, self.num_heads, self.num_kv_heads)
            attended = attention.attend_projection(qkv, *rest)
        if keep is not None:
            x = x[keep]
            lora = None if lora is None else lora.take(keep)
        x = self.add_output(self.o_proj, attended, x, self.attn_out_norm, lora)
        mlp_in = self.layer_input(x, self.post_attention_layernorm)
        if self.moe is not None:
            return x + self.moe(mlp_in)
        assert self.gate_up_proj is not None and self.down_proj is not None
        activated = self.gate_up_proj(mlp_in, lora=lora)  # act(gate) * up
        return self.add_output(self.down_proj, activated, x, self.mlp_out_norm, lora)


class CausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, group: TpGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.config = config
        self.group = group
        self.dtype = dtype
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, group, dtype, device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, group, dtype, device, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else VocabEmbedding(config.vocab_size, config.hidden_size, group, dtype, device)
        )
        rotary_dim = config.rotary_dim or config.head_dim
        self.rotary = Rotary(rotary_dim, config.rope_theta, config.rope_scaling, device)
        self.local_rotary = (
            Rotary(rotary_dim, config.local_rope_theta, config.local_rope_scaling, device)
            if config.local_rope_theta > 0
            else None
        )
        self.embedding_multiplier = config.embedding_multiplier
        if config.round_embedding_multiplier:  # NOTE: Gemma's, a tensor in the model's dtype
            self.embedding_multiplier = torch.tensor(
                config.embedding_multiplier, dtype=dtype
            ).item()
        self.lm_head_kernel: PackedLinear | QuantLinear | None = None
        self.layer_stack: LayerStack | None = None  # csrc/layer_stack.cpp, use_cpu_kernels
        self.triton_lm_head = False
        # NOTE: --enable-lora: the adapters' embedding and lm_head deltas (lora.py)
        self.embed_lora: EmbeddingLora | None = None
        self.lm_head_lora: ProjectionLora | None = None

    def use_cpu_kernels(self) -> None:
        """Run the dense layers through csrc/ (after the weights are loaded)."""
        last = self.layers[-1]
        assert isinstance(last, DecoderLayer)
        last.use_kv_kernel()
        for module in self.modules():
            if isinstance(module, ShardedLinear):
                module.use_cpu_kernel()
            elif isinstance(module, RMSNorm):
                module.cpu_kernel = True
            elif isinstance(module, SparseMoe):
                module.use_cpu_kernel()
        for table in {id(t): t for t in (self.embed_tokens, self.lm_head)}.values():
            if not table.use_blocks():  # NOTE: a GGUF file's blocks, multiplied as they are
                table.dequantize_blocks()
        self.lm_head_kernel = self.lm_head.quant or PackedLinear(self.lm_head.weight.data, None)
        self.layer_stack = LayerStack.of(
            [layer for layer in self.layers if isinstance(layer, DecoderLayer)],
            self.dtype,
            self.group.size,
        )
        if self.lm_head is not self.embed_tokens:
            self.lm_head.weight.data = self.lm_head.weight.data.new_empty(0)

    def block_kernels(self) -> list[QuantLinear]:
        """The products that multiply a GGUF file's blocks (each once: a tied lm_head is
        the embedding's)."""
        kernels = [getattr(m, "kernel", None) for m in self.modules()]
        kernels += [getattr(m, "kv_kernel", None) for m in self.modules()]
        kernels += [self.embed_tokens.quant, self.lm_head_kernel]
        unique = {id(k): k for k in kernels if isinstance(k, QuantLinear)}
        return list(unique.values())

    def dequantize_blocks(self) -> None:
        """A GGUF file's blocks as float weights, for the paths that multiply those (torch,
        CUDA): use_cpu_kernels multiplies them as they are instead."""
        for module in self.modules():
            if isinstance(module, (ShardedLinear, VocabEmbedding)):
                module.dequantize_blocks()

    def log_routing(self) -> RoutingLog:
        """From now on, every MoE layer adds its tokens' experts to the log returned."""
        moe = [layer.moe for layer in self.layers if isinstance(layer, DecoderLayer) and layer.moe]
        log = RoutingLog(len(moe), self.config.experts_per_token)
        for index, layer in enumerate(moe):
            layer.log, layer.log_index = log, index
        return log

    def drop_cpu_kernels(self) -> None:
        """The packed panels gone: the layers multiply their (restored) weights with torch
        until use_cpu_kernels packs them again."""
        for module in self.modules():
            if isinstance(module, ShardedLinear):
                module.kernel = None
            elif isinstance(module, VocabEmbedding):
                module.quant = None
            elif isinstance(module, DecoderLayer):
                module.kv_kernel = None
            elif isinstance(module, SparseMoe):
                module.kernels = module.router_kernel = module.panels = None
                module.bias_panels = None
        self.lm_head_kernel = None
        self.layer_stack = None

    def use_triton_kernels(self) -> None:
        """Every linear layer, the lm_head and RMSNorm through cuda/ (where CUDA runs them):
        each row's output the same bits in any batch, the logits float32 from the
        accumulators."""
        for module in self.modules():
            if isinstance(module, (ShardedLinear, RMSNorm)):
                module.triton = True
        self.triton_lm_head = True

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        last: tuple[Attention, torch.Tensor] | None = None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]; with `last`
        (the last layer's plan and the tokens [K] it attends), [K, hidden] of those tokens.
        `lora`: the tokens' adapters (None: the base model's alone)."""
        # NOTE: the residual stream is float32 in every dtype: in bfloat16 each layer's two
        # adds rounded it again, 30 layers deep on SmolLM2; float32 took tokenmill bfloat16's
        # mean logprob error against float64 from 0.020 to 0.016 there (float64_distance.py).
        x = self._embed(input_ids, lora)
        cos_sin = self.rotary.cos_sin(positions, self.dtype)
        local = (
            None if self.local_rotary is None else self.local_rotary.cos_sin(positions, self.dtype)
        )
        count = len(self.layers)
        native = self._native_layers(attention, last, lora)
        if native:
            assert self.layer_stack is not None and isinstance(attention, PagedAttention)
            self.layer_stack.run(x, cos_sin, local, attention, kv_cache, native, lora)
        for index in range(native, count):
            layer, kv = self.layers[index], kv_cache[index]
            assert isinstance(layer, DecoderLayer)
            rope = local if layer.local_rope and local is not None else cos_sin
            if index == count - 1 and last is not None:
                x = layer(x, rope, last[0], kv, last[1], lora)
            else:
                x = layer(x, rope, attention, kv, lora=lora)
        return self.norm(x)

    def _embed(self, input_ids: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        """The float32 residual stream's start: the embeddings, times the family's multiplier
        (Granite's in float32 as transformers multiplies; Gemma's sqrt(hidden), rounded to the
        model's dtype, then in float32, where transformers rounds the product again: equal
        in float32)."""
        x = self.embed_tokens(input_ids).float()
        if lora is not None and self.embed_lora is not None:
            self.embed_lora.add(input_ids, x, lora)  # NOTE: PEFT's, before the multiplier
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        return x

    def _native_layers(
        self,
        attention: Attention,
        last: tuple[Attention, torch.Tensor] | None,
        lora: LoraRows | None = None,
    ) -> int:
        """How many layers from the first run as one native call (cpu/layer_stack.py): all, or
        all but a last layer that computes a few tokens only."""
        if self.layer_stack is None or not isinstance(attention, PagedAttention):
            return 0
        if lora is not None and not self.layer_stack.lora_width:
            return 0
        return len(self.layers) - (0 if last is None else 1)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab], gathered from every rank; `lora`:
        the rows' adapters, whose lm_head deltas add to this rank's float32 logits."""
        if self.lm_head_kernel is not None:
            # NOTE: float32 straight from the accumulators: no rounding of logits to bfloat16.
            local = self.lm_head_kernel(hidden, torch.float32)
        elif self.triton_lm_head:
            local = triton_linear(hidden, self.lm_head.weight, None, torch.float32)
        else:
            local = invariant_linear(hidden, self.lm_head.weight).float()
        if lora is not None and self.lm_head_lora is not None:
            local = local.contiguous()
            self.lm_head_lora.add(hidden, local, lora, self.group.all_reduce)
        logits = self.group.all_gather_last_dim(local)[:, : self.config.vocab_size]
        if self.config.logits_scaling != 1.0:  # NOTE: Granite's divisor, as transformers divides
            logits = logits / self.config.logits_scaling
        if self.config.final_softcap > 0:
            logits = self._soft_capped(logits.contiguous())
        return logits

    def _soft_capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft-cap, c * tanh(logits / c): our own tanh on the CPU (torch's
        vector kernel there follows the machine and an element's place in the batch)."""
        cap = self.config.final_softcap
        if logits.device.type == "cpu":
            return soft_cap_cpu(logits, cap)
        return torch.tanh(logits / cap) * cap
