"""The model families tokenmill runs, as one table of switches (tp_worker).

Every family runs through the same decoder (decoder.py); what sets one apart is a row here,
read once when config.json is parsed (config.py) into plain ModelConfig fields that the
layers read. A new family is a new row, plus, where it differs in a way no switch covers yet,
a new field and the one place in the layers that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str
    # NOTE: None: as config.json's `attention_bias` says (Llama); True: always (Qwen2)
    qkv_bias: bool | None = None
    # NOTE: the output projection's bias: None as `attention_bias` says (Llama, Qwen3, Gemma,
    # gpt-oss, ...), False never (Qwen2, Phi-3, Mistral: transformers gives them none)
    o_bias: bool | None = None
    # NOTE: a learned sink logit per query head in every softmax (gpt-oss)
    attention_sinks: bool = False
    # NOTE: the MLP's activation where the family fixes it (gpt-oss's clamped SwiGLU,
    # "swiglu_oai"), not config.json's hidden_act
    activation: str = ""
    # NOTE: a config.json key that must be true for `sliding_window` to apply (Qwen2 writes
    # a window it does not use unless `use_sliding_window`); None: the window applies
    sliding_window_switch: str | None = None
    # NOTE: an RMSNorm of q and of k before RoPE: over each head ("head": Qwen3), or over the
    # whole projection ("projection": OLMo 2); "": none
    qk_norm: str = ""
    # NOTE: where a layer's norms sit: "pre" (before attention and before the MLP: Llama),
    # "post" (after each, before its residual add: OLMo 2), "both" (Gemma 2 and 3)
    norms: str = "pre"
    # NOTE: the checkpoint holds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
    # (Phi-3); the layers fuse them the same way whatever the checkpoint holds
    fused_checkpoint: bool = False
    # NOTE: every RMSNorm scales by (norm_offset + w) (Gemma: 1 + w, folded at load)
    norm_offset: float = 0.0
    # NOTE: the embeddings times sqrt(hidden_size) rounded to the model's dtype (Gemma)
    scaled_embeddings: bool = False
    # NOTE: the attention scale is query_pre_attn_scalar ** -0.5 (Gemma), not head_dim's
    query_pre_attn_scalar: bool = False
    # NOTE: layer i slides (where config.json has no `layer_types`) unless (i + 1) is a
    # multiple of this (config.json's `sliding_window_pattern` overrides it); 0: every layer
    # slides where a window is set
    window_pattern: int = 0
    # NOTE: a mixture of experts in place of the MLP, its tensors named "mlp" (Qwen3-MoE,
    # OLMoE: mlp.gate, mlp.experts.N.gate_proj / up_proj / down_proj) or "block_sparse_moe"
    # (Mixtral: its gate, experts.N.w1 / w3 / w2); "": a dense MLP
    moe: str = ""
    # NOTE: the top-k weights renormalized to sum to 1: always (True: Mixtral), or as
    # config.json's `norm_topk_prob` says (None)
    moe_renormalize: bool | None = None
    # NOTE: gpt-oss's experts: all of a layer's in one tensor each (mlp.experts.gate_up_proj
    # [E, hidden, 2 inter], gate and up interleaved, and down_proj), biases on the router
    # (mlp.router) and the experts, the softmax over the chosen k's logits
    moe_stacked: bool = False


GEMMA: dict[str, Any] = {
    "norms": "both",
    "norm_offset": 1.0,
    "scaled_embeddings": True,
    "query_pre_attn_scalar": True,
}

FAMILIES: dict[str, Family] = {  # the Hugging Face architecture name -> its switches
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral", o_bias=False),
    "Qwen2ForCausalLM": Family(
        "qwen2", qkv_bias=True, o_bias=False, sliding_window_switch="use_sliding_window"
    ),
    "Qwen3ForCausalLM": Family("qwen3", sliding_window_switch="use_sliding_window", qk_norm="head"),
    "Phi3ForCausalLM": Family("phi3", o_bias=False, fused_checkpoint=True),
    # NOTE: its multipliers are config.json fields (ModelConfig's, default 1 for the rest)
    "GraniteForCausalLM": Family("granite"),
    "Olmo2ForCausalLM": Family("olmo2", qk_norm="projection", norms="post"),
    "Qwen2MoeForCausalLM": Family(
        "qwen2_moe",
        qkv_bias=True,
        o_bias=False,
        sliding_window_switch="use_sliding_window",
        moe="mlp",
    ),
    "Qwen3MoeForCausalLM": Family(
        "qwen3_moe", sliding_window_switch="use_sliding_window", qk_norm="head", moe="mlp"
    ),
    "OlmoeForCausalLM": Family("olmoe", qk_norm="projection", moe="mlp"),
    "MixtralForCausalLM": Family(
        "mixtral", o_bias=False, moe="block_sparse_moe", moe_renormalize=True
    ),
    "GptOssForCausalLM": Family(
        "gpt_oss",
        attention_sinks=True,
        activation="swiglu_oai",
        window_pattern=2,
        moe="mlp",
        moe_stacked=True,
    ),
    # NOTE: their soft-caps and two RoPE tables are config.json fields (ModelConfig's)
    "Gemma2ForCausalLM": Family("gemma2", **GEMMA, window_pattern=2),
    "Gemma3ForCausalLM": Family("gemma3", **GEMMA, qk_norm="head", window_pattern=6),
}
