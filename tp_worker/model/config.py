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
    qk_norm: bool = False
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    checkpoint_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return parse_model_config(raw)


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
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
    rope_theta, rope_scaling = _rope(raw)
    return ModelConfig(
        architecture=family.name,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=family.qkv_bias or bool(raw.get("attention_bias", False)),
        sliding_window=_sliding_window(raw, family),
        rope_theta=rope_theta,
        qk_norm=family.qk_norm,
        rope_scaling=rope_scaling,
        checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        eos_token_ids=_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
    )


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    if merged.get("rope_type") in (None, "default"):
        merged = {}
    return theta, merged


def _sliding_window(raw: dict[str, Any], family: Family) -> int | None:
    window = raw.get("sliding_window")
    switch = family.sliding_window_switch
    if switch is not None and not raw.get(switch, False):
        return None
    return int(window) if window else None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)
