"""config.json and random safetensors weights for the locally built checkpoints.

Run by the frontend when it builds a demo or test checkpoint. The weights are random but
scaled so that next-token distributions are peaked and depend on context (attention and
MLP outputs are as large as the embedding), which is what logprob and KV-cache tests need.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

ARCHS = (
    "llama",
    "qwen2",
    "mistral",
    "qwen3",
    "phi3",
    "granite",
    "olmo2",
    "gemma2",
    "gemma3",
    "qwen3_moe",
    "olmoe",
    "mixtral",
    "qwen2_moe",
    "gpt_oss",
)
PRESETS = ("tiny", "small", "medium")

# Above this many bytes of weights, write HF-style shards plus an index file.
SHARD_BYTES = 200 * 1024 * 1024
MAX_POSITION_EMBEDDINGS = 16384

# Standard deviation of the final logits over the vocab (before softmax). With the
# context-dependent hidden state this makes the top-1 probability typically > 0.3.
LOGIT_STD = 6.0
# Scale of q/k projections relative to 1/sqrt(hidden): > 1 makes attention non-uniform.
QK_GAIN = 2.0
# Scale of o_proj/down_proj: layer outputs well above the embedding's rms, so that with tied
# embeddings (qwen2) a token's own logit does not dominate and the model does not just repeat.
OUT_GAIN = 3.0
BIAS_STD = 0.1
# NOTE: per-head q/k norm weights (Qwen3) spread around 1 by this much: weights of ones would
# hide a norm loaded into the wrong place or not applied at all.
NORM_STD = 0.2

# (tensor name, shape, init std); std 0 means a norm weight of ones, a norm with a std
# spreads around 1.
TensorSpec = tuple[str, tuple[int, ...], float]


@dataclass(frozen=True)
class ModelShape:
    """Sizes of one preset; every head is `head_dim` wide."""

    hidden_size: int
    """Residual width, = num_attention_heads * head_dim."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """KV heads (GQA when fewer than the query heads)."""
    num_hidden_layers: int
    """Decoder layers."""
    intermediate_size: int
    """MLP width."""
    vocab_size: int
    """Embedding rows; also the tokenizer's training target."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PRESET_SHAPES = {
    "tiny": ModelShape(64, 4, 2, 2, 128, 1024),
    "small": ModelShape(512, 8, 2, 6, 1408, 8192),
    "medium": ModelShape(768, 12, 4, 12, 2048, 32768),
}

_ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# NOTE: the mixtures of experts: 4 experts, 2 a token, each half the dense MLP's width;
# router rows of this std, so that a token's experts follow the token
MOE_EXPERTS, MOE_TOP_K, ROUTER_GAIN = 4, 2, 2.0
# NOTE: gpt-oss's gate/up rows this much wider than 1/sqrt(hidden): a few gates and ups past
# its SwiGLU's clamp at 7, so that the clamp is exercised; its sinks of std 1, near the scores
SWIGLU_GAIN, SINK_STD = 3.0, 1.0
# NOTE: config.json's model_type where it is not the arch's name
_MODEL_TYPES = {"gemma3": "gemma3_text"}
# NOTE: a sliding window short enough that the tests' prompts reach past it, on every other
# layer (Gemma 2's pattern; Gemma 3's 5:1 would leave a 2-layer model without a global layer)
GEMMA_WINDOW = 16
# NOTE: the config keys in which the families differ
_ARCH_FIELDS: dict[str, dict[str, Any]] = {
    "llama": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    "mistral": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        # NOTE: YaRN as Qwen3's model cards enable it for long context (factor 4 over 4,096):
        # it rescales every frequency and cos / sin, so short prompts test it too.
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": MAX_POSITION_EMBEDDINGS // 4,
        },
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
    },
    # NOTE: Phi-4-mini's way: RoPE on 3/4 of each head, LongRoPE over 4,096 positions
    # (rope_scaling's factor lists are filled in by make_config, one per rotated pair)
    "phi3": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": MAX_POSITION_EMBEDDINGS // 4,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    },
    # NOTE: Granite 3's multipliers, none of them 1 (its own: 12, 1 / 64, 0.22, 8), milder so
    # that the tiny model's distributions stay peaked
    "granite": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "embedding_multiplier": 4.0,
        "attention_multiplier": 0.125,
        "residual_multiplier": 0.5,
        "logits_scaling": 2.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
    },
    "olmo2": {
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    # NOTE: soft-caps far below Gemma 2's own (50 and 30), so that they bite on a tiny model's
    # scores and logits; query_pre_attn_scalar not the head size (Gemma 2 27B's way)
    "gemma2": {
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": 3.0,
        "final_logit_softcapping": 20.0,
        "sliding_window": GEMMA_WINDOW,
        "attention_bias": False,
        "tie_word_embeddings": True,
    },
    # NOTE: two RoPE tables (the global one with linear scaling, as Gemma 3 4B and up), q/k
    # norms, no soft-caps
    "gemma3": {
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "sliding_window": GEMMA_WINDOW,
        "attention_bias": False,
        "tie_word_embeddings": True,
    },
}


_MOE_FIELDS: dict[str, dict[str, Any]] = {
    # NOTE: Qwen3-MoE's way: per-head q/k norms, the top-k renormalized, a dense first layer
    # (mlp_only_layers, as the RL checkpoints have)
    "qwen3_moe": {
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "num_experts": MOE_EXPERTS,
        "num_experts_per_tok": MOE_TOP_K,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    },
    # NOTE: OLMoE: q/k norms over the whole projection, the top-k weights not renormalized
    "olmoe": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_experts": MOE_EXPERTS,
        "num_experts_per_tok": MOE_TOP_K,
        "norm_topk_prob": False,
    },
    "mixtral": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "num_local_experts": MOE_EXPERTS,
        "num_experts_per_tok": MOE_TOP_K,
    },
}
# NOTE: Qwen2-MoE's way: q/k/v biases, the top-k not renormalized, a shared expert as wide
# as the dense MLP beside the routed ones
_MOE_FIELDS["qwen2_moe"] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 0,
    "tie_word_embeddings": False,
    "num_experts": MOE_EXPERTS,
    "num_experts_per_tok": MOE_TOP_K,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
# NOTE: gpt-oss's way: q/k/v/o biases, a sink per head, every other layer in a window, yarn,
# biased router and experts (one tensor each), the softmax over the chosen k
_MOE_FIELDS["gpt_oss"] = {
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        # NOTE: gpt-oss's 131,072 / 4,096 = factor, at the test checkpoints' length
        "original_max_position_embeddings": MAX_POSITION_EMBEDDINGS // 32,
    },
    "attention_bias": True,
    "sliding_window": GEMMA_WINDOW,
    "tie_word_embeddings": False,
    "num_local_experts": MOE_EXPERTS,
    "num_experts_per_tok": MOE_TOP_K,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}
_ARCH_FIELDS.update(_MOE_FIELDS)


def moe_layers(config: dict[str, Any]) -> list[int]:
    """The layers with experts (transformers' rule: Qwen3-MoE's mlp_only_layers dense)."""
    if config["model_type"] not in _MOE_FIELDS:
        return []
    dense = set(config.get("mlp_only_layers") or [])
    return [i for i in range(config["num_hidden_layers"]) if i not in dense]


def _arch_fields(arch: str) -> dict[str, Any]:
    if arch not in _ARCH_FIELDS:
        raise ValueError(f"arch={arch!r} is not one of {ARCHS}")
    return copy.deepcopy(_ARCH_FIELDS[arch])


def make_config(arch: str, shape: ModelShape, token_ids: dict[str, int]) -> dict[str, Any]:
    """config.json contents; `token_ids` holds bos_token_id, eos_token_id, pad_token_id."""
    config: dict[str, Any] = {
        "architectures": [_ARCH_CLASSES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
        **token_ids,
        **_arch_fields(arch),
    }
    if arch == "qwen3":
        # NOTE: heads wider than hidden / heads, as on Qwen3-0.6B (1,024 = 16 x 64, heads of
        # 128): the q width and the o_proj's input are not the hidden size.
        config["head_dim"] = 2 * shape.head_dim
        config["max_window_layers"] = shape.num_hidden_layers
    elif arch != "qwen2":
        config["head_dim"] = shape.head_dim
    if arch in _MOE_FIELDS:
        # NOTE: each expert half the dense MLP's width (Qwen3-MoE's dense layers keep it)
        width = shape.intermediate_size // 2
        qwen = arch in ("qwen3_moe", "qwen2_moe")
        config["moe_intermediate_size" if qwen else "intermediate_size"] = width
        if arch == "qwen2_moe":
            config["shared_expert_intermediate_size"] = shape.intermediate_size
    if arch in ("gemma2", "gemma3", "gpt_oss"):
        if arch != "gpt_oss":
            del config["hidden_act"]
            config["query_pre_attn_scalar"] = shape.head_dim // 2
        config["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(shape.num_hidden_layers)
        ]
    if arch == "phi3":
        pairs = int(shape.head_dim * config["partial_rotary_factor"]) // 2
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
            "long_factor": [1.0 + 1.5 * i for i in range(pairs)],
        }
    return config


def _layer_specs(config: dict[str, Any], i: int) -> list[TensorSpec]:
    """(name, shape, init std) of decoder layer `i`; std 0 means a norm weight of ones."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    std, p = 1.0 / math.sqrt(hidden), f"model.layers.{i}."
    specs: list[TensorSpec] = [
        (p + "input_layernorm.weight", (hidden,), 0.0),
        (p + "self_attn.q_proj.weight", (q_dim, hidden), QK_GAIN * std),
        (p + "self_attn.k_proj.weight", (kv_dim, hidden), QK_GAIN * std),
        (p + "self_attn.v_proj.weight", (kv_dim, hidden), std),
        (p + "self_attn.o_proj.weight", (hidden, q_dim), OUT_GAIN / math.sqrt(q_dim)),
        (p + "post_attention_layernorm.weight", (hidden,), 0.0),
        (p + "mlp.gate_proj.weight", (inter, hidden), std),
        (p + "mlp.up_proj.weight", (inter, hidden), std),
        (p + "mlp.down_proj.weight", (hidden, inter), OUT_GAIN / math.sqrt(inter)),
    ]
    if config["model_type"] in ("qwen2", "qwen2_moe", "gpt_oss"):
        for name, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
            specs.append((p + f"self_attn.{name}_proj.bias", (dim,), BIAS_STD))
    if config["model_type"] == "gpt_oss":
        specs.append((p + "self_attn.o_proj.bias", (hidden,), BIAS_STD))
        specs.append((p + "self_attn.sinks", (config["num_attention_heads"],), SINK_STD))
    if config["model_type"] in ("qwen3", "qwen3_moe"):
        specs += [(p + f"self_attn.{name}_norm.weight", (head_dim,), NORM_STD) for name in "qk"]
    if config["model_type"] == "olmoe":  # NOTE: its q/k norms over the whole projection
        specs += [
            (p + "self_attn.q_norm.weight", (q_dim,), NORM_STD),
            (p + "self_attn.k_norm.weight", (kv_dim,), NORM_STD),
        ]
    if config["model_type"] == "olmo2":
        # NOTE: OLMo 2's norms: after attention and after the MLP (not before them), and over
        # all of q and all of k before RoPE
        specs = [spec for spec in specs if not spec[0].endswith("layernorm.weight")]
        specs += [
            (p + "post_attention_layernorm.weight", (hidden,), NORM_STD),
            (p + "post_feedforward_layernorm.weight", (hidden,), NORM_STD),
            (p + "self_attn.q_norm.weight", (q_dim,), NORM_STD),
            (p + "self_attn.k_norm.weight", (kv_dim,), NORM_STD),
        ]
    if config["model_type"].startswith("gemma"):
        # NOTE: Gemma's norms: before and after attention and the MLP, each scaling by 1 + w
        # (written around 0: _make_tensor), and Gemma 3's per-head q/k norms
        specs = [spec for spec in specs if not spec[0].endswith("layernorm.weight")]
        names = ("input", "post_attention", "pre_feedforward", "post_feedforward")
        specs += [(p + f"{name}_layernorm.weight", (hidden,), NORM_STD) for name in names]
        if config["model_type"] == "gemma3_text":
            specs += [(p + f"self_attn.{n}_norm.weight", (head_dim,), NORM_STD) for n in "qk"]
    if i in moe_layers(config):
        specs = [spec for spec in specs if ".mlp." not in spec[0]] + _expert_specs(config, p)
    if config["model_type"] == "phi3":
        # NOTE: Phi-3's layout: q/k/v as one qkv_proj, gate/up as one gate_up_proj
        specs = [spec for spec in specs if not re.search(r"\.(q|k|v|gate|up)_proj\.", spec[0])]
        specs.append((p + "self_attn.qkv_proj.weight", (q_dim + 2 * kv_dim, hidden), QK_GAIN * std))
        specs.append((p + "mlp.gate_up_proj.weight", (2 * inter, hidden), std))
    return specs


def _expert_specs(config: dict[str, Any], p: str) -> list[TensorSpec]:
    """A mixture of experts' router and experts, by the family's names (Mixtral's w1, w3, w2
    under block_sparse_moe; mlp.experts.N.*_proj otherwise)."""
    hidden = config["hidden_size"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    experts = config.get("num_experts") or config["num_local_experts"]
    std = 1.0 / math.sqrt(hidden)
    if config["model_type"] == "gpt_oss":  # NOTE: every expert's tensors stacked in one
        return [
            (p + "mlp.router.weight", (experts, hidden), ROUTER_GAIN * std),
            (p + "mlp.router.bias", (experts,), BIAS_STD),
            (p + "mlp.experts.gate_up_proj", (experts, hidden, 2 * inter), SWIGLU_GAIN * std),
            (p + "mlp.experts.gate_up_proj_bias", (experts, 2 * inter), BIAS_STD),
            (p + "mlp.experts.down_proj", (experts, inter, hidden), OUT_GAIN / math.sqrt(inter)),
            (p + "mlp.experts.down_proj_bias", (experts, hidden), BIAS_STD),
        ]
    mixtral = config["model_type"] == "mixtral"
    scope = p + ("block_sparse_moe" if mixtral else "mlp")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes = (
        (inter, hidden, std),
        (inter, hidden, std),
        (hidden, inter, OUT_GAIN / math.sqrt(inter)),
    )
    specs: list[TensorSpec] = [(f"{scope}.gate.weight", (experts, hidden), ROUTER_GAIN * std)]
    for e in range(experts):
        for name, (rows, cols, gain) in zip(names, shapes, strict=True):
            specs.append((f"{scope}.experts.{e}.{name}.weight", (rows, cols), gain))
    shared = config.get("shared_expert_intermediate_size")
    if shared:  # NOTE: Qwen2-MoE's shared expert and its gate
        for name, shape in (("gate", (shared, hidden)), ("up", (shared, hidden))):
            specs.append((f"{scope}.shared_expert.{name}_proj.weight", shape, std))
        down_std = OUT_GAIN / math.sqrt(shared)
        specs.append((f"{scope}.shared_expert.down_proj.weight", (hidden, shared), down_std))
        specs.append((f"{scope}.shared_expert_gate.weight", (1, hidden), std))
    return specs


def tensor_specs(config: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor of the checkpoint in file order: (name, shape, init std)."""
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    # NOTE: with the final RMSNorm the hidden state has rms ~1, so a row std of
    # LOGIT_STD / sqrt(hidden) gives logits of std ~LOGIT_STD (tied or not).
    head_std = LOGIT_STD / math.sqrt(hidden)
    specs: list[TensorSpec] = [("model.embed_tokens.weight", (vocab, hidden), head_std)]
    for i in range(config["num_hidden_layers"]):
        specs.extend(_layer_specs(config, i))
    specs.append(("model.norm.weight", (hidden,), 0.0))
    if not config["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (vocab, hidden), head_std))
    return specs


def _make_tensor(
    rng: np.random.Generator,
    name: str,
    shape: tuple[int, ...],
    std: float,
    num_used: int,
    norm_center: float = 1.0,
) -> np.ndarray:
    """norm_center: a norm weight's value where it scales by 1 (0 for Gemma's 1 + w)."""
    if std == 0.0:
        value = norm_center if name.endswith("norm.weight") else 1.0
        return np.full(shape, value, dtype=np.float32)
    tensor = rng.standard_normal(shape, dtype=np.float32)
    tensor *= np.float32(std)
    if name.endswith("norm.weight"):
        tensor += np.float32(norm_center)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        # Padding rows past the tokenizer: logit 0, far below the top tokens, never sampled
        # in practice, like the padded vocab of real checkpoints.
        tensor[num_used:] = 0.0
    return tensor


def _plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors in order; a tensor larger than `shard_bytes` gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = 4 * math.prod(spec[1])
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _shard_tensors(
    shards: list[list[TensorSpec]], seed: int, num_used: int, norm_center: float = 1.0
) -> Iterator[dict[str, np.ndarray]]:
    """Tensors one shard at a time, so that at most one shard is in memory."""
    rng = np.random.default_rng(seed)
    for shard in shards:
        yield {
            name: _make_tensor(rng, name, shape, std, num_used, norm_center)
            for name, shape, std in shard
        }


def write_weights(
    out_dir: Path,
    config: dict[str, Any],
    seed: int,
    num_used_tokens: int,
    shard_bytes: int = SHARD_BYTES,
) -> list[Path]:
    """Write model.safetensors, or shards plus model.safetensors.index.json; return the files."""
    specs = tensor_specs(config)
    shards = _plan_shards(specs, shard_bytes)
    center = 0.0 if config["model_type"].startswith("gemma") else 1.0
    metadata = {"format": "pt"}
    if len(shards) == 1:
        tensors = next(_shard_tensors(shards, seed, num_used_tokens, center))
        save_file(tensors, str(out_dir / "model.safetensors"), metadata=metadata)
        return [out_dir / "model.safetensors"]
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, tensors in enumerate(_shard_tensors(shards, seed, num_used_tokens, center)):
        path = out_dir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path), metadata=metadata)
        weight_map.update(dict.fromkeys(tensors, path.name))
        files.append(path)
        del tensors
    total = sum(4 * math.prod(shape) for _, shape, _ in specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files
