"""The model's shape, read from a Hugging Face `config.json` (runs in every tp_worker).

Accepts both the older spelling (`rope_theta`, `rope_scaling`, `torch_dtype`) and the newer
one (`rope_parameters`, `dtype`), so checkpoints from either era of `transformers` load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.tp_worker.model.families import FAMILIES, Family


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder needs to know, architecture differences as plain fields."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    rope_theta: float
    qk_norm: str = ""  # NOTE: families.py's Family.qk_norm
    o_bias: bool = False  # NOTE: the output projection has a bias
    attention_sinks: bool = False  # NOTE: families.py's Family.attention_sinks
    norms: str = "pre"  # NOTE: families.py's Family.norms
    fused_checkpoint: bool = False
    norm_offset: float = 0.0  # NOTE: families.py's Family.norm_offset
    activation: str = "silu"  # NOTE: the MLP's gate activation: silu, gelu_tanh, swiglu_oai
    # NOTE: the layers that attend without the sliding window where one is set (Gemma's
    # global layers); the others attend in it
    full_attention_layers: tuple[int, ...] = ()
    # NOTE: > 0: the sliding layers rotate by this base (and local_rope_scaling) instead
    # (Gemma 3's local RoPE)
    local_rope_theta: float = 0.0
    local_rope_scaling: dict[str, Any] = field(default_factory=dict)
    # NOTE: > 0: soft-caps (c * tanh(x / c)) of attention scores and final logits (Gemma 2)
    attention_softcap: float = 0.0
    final_softcap: float = 0.0
    # NOTE: a mixture of experts (model/moe.py) in the layers `moe_layers`; families.py's
    # Family.moe names its tensors
    moe: str = ""
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    # NOTE: model/moe.py's ROUTING_MODES: softmax, renormalized, chosen_softmax (gpt-oss)
    moe_routing: str = "softmax"
    moe_stacked: bool = False  # NOTE: families.py's Family.moe_stacked
    moe_bias: bool = False  # NOTE: biases on the router and the experts (gpt-oss)
    moe_layers: tuple[int, ...] = ()
    shared_expert_size: int = 0  # NOTE: Qwen2-MoE's shared expert's width (0: none)
    # NOTE: how many of each head's head_dim elements RoPE rotates (partial_rotary_factor)
    rotary_dim: int = 0
    # NOTE: Granite's multipliers (1, or None for head_dim ** -0.5, in every other family)
    embedding_multiplier: float = 1.0
    # NOTE: the multiplier is rounded to the model's dtype first (Gemma's sqrt(hidden))
    round_embedding_multiplier: bool = False
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    checkpoint_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None


def load_model_config(model_dir: str | Path, max_model_len: int | None = None) -> ModelConfig:
    """max_model_len: the longest sequence served (see longrope_factors)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return parse_model_config(raw, max_model_len)


def parse_model_config(raw: dict[str, Any], max_model_len: int | None = None) -> ModelConfig:
    architectures = raw.get("architectures") or []
    arch = next((a for a in architectures if a in FAMILIES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architectures {architectures}: tokenmill runs "
            f"{', '.join(sorted(FAMILIES))}"
        )
    family = FAMILIES[arch]
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    rope_theta, rope_scaling, local_rope = _rope(raw, max_model_len)
    window, full_layers = _sliding_window(raw, family)
    partial = raw.get("partial_rotary_factor") or (raw.get("rope_parameters") or {}).get(
        "partial_rotary_factor", 1.0
    )
    return ModelConfig(
        architecture=family.name,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=family.qkv_bias or bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)) if family.o_bias is None else family.o_bias,
        attention_sinks=family.attention_sinks,
        sliding_window=window,
        rope_theta=rope_theta,
        qk_norm=family.qk_norm,
        norms=family.norms,
        fused_checkpoint=family.fused_checkpoint,
        norm_offset=family.norm_offset,
        activation=_activation(raw, family),
        full_attention_layers=full_layers,
        local_rope_theta=local_rope[0],
        local_rope_scaling=local_rope[1],
        **_experts(raw, family),
        attention_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
        rotary_dim=int(head_dim * float(partial)),
        embedding_multiplier=(
            hidden**0.5 if family.scaled_embeddings else float(raw.get("embedding_multiplier", 1.0))
        ),
        round_embedding_multiplier=family.scaled_embeddings,
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        attention_scale=(
            float(raw.get("query_pre_attn_scalar", head_dim)) ** -0.5
            if family.query_pre_attn_scalar
            else raw.get("attention_multiplier")
        ),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        rope_scaling=rope_scaling,
        checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        eos_token_ids=_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
    )


# NOTE: config.json's activation names -> the kernels' (cpu/ops.py's ACTIVATION_CODES)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


# NOTE: gpt-oss's clamped SwiGLU constants, csrc/silu.h's (its checkpoints all have them)
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def _activation(raw: dict[str, Any], family: Family) -> str:
    if family.activation == "swiglu_oai":
        for key, value in SWIGLU.items():
            if float(raw.get(key, value)) != value:
                raise ValueError(
                    f"{key}={raw[key]}: tokenmill's clamped SwiGLU kernels take "
                    f"{', '.join(f'{k}={v}' for k, v in SWIGLU.items())} (gpt-oss's)"
                )
        return family.activation
    name = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if name not in ACTIVATIONS:
        raise ValueError(
            f"the MLP activation {name!r} is not served: tokenmill serves "
            f"{', '.join(sorted(ACTIVATIONS))}"
        )
    return ACTIVATIONS[name]


def _rope(
    raw: dict[str, Any], max_model_len: int | None
) -> tuple[float, dict[str, Any], tuple[float, dict[str, Any]]]:
    """(theta, scaling) of the global layers, and of the local ones ((0.0, {}): none). NOTE:
    Gemma 3 writes one set per layer type (`rope_parameters` keyed by full_attention and
    sliding_attention), or, in older configs, `rope_local_base_freq` beside the global ones."""
    params = dict(raw.get("rope_parameters") or {})
    if "full_attention" in params:
        local = params.get("sliding_attention") or {}
        theta, scaling = _rope_set(
            {**raw, "rope_parameters": params["full_attention"]}, max_model_len
        )
        local_set = _rope_set({**raw, "rope_parameters": local, "rope_scaling": None}, None)
        return theta, scaling, local_set
    theta, scaling = _rope_set(raw, max_model_len)
    if raw.get("rope_local_base_freq"):
        return theta, scaling, (float(raw["rope_local_base_freq"]), {})
    return theta, scaling, (0.0, {})


def _rope_set(raw: dict[str, Any], max_model_len: int | None) -> tuple[float, dict[str, Any]]:
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)
    merged = {**scaling, **params}
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    if merged.get("rope_type") in (None, "default"):
        return theta, {}
    if merged["rope_type"] in ("longrope", "su"):
        merged = longrope_factors(merged, raw, max_model_len)
    return theta, merged


def longrope_factors(
    scaling: dict[str, Any], raw: dict[str, Any], max_model_len: int | None
) -> dict[str, Any]:
    """LongRoPE with its factor set chosen once per server. NOTE: transformers switches
    between short and long factors by the longest position of each forward call, so one
    token's numbers would follow the schedule it ran in; here the short factors serve every
    sequence when the server takes none longer than the original length (what transformers
    computes for each of them), else the long ones serve every sequence (what transformers
    computes for any longer than that)."""
    original = int(
        scaling.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or raw["max_position_embeddings"]
    )
    longest = max_model_len or int(raw["max_position_embeddings"])
    factor = scaling.get("factor") or int(raw["max_position_embeddings"]) / original
    return {
        **scaling,
        "rope_type": "longrope",
        "original_max_position_embeddings": original,
        "factor": float(factor),
        "use_long_factor": longest > original,
    }


def _sliding_window(raw: dict[str, Any], family: Family) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window (or None) and the layers that attend without it: config.json's
    `layer_types`, else the family's rule (Qwen2 / Qwen3's `max_window_layers`, Gemma's
    pattern), else every layer in the window."""
    window = raw.get("sliding_window")
    switch = family.sliding_window_switch
    if switch is not None and not raw.get(switch, False):
        return None, ()
    if not window:
        return None, ()
    if raw.get("use_bidirectional_attention"):
        raise ValueError(
            "use_bidirectional_attention (an embedding model's attention) is not served: "
            "tokenmill serves causal decoders"
        )
    kinds = raw.get("layer_types") or _default_layer_types(raw, family)
    full = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    if any(kind not in ("full_attention", "sliding_attention") for kind in kinds):
        raise ValueError(
            f"layer_types {sorted(set(kinds))}: tokenmill serves full_attention "
            "and sliding_attention layers"
        )
    if kinds and len(full) == len(kinds):
        return None, ()
    return int(window), full


def _default_layer_types(raw: dict[str, Any], family: Family) -> list[str]:
    layers = int(raw["num_hidden_layers"])
    if family.sliding_window_switch is not None:
        first = int(raw.get("max_window_layers") or 0)  # NOTE: transformers' Qwen2 rule
        return ["full_attention"] * min(first, layers) + ["sliding_attention"] * (layers - first)
    pattern = int(raw.get("sliding_window_pattern") or family.window_pattern)
    if pattern <= 0:
        return []
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]


def _experts(raw: dict[str, Any], family: Family) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields: the experts, the k each token takes, their
    width, and the layers that have them (Qwen3-MoE: every `decoder_sparse_step`-th but its
    `mlp_only_layers`; every layer otherwise)."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if not family.moe or not experts:
        return {}
    layers, step = int(raw["num_hidden_layers"]), int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    renormalize = family.moe_renormalize
    if renormalize is None:
        renormalize = bool(raw.get("norm_topk_prob", False))
    routing = "renormalized" if renormalize else "softmax"
    if family.moe_stacked:
        routing = "chosen_softmax"
    return {
        "shared_expert_size": int(raw.get("shared_expert_intermediate_size") or 0),
        "moe": family.moe,
        "num_experts": experts,
        "experts_per_token": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        "moe_routing": routing,
        "moe_stacked": family.moe_stacked,
        "moe_bias": family.moe_stacked,
        "moe_layers": tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
    }


def layer_window(config: ModelConfig, index: int) -> int:
    """The window layer `index` attends in (0: none)."""
    if config.sliding_window is None or index in config.full_attention_layers:
        return 0
    return config.sliding_window


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)
