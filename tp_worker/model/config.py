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
    norms: str = "pre"  # NOTE: families.py's Family.norms
    fused_checkpoint: bool = False
    # NOTE: how many of each head's head_dim elements RoPE rotates (partial_rotary_factor)
    rotary_dim: int = 0
    # NOTE: Granite's multipliers (1, or None for head_dim ** -0.5, in every other family)
    embedding_multiplier: float = 1.0
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
    rope_theta, rope_scaling = _rope(raw, max_model_len)
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
        sliding_window=_sliding_window(raw, family),
        rope_theta=rope_theta,
        qk_norm=family.qk_norm,
        norms=family.norms,
        fused_checkpoint=family.fused_checkpoint,
        rotary_dim=int(head_dim * float(partial)),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        attention_scale=raw.get("attention_multiplier"),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        rope_scaling=rope_scaling,
        checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        eos_token_ids=_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
    )


def _rope(raw: dict[str, Any], max_model_len: int | None) -> tuple[float, dict[str, Any]]:
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


def _sliding_window(raw: dict[str, Any], family: Family) -> int | None:
    """The one window every layer attends in, or None. NOTE: a window on some layers only
    (config.json's `layer_types`; Qwen2 / Qwen3's `max_window_layers` below the layer count)
    is refused: the step's attention plan has one window for every layer."""
    window = raw.get("sliding_window")
    switch = family.sliding_window_switch
    if switch is not None and not raw.get(switch, False):
        return None
    if not window:
        return None
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types")
    if kinds is None and switch is not None:
        first = int(raw.get("max_window_layers") or 0)  # NOTE: transformers' Qwen2 rule
        kinds = ["full_attention"] * min(first, layers) + ["sliding_attention"] * (layers - first)
    if kinds and all(kind == "full_attention" for kind in kinds):
        return None
    if kinds and any(kind != "sliding_attention" for kind in kinds):
        raise ValueError(
            "a sliding window on some layers only (layer_types / max_window_layers) is not "
            "served yet: tokenmill serves one window for every layer, or none"
        )
    return int(window)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)
