"""GGUF files for the tests, written with the `gguf` package as llama.cpp's converter writes
them: a Hugging Face checkpoint's weights (q and k rows permuted to llama.cpp's order for the
llama architecture) and its byte-level BPE tokenizer as `tokenizer.ggml.*` metadata, in a
chosen tensor type; or another GGUF file's metadata and weights, re-encoded.

The gguf package quantizes F16, BF16, Q8_0 and Q4_0 / Q4_1 / Q5_0 / Q5_1 from float32 but
not the K types: for those (Q4_K, Q5_K, Q6_K) the blocks are random bytes with sane scales,
so the weights are whatever they dequantize to (the loader's job is to read them as
transformers does, which the tests check bit for bit).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# (offset, count) of the float16 scales in each K block (the rest: quants and sub-scales), and
# the largest sub-scale x quant they multiply (6-bit scales of 4- / 5-bit quants; Q6_K: int8
# scales of 6-bit quants centred on 32)
_K_SCALES = {Q.Q4_K: (0, 2, 63 * 15), Q.Q5_K: (0, 2, 63 * 31), Q.Q6_K: (208, 1, 128 * 32)}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# NOTE: an expert's tensor (mlp.experts.E.gate_proj, Mixtral's block_sparse_moe.experts.E.w1)
# -> the layer's stacked one in llama.cpp's files
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight"
)
_EXPERT_KINDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_EXPERT_KINDS.update(w1="gate", w3="up", w2="down")


# NOTE: Gemma's four norms a layer, as llama.cpp names them
_GEMMA_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# NOTE: config.json's model_type -> the file's architecture (where not llama)
_ARCHITECTURES = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "granite": "granite",
    "olmo2": "olmo2",
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "olmoe": "olmoe",
    "gpt_oss": "gpt-oss",
}
# NOTE: gpt-oss's names where llama.cpp's are not Llama's
_GPT_OSS_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
}
GEMMA = ("gemma2", "gemma3")
# NOTE: the architectures whose norms go by Gemma's names (OLMo 2: its two after each sublayer)
POST_NORMS = (*GEMMA, "olmo2")
# NOTE: llama.cpp's converter permutes q and k for these (its LlamaModel and what derives
# from it: Granite's)
PERMUTED = ("llama", "granite")

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str, architecture: str = "llama") -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest == "self_attn.sinks":
        return f"blk.{layer}.attn_sinks.weight"
    module, kind = rest.rsplit(".", 1)
    names = {**_LAYER_NAMES, **_GEMMA_NAMES} if architecture in POST_NORMS else _LAYER_NAMES
    if architecture == "gpt-oss":
        names = {**_LAYER_NAMES, **_GPT_OSS_NAMES}
    return f"blk.{layer}.{names[module]}.{kind}"


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's q / k rows in llama.cpp's order (its convert_hf_to_gguf.py's permute)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def llama3_rope_freqs(config: dict[str, Any]) -> np.ndarray:
    """The per-frequency factors llama.cpp's converter writes as rope_freqs.weight for a Llama
    3.1 / 3.2 checkpoint (its LlamaModel.generate_extra_tensors, as that file computes them)."""
    scaling = config["rope_scaling"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (config["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _rope_metadata(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """A YaRN rope_scaling as llama.cpp's converter writes it for Qwen models, LongRoPE as it
    writes Phi-3's (the factor lists as tensors, the attention factor computed)."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "longrope":
        original = config["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(attn_factor)
        writer.add_rope_scaling_orig_ctx_len(original)
        for name in ("long", "short"):
            factors = np.array(scaling[f"{name}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{name}.weight", factors, raw_dtype=Q.F32)
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        for beta in ("beta_fast", "beta_slow"):  # NOTE: as llama.cpp's converter writes them
            if beta in scaling:
                getattr(writer, f"add_rope_scaling_yarn_{beta}")(float(scaling[beta]))


def gpt_oss_experts(hf_name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """One of gpt-oss's stacked expert tensors as llama.cpp's converter writes it: gate and
    up apart (de-interleaved), every weight [E, out, in], the biases [E, out]."""
    layer = hf_name.split(".")[2]
    kind = hf_name.rsplit(".", 1)[1]
    if kind == "down_proj":
        return [(f"blk.{layer}.ffn_down_exps.weight", values.transpose(0, 2, 1).copy())]
    if kind == "down_proj_bias":
        return [(f"blk.{layer}.ffn_down_exps.bias", values)]
    if kind == "gate_up_proj":
        rows = values.transpose(0, 2, 1)  # NOTE: [E, 2 inter, hidden]
        return [
            (f"blk.{layer}.ffn_{part}_exps.weight", rows[:, i::2].copy())
            for i, part in enumerate(("gate", "up"))
        ]
    assert kind == "gate_up_proj_bias", hf_name
    return [
        (f"blk.{layer}.ffn_{p}_exps.bias", values[:, i::2].copy())
        for i, p in enumerate(("gate", "up"))
    ]


def _global_rope(config: dict[str, Any]) -> dict[str, Any]:
    """The global layers' rope_parameters: Gemma 3's full_attention set, or the one set
    (gpt-oss), or {} (the older rope_theta / rope_scaling keys)."""
    params = config.get("rope_parameters") or {}
    return params if "rope_type" in params else params.get("full_attention") or {}


def _add_gpt_oss_experts(
    writer: gguf.GGUFWriter, hf_name: str, values: np.ndarray, kind: Q, rng: np.random.Generator
) -> None:
    """gpt_oss_experts' tensors into the file: weights in `kind`, biases in F32 (as llama.cpp
    keeps them)."""
    for name, part in gpt_oss_experts(hf_name, values):
        data, used = encode(part, Q.F32 if name.endswith(".bias") else kind, rng)
        writer.add_tensor(name, data, raw_dtype=used)


def _family_metadata(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any]) -> None:
    """Gemma's soft-caps, window and (Gemma 3) sliding layers, Granite's multipliers, a
    mixture of experts' counts and widths, as llama.cpp's converter writes them."""
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        width = config.get("moe_intermediate_size") or config["intermediate_size"]
        writer.add_expert_feed_forward_length(width)
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "gpt-oss":
        writer.add_sliding_window(config["sliding_window"])
    if arch in GEMMA:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key):
                getattr(writer, f"add_{key}")(float(config[key]))
        writer.add_sliding_window(config["sliding_window"])
        if arch == "gemma3":  # NOTE: llama.cpp's default is five of six layers
            writer.add_sliding_window_pattern(
                [kind == "sliding_attention" for kind in config["layer_types"]]
            )
    if arch == "granite":
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])


def encode(values: np.ndarray, kind: Q, rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    """A float32 tensor in `kind` where its rows fit whole blocks (else Q8_0, else F32, as
    llama.cpp falls back); 1-D tensors stay F32."""
    if values.ndim == 1 or kind == Q.F32:
        return values.astype(np.float32), Q.F32
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if values.shape[-1] % block:
        kind = Q.Q8_0 if values.shape[-1] % 32 == 0 else Q.F32
        return encode(values, kind, rng)
    if kind in K_TYPES:
        return k_blocks(values.shape, kind, rng, float(np.abs(values).mean())), kind
    return quantize(values.astype(np.float32), kind), kind


def k_blocks(shape: tuple[int, ...], kind: Q, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random K-quant blocks whose values are about `scale` in size."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows = int(np.prod(shape[:-1]))
    raw = rng.integers(0, 256, (rows, shape[-1] // block, size), dtype=np.uint8)
    offset, count, largest = _K_SCALES[kind]
    d = rng.uniform(0.5, 1.0, (rows, shape[-1] // block, count)) * 4 * scale / largest
    d = d.astype(np.float16)
    raw[:, :, offset : offset + 2 * count] = d.view(np.uint8)
    return raw.reshape(rows, -1)


def tokenizer_metadata(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's `gpt2` tokenizer metadata; a
    SentencePiece-style one (Gemma's) as its `llama` metadata: the pieces in id order, scored
    by it, the byte pieces and the special tokens typed, no merges (transformers rebuilds
    them from the order, as it does for Gemma's own files)."""
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = {i: t for t, i in spec["model"]["vocab"].items()}
    special = set()
    for added in spec["added_tokens"]:
        tokens[added["id"]] = added["content"]
        if added["special"]:
            special.add(added["id"])
    listed = [tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    if spec["model"].get("byte_fallback"):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(listed)
        writer.add_token_scores([-float(i) for i in range(vocab_size)])
        kinds = gguf.TokenType
        writer.add_token_types(
            [
                kinds.CONTROL
                if i in special
                else kinds.BYTE
                if listed[i].startswith("<0x")
                else kinds.NORMAL
                for i in range(vocab_size)
            ]
        )
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
    else:
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(listed)
        writer.add_token_types([3 if i in special else 1 for i in range(vocab_size)])
        writer.add_token_merges(merges)
    config = json.loads((model_dir / "config.json").read_text())
    writer.add_bos_token_id(config["bos_token_id"])
    eos = config["eos_token_id"]
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        writer.add_chat_template(template)


def hf_to_gguf(
    model_dir: Path,
    out: Path,
    kind: Q,
    architecture: str | None = None,
    name: str | None = None,
    seed: int = 0,
    norm_noise: float = 0.0,
    rope_freqs: bool = False,
    expert_kind: Q | None = None,
) -> Path:
    """A Hugging Face checkpoint (Llama / Qwen2 / Qwen3 / Mistral / Phi-3 / Gemma 2 and 3) as
    one GGUF file of `kind` (Gemma's norms as 1 + w, its soft-caps and window as metadata);
    with `norm_noise`, every norm's weight times 1 + that much noise (make-model's norms are
    all ones, so a test could not tell one norm's name from another's); with `rope_freqs`, a
    Llama 3 rope_scaling as llama.cpp writes it (which transformers' GGUF loader ignores);
    with `expert_kind`, gpt-oss's experts in that type (MXFP4, as its files hold them)."""
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    arch = architecture or _ARCHITECTURES.get(config["model_type"], "llama")
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(name or config["model_type"])
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    rope = _global_rope(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    _family_metadata(writer, arch, config)
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    writer.add_rope_dimension_count(int(head_dim * config.get("partial_rotary_factor", 1.0)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    _rope_metadata(writer, {**config, "rope_scaling": config.get("rope_scaling") or rope})
    writer.add_vocab_size(config["vocab_size"])
    tokenizer_metadata(writer, model_dir, config["vocab_size"])
    rng = np.random.default_rng(seed)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for hf_name, tensor in tensors.items():
        values = tensor.float().numpy()
        if arch == "gpt-oss" and ".mlp.experts." in hf_name:
            _add_gpt_oss_experts(writer, hf_name, values, expert_kind or kind, rng)
            continue
        expert = _EXPERT.fullmatch(hf_name)
        if expert is not None:
            key = (int(expert[1]), _EXPERT_KINDS[expert[3]])
            experts.setdefault(key, {})[int(expert[2])] = values
            continue
        if hf_name.endswith("shared_expert_gate.weight"):
            values = values.reshape(-1)  # NOTE: llama.cpp's is a vector
        if values.ndim == 1 and "norm" in hf_name and norm_noise:
            values = values * (1 + norm_noise * rng.standard_normal(values.shape)).astype(
                np.float32
            )
        if arch in PERMUTED and ".q_proj." in hf_name:
            values = permute(values, num_heads)
        elif arch in PERMUTED and ".k_proj." in hf_name:
            values = permute(values, num_kv_heads)
        elif arch in GEMMA and hf_name.endswith("norm.weight"):
            values = values + np.float32(1.0)  # NOTE: llama.cpp's converter writes 1 + w
        data, used = encode(values, kind, rng)
        writer.add_tensor(gguf_name(hf_name, arch), data, raw_dtype=used)
    for (layer, part), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        data, used = encode(stacked, kind, rng)
        writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", data, raw_dtype=used)
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config), raw_dtype=Q.F32)
    finish(writer)
    return out


def requantize(source: Path, out: Path, kind: Q) -> Path:
    """Another GGUF file's metadata and weights (dequantized, then encoded as `kind`)."""
    reader = gguf.GGUFReader(source)
    writer = _writer_like(reader, out)
    rng = np.random.default_rng(0)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        data, used = encode(values, kind, rng)
        writer.add_tensor(tensor.name, data, raw_dtype=used)
    finish(writer)
    return out


def edited(
    source: Path,
    out: Path,
    strings: dict[str, str] | None = None,
    tensors: dict[str, tuple[np.ndarray, Q]] | None = None,
) -> Path:
    """Another GGUF file with `strings` added to its metadata and `tensors` (raw data and
    type) replacing its tensors of those names or added after them."""
    reader = gguf.GGUFReader(source)
    writer = _writer_like(reader, out)
    for key, value in (strings or {}).items():
        writer.add_string(key, value)
    extra = dict(tensors or {})
    for tensor in reader.tensors:
        data, kind = extra.pop(tensor.name, (np.array(tensor.data), tensor.tensor_type))
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    for name, (data, kind) in extra.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    finish(writer)
    return out


def _writer_like(reader: gguf.GGUFReader, out: Path) -> gguf.GGUFWriter:
    """A writer for `out` holding the reader's metadata."""
    writer = gguf.GGUFWriter(out, str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    return writer


def finish(writer: gguf.GGUFWriter) -> None:
    """Header, metadata and tensors to the file; closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
