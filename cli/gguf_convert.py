"""A GGUF file as a Hugging Face checkpoint directory (a subprocess of `tokenmill serve`, once
per file: gguf_checkpoint.py caches what it writes, keyed by the file's content).

Weights: the `gguf` package reads the file memory-mapped, one tensor at a time. The dense
layers' matrices and the embeddings in a type the worker multiplies in its blocks
(BLOCK_TYPES) are written as those blocks, a uint8 row of them per matrix row, and named in
gguf_source.json's "blocks" with their ggml type; F16 and BF16 tensors are kept as they are;
every other tensor becomes the float32 values the gguf package's dequantization gives.
llama.cpp's row order of q and k (each head's rotary halves interleaved) is undone (whole rows
of blocks move); the names become Hugging Face's; safetensors shards of up to 2 GiB are
written as they fill (a shard's tensors are in memory until it is written). The worker then
loads them like any checkpoint (model/weights.py; the blocks: model/blocks.py).
The config and the tokenizer (chat template included) are what transformers builds from the
file's metadata, so ids and shapes are transformers' own, as for every checkpoint.

    python -m tokenmill.cli.gguf_convert FILE.gguf OUT_DIR

Exit status 2, with one line on stderr, for a file tokenmill cannot serve.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

# NOTE: the file's `general.architecture`: llama.cpp writes Mistral checkpoints as llama
# (transformers' config tells them apart by `general.name`), Qwen2 as qwen2, Qwen3 as qwen3.
ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "granite", "olmo2",
    "qwen2moe", "qwen3moe", "olmoe", "gpt-oss",
)  # fmt: skip
# NOTE: the architectures transformers 5.25 builds no config for from a file: the config is
# ours, from the metadata llama.cpp writes (own_config), the tokenizer still transformers'.
# Mixtral is a llama file with experts (MIXTRAL).
OWN_CONFIGS = {
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
MIXTRAL = "MixtralForCausalLM"
# NOTE: each mixture of experts' top-k renormalisation as llama.cpp computes it (its
# build_moe_ffn's norm_w: fixed per architecture, unless `expert_weights_norm` says), and the
# scope of its tensors' Hugging Face names
_MOE_RENORMALIZE = {"qwen3moe": True, "qwen2moe": False, "olmoe": False, "llama": True}
_EXPERT_PARTS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MIXTRAL_PARTS = {"gate": "w1", "up": "w3", "down": "w2"}
_SHARED_PARTS = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
# NOTE: gpt-oss: llama.cpp's names where they are not Llama's (its pre-MLP norm, the sinks,
# the router), and its experts (with biases) back into transformers' stacked tensors, gate
# and up interleaved (GptOssExperts' layout)
GPT_OSS = "gpt-oss"
_GPT_OSS_PARTS = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
}
_GPT_OSS_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")
MODEL_CLASSES = {  # NOTE: by the model_type of the config transformers builds from the file
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# NOTE: llama.cpp's converter writes Gemma's norm weights as 1 + w (the scale they apply);
# the Hugging Face weight is w, as transformers' GGUF loader takes it back
GEMMA = ("gemma2", "gemma3")
# NOTE: Gemma's four norms a layer: llama.cpp's names where they are not Llama's
_GEMMA_PARTS = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# NOTE: the architectures with norms after attention and the MLP, under Gemma's names
POST_NORMS = (*GEMMA, "olmo2")
# NOTE: the layer counts of Gemma 2 27B and Gemma 3 27B, whose attention scale llama.cpp
# takes from hidden / heads; every other size's is its head size (query_pre_attn_scalar,
# which a GGUF file does not hold)
_GEMMA_27B_LAYERS = (46, 62)
# NOTE: llama.cpp permutes q and k rows for its llama architecture and Granite's (its
# GraniteModel is its LlamaModel's: its rotary takes adjacent pairs, Hugging Face's halves),
# as transformers' GGUF loader undoes them.
PERMUTED = ("llama", "granite")
SHARD_BYTES = 2 << 30
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
}
# NOTE: phi3 files hold gate and up as one ffn_up (Phi-3's gate_up_proj)
_FUSED_FFN_UP = ("phi3",)
# NOTE: llama.cpp writes a scaled RoPE as `rope_freqs.weight` (Llama 3.1 / 3.2's per-frequency
# factors) or `<arch>.rope.scaling.*` metadata; transformers' GGUF config reads neither, so the
# checkpoint it builds would rotate with plain RoPE: rope.py's scaling is recovered from them
# (rope_scaling), or the file is refused rather than served wrong.
_ROPE_FACTORS = "rope_freqs.weight"
# NOTE: LongRoPE's two factor lists, as llama.cpp's converter writes Phi-3's
_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")
# NOTE: the llama3 settings tried against a file's rope_freqs (Llama 3.1 / 3.2 use factor 8 or
# 32, low 1, high 4, 8,192); the factor itself is the file's largest.
_LLAMA3_GRID = [
    (low, high, old)
    for old in (8192, 4096, 2048, 16384, 32768)
    for low in (1.0, 2.0)
    for high in (4.0, 2.0, 8.0)
]
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# NOTE: the ggml types the worker multiplies in their blocks (tp_worker/cpu/quantized.py's
# LAYOUTS), and the tensors it takes that way: a dense layer's matrices and the embeddings
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_BLOCK_TENSORS = re.compile(
    r"model\.embed_tokens\.weight|lm_head\.weight|model\.layers\.\d+\."
    r"(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)\.weight"
)


class Unservable(ValueError):
    """A file tokenmill cannot serve; the message names what and why."""


def hf_name(name: str, architecture: str = "llama", scope: str = "mlp") -> str:
    """The Hugging Face name of a GGUF tensor (a mixture of experts' router and shared
    expert under `scope`: Mixtral's block_sparse_moe, the others' mlp)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _LAYER.fullmatch(name)
    if match is not None and architecture == GPT_OSS and match[2] in _GPT_OSS_PARTS:
        suffix = "" if match[2] == "attn_sinks" else f".{match[3]}"
        return f"model.layers.{match[1]}.{_GPT_OSS_PARTS[match[2]]}{suffix}"
    if match is not None and match[2] == "ffn_gate_inp":
        return f"model.layers.{match[1]}.{scope}.gate.{match[3]}"
    if match is not None and match[2] in _SHARED_PARTS:
        return f"model.layers.{match[1]}.{_SHARED_PARTS[match[2]]}.{match[3]}"
    parts = {**_LAYER_PARTS, **_GEMMA_PARTS} if architecture in POST_NORMS else _LAYER_PARTS
    if match is None or match[2] not in parts:
        raise Unservable(
            f"tensor {name!r} is not part of a decoder tokenmill serves from GGUF "
            f"({', '.join(ARCHITECTURES)})"
        )
    part = parts[match[2]]
    if match[2] == "ffn_up" and architecture in _FUSED_FFN_UP:
        part = "mlp.gate_up_proj"
    return f"model.layers.{match[1]}.{part}.{match[3]}"


def unpermute(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q or k rows [num_heads * head_dim, ...] from llama.cpp's order back to Hugging Face's:
    within each head, rows (2i, 2i + 1) go back to (i, i + head_dim / 2)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def check_architecture(architecture: str) -> None:
    if architecture not in ARCHITECTURES:
        raise Unservable(
            f"GGUF architecture {architecture!r} is not one tokenmill serves "
            f"(it serves {', '.join(ARCHITECTURES)})"
        )


def metadata(reader, architecture: str, key: str) -> Any:
    """The file's `<architecture>.<key>` value, or None."""
    found = reader.fields.get(f"{architecture}.{key}")
    return None if found is None else found.contents()


def rope_scaling(reader, architecture: str, head_dim: int, theta: float) -> dict[str, Any]:
    """The file's RoPE scaling in config.json's terms ({} for none): from rope_freqs (Llama 3),
    the LongRoPE factor tensors (Phi-3) or the rope.scaling metadata; a scaling this cannot
    name exactly is refused."""
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors
               if t.name in (_ROPE_FACTORS, *_LONGROPE)}  # fmt: skip

    def value(key: str) -> Any:
        return metadata(reader, architecture, f"rope.scaling.{key}")

    if _ROPE_FACTORS in tensors:
        return _llama3_from_factors(tensors[_ROPE_FACTORS], head_dim, theta)
    if all(name in tensors for name in _LONGROPE):
        long, short = (tensors[name].tolist() for name in _LONGROPE)
        scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
        if value("original_context_length"):
            scaling["original_max_position_embeddings"] = int(value("original_context_length"))
        if value("attn_factor"):
            scaling["attention_factor"] = float(value("attn_factor"))
        return scaling
    kind = str(value("type") or "none")
    if kind == "none":
        return {}
    if kind == "linear" and value("factor"):
        return {"rope_type": "linear", "factor": float(value("factor"))}
    if kind == "yarn" and value("factor") and value("original_context_length"):
        return _yarn(value)
    raise Unservable(
        f"the file scales RoPE ({architecture}.rope.scaling.type = {kind!r}) in a way tokenmill "
        "does not read from GGUF (linear and yarn it does); serve the Hugging Face checkpoint"
    )


def _yarn(value: Callable[[str], Any]) -> dict[str, Any]:
    """YaRN from the rope.scaling metadata `value` reads."""
    if value("attn_factor") not in (None, 1.0):
        raise Unservable(
            f"the file's YaRN attn_factor {value('attn_factor')} is not one tokenmill reads"
        )
    scaling = {
        "rope_type": "yarn",
        "factor": float(value("factor")),
        "original_max_position_embeddings": int(value("original_context_length")),
    }
    for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if value(theirs) is not None:
            scaling[ours] = float(value(theirs))
    return scaling


def _llama3_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Llama 3's rope_scaling that llama.cpp's converter turned into these per-frequency
    factors (its LlamaModel's rope_freqs), found by trying the usual settings."""
    if np.all(factors == 1.0):
        return {}
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    wavelen = (2 * math.pi / inv_freq).double().numpy()
    factor = float(factors.max())
    for low, high, old in _LLAMA3_GRID:
        smooth = (old / wavelen - low) / (high - low)
        expected = np.where(
            wavelen < old / high,
            1.0,
            np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if len(expected) == len(factors) and np.allclose(expected, factors, rtol=1e-5, atol=0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": old,
            }
    raise Unservable(
        f"the file scales RoPE by per-frequency factors ({_ROPE_FACTORS}) that no Llama 3 "
        "setting reproduces; serve the Hugging Face checkpoint instead"
    )


def check_tensor_types(reader) -> dict[str, int]:
    """Every tensor type in the file, with its count, once each is known to dequantize."""
    from gguf.quants import dequantize

    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind.name not in counts:
            try:
                dequantize(tensor.data[:1], kind)
            except NotImplementedError:
                raise Unservable(
                    f"tensor {tensor.name!r} is {kind.name}, a type the gguf package cannot "
                    "dequantize"
                ) from None
        counts[kind.name] = counts.get(kind.name, 0) + 1
    return counts


def dequantized(tensor) -> torch.Tensor:
    """One GGUF tensor in Hugging Face's shape [out, in]: F16 and BF16 as they are, every
    other type as the float32 values the gguf package's dequantization gives."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if tensor.tensor_type == GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(tensor.data, dtype=np.float16).reshape(shape))
    values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    floats = torch.from_numpy(values.reshape(shape))
    # NOTE: exact: every value is the float32 of a bfloat16.
    return floats.bfloat16() if tensor.tensor_type == GGMLQuantizationType.BF16 else floats


def kept_in_blocks(name: str, tensor, architecture: str) -> bool:
    """Whether the tensor of Hugging Face name `name` goes to the worker as its blocks."""
    return (
        tensor.tensor_type.name in BLOCK_TYPES
        and _BLOCK_TENSORS.fullmatch(name) is not None
        and architecture != "granite"  # NOTE: its residual multiplier is folded into weights
    )


def blocks_of(tensor) -> torch.Tensor:
    """A quantized tensor's blocks as [rows, bytes a row] uint8 (the file's bytes)."""
    data = np.array(tensor.data, dtype=np.uint8)
    return torch.from_numpy(data.reshape(int(tensor.shape[-1]), -1))


def hf_tensors(
    reader,
    architecture: str,
    num_heads: int,
    num_kv_heads: int,
    scope: str = "mlp",
    blocks: dict[str, int] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for each tensor of the file, one at a time (a layer's
    experts, stacked in the file, one expert's at a time); where `blocks` is given, the
    tensors kept_in_blocks as their blocks, each named in it with its ggml type."""
    stacked: dict[tuple[int, str], torch.Tensor] = {}  # NOTE: gpt-oss's, until gate meets up
    for tensor in reader.tensors:
        if tensor.name in (_ROPE_FACTORS, *_LONGROPE):
            continue  # NOTE: in config.json's rope scaling (rope_scaling)
        if architecture == GPT_OSS and _GPT_OSS_EXPERTS.fullmatch(tensor.name):
            yield from _gpt_oss_experts(tensor.name, dequantized(tensor), stacked)
            continue
        experts = _EXPERTS.fullmatch(tensor.name)
        if experts is not None:
            yield from _expert_tensors(dequantized(tensor), int(experts[1]), experts[2], scope)
            continue
        name = hf_name(tensor.name, architecture, scope)
        if blocks is not None and kept_in_blocks(name, tensor, architecture):
            blocks[name] = int(tensor.tensor_type)
            values = blocks_of(tensor)
        else:
            values = dequantized(tensor)
        if name.endswith("shared_expert_gate.weight"):
            values = values.reshape(1, -1)  # NOTE: llama.cpp's is a vector, Hugging Face's a row
        if architecture in PERMUTED and ".self_attn.q_proj." in name:
            values = unpermute(values, num_heads)
        elif architecture in PERMUTED and ".self_attn.k_proj." in name:
            values = unpermute(values, num_kv_heads)
        elif architecture in GEMMA and name.endswith("norm.weight"):
            values = values.float() - 1.0
        yield name, values.contiguous()


def _gpt_oss_experts(
    name: str, values: torch.Tensor, pending: dict[tuple[int, str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A gpt-oss file's stacked expert tensor (weights [E, out, in], biases [E, out]) as
    transformers' GptOssExperts holds them: down_proj [E, inter, hidden] and its bias; gate
    and up, once both are read, as one gate_up_proj [E, hidden, 2 inter] with gate and up
    interleaved (columns 2i and 2i + 1), and its bias likewise."""
    match = _GPT_OSS_EXPERTS.fullmatch(name)
    assert match is not None
    layer, kind, what = int(match[1]), match[2], match[3]
    prefix = f"model.layers.{layer}.mlp.experts"
    weight = what == "weight"
    if kind == "down":
        yield (
            (f"{prefix}.down_proj" if weight else f"{prefix}.down_proj_bias"),
            (values.transpose(1, 2).contiguous() if weight else values.contiguous()),
        )
        return
    pending[layer, f"{kind}.{what}"] = values
    other = pending.pop((layer, f"{'up' if kind == 'gate' else 'gate'}.{what}"), None)
    if other is None:
        return
    del pending[layer, f"{kind}.{what}"]
    gate, up = (values, other) if kind == "gate" else (other, values)
    both = torch.stack((gate, up), dim=2).flatten(1, 2)  # NOTE: [E, 2 inter, ...], interleaved
    if weight:
        yield f"{prefix}.gate_up_proj", both.transpose(1, 2).contiguous()
    else:
        yield f"{prefix}.gate_up_proj_bias", both.contiguous()


def _expert_tensors(
    stacked: torch.Tensor, layer: int, kind: str, scope: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's experts' gate, up or down weights [E, out, in] as Hugging Face's one tensor
    per expert (Mixtral's w1 / w3 / w2)."""
    part = (_MIXTRAL_PARTS if scope == "block_sparse_moe" else _EXPERT_PARTS)[kind]
    for expert, weight in enumerate(stacked):
        yield f"model.layers.{layer}.{scope}.experts.{expert}.{part}.weight", weight.clone()


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out: Path) -> int:
    """safetensors shards of at most SHARD_BYTES, named as transformers names them
    (model.safetensors, or model-0000i-of-0000n.safetensors with an index); returns bytes."""
    names: list[list[str]] = []  # each written shard's tensors
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > SHARD_BYTES:
            names.append(_save(shard, out / f"part-{len(names) + 1}.safetensors"))
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
        total += nbytes
    names.append(_save(shard, out / f"part-{len(names) + 1}.safetensors"))
    if len(names) == 1:
        (out / "part-1.safetensors").rename(out / "model.safetensors")
        return total
    weight_map = {}
    for number, shard_names in enumerate(names, 1):
        file = f"model-{number:05d}-of-{len(names):05d}.safetensors"
        (out / f"part-{number}.safetensors").rename(out / file)
        weight_map.update(dict.fromkeys(shard_names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def _save(shard: dict[str, torch.Tensor], path: Path) -> list[str]:
    from safetensors.torch import save_file

    save_file(shard, str(path), metadata={"format": "pt"})
    return list(shard)


def write_config_and_tokenizer(path: Path, out: Path, reader, architecture: str) -> dict:
    """transformers' config and tokenizer for the file (our config where transformers builds
    none: own_config), saved as a checkpoint's files, with what transformers' GGUF config
    leaves out put back (completed)."""
    import transformers

    mixtral = architecture == "llama" and _num_experts(reader, architecture) > 0
    own = OWN_CONFIGS.get(architecture) or (MIXTRAL if mixtral else "")
    if own:
        raw = own_config(reader, architecture, own)
        # NOTE: AutoTokenizer asks for the architecture's GGUF config first; the class that
        # builds any file's tokenizer does not
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
            path.parent, gguf_file=path.name
        )
    else:
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if config.model_type not in MODEL_CLASSES:
            raise Unservable(f"model type {config.model_type!r} is not one tokenmill serves")
        config.architectures = [MODEL_CLASSES[config.model_type]]
        config.save_pretrained(out)
        raw = json.loads((out / "config.json").read_text())
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    raw = completed(raw, reader, architecture)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    return raw


def _num_experts(reader, architecture: str) -> int:
    return int(metadata(reader, architecture, "expert_count") or 0)


def own_config(reader, architecture: str, class_name: str) -> dict[str, Any]:
    """config.json for a file transformers builds none for, from the metadata llama.cpp
    writes: the shape, the norms' epsilon, RoPE's base, the special ids, tied embeddings
    where the file has no `output.weight`, and Granite's four multipliers (the experts:
    completed's)."""

    def value(key: str, default: Any = None) -> Any:
        found = metadata(reader, architecture, key)
        return default if found is None else found

    heads, hidden = int(value("attention.head_count")), int(value("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    raw: dict[str, Any] = {
        "architectures": [class_name],
        "model_type": {MIXTRAL: "mixtral", "GptOssForCausalLM": "gpt_oss"}.get(
            class_name, architecture
        ),
        "hidden_size": hidden,
        "intermediate_size": int(value("feed_forward_length")),
        "num_hidden_layers": int(value("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(value("attention.head_count_kv", heads)),
        "head_dim": int(value("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(value("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(value("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(value("context_length", 4096)),
        "vocab_size": int(value("vocab_size", 0) or len(tokens.data if tokens else [])),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "hidden_act": "silu",
        "attention_bias": architecture == GPT_OSS,
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        found = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        raw[f"{name}_token_id"] = None if found is None else int(found.contents())
    if architecture == "granite":
        for ours, theirs in (
            ("embedding_multiplier", "embedding_scale"),
            ("residual_multiplier", "residual_scale"),
            ("attention_multiplier", "attention.scale"),
            ("logits_scaling", "logit_scale"),
        ):
            raw[ours] = float(value(theirs, 1.0))
    return raw


def completed(raw: dict[str, Any], reader, architecture: str) -> dict[str, Any]:
    """transformers' config.json with what its GGUF config leaves out: the head width
    (`key_length`: Qwen3's heads are wider than hidden / heads), the rotated part of each head
    (`rope.dimension_count`: Phi-4-mini rotates 3/4), the window, the RoPE scaling
    (rope_scaling), and a pad id past the vocabulary dropped (Phi3Config's default 32,000)."""
    pad = reader.fields.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        raw["pad_token_id"] = int(pad.contents())
    elif (raw.get("pad_token_id") or 0) >= raw["vocab_size"]:
        raw["pad_token_id"] = None
    window = metadata(reader, architecture, "attention.sliding_window")
    if window is not None and not raw.get("sliding_window"):
        raw["sliding_window"] = int(window)
    if metadata(reader, architecture, "attention.key_length") is not None:
        raw["head_dim"] = int(metadata(reader, architecture, "attention.key_length"))
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    params = dict(raw.get("rope_parameters") or {})
    rotated = metadata(reader, architecture, "rope.dimension_count")
    if rotated is not None and int(rotated) < head_dim:
        raw["partial_rotary_factor"] = params["partial_rotary_factor"] = int(rotated) / head_dim
        head_dim = int(rotated)  # NOTE: the frequencies are over the rotated part
    if architecture in GEMMA:
        return _gemma_completed(raw, reader, architecture, head_dim)
    if architecture == GPT_OSS:
        # NOTE: llama.cpp's gpt-oss: every other layer slides, from the first; its YaRN as
        # gpt-oss defines it (transformers' truncate: false)
        slides = [i % 2 == 0 for i in range(raw["num_hidden_layers"])]
        raw["layer_types"] = ["sliding_attention" if s else "full_attention" for s in slides]
    if _num_experts(reader, architecture):
        _experts_completed(raw, reader, architecture)
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = rope_scaling(reader, architecture, head_dim, theta)
    if architecture == GPT_OSS and scaling.get("rope_type") == "yarn":
        scaling["truncate"] = False
    if scaling or "rope_parameters" in raw:
        raw["rope_parameters"] = {**params, "rope_theta": theta, **scaling}
        raw.pop("rope_scaling", None)
    return raw


def _experts_completed(raw: dict[str, Any], reader, architecture: str) -> None:
    """A mixture of experts' fields from the file: the counts, each expert's width (and a
    shared expert's, Qwen2-MoE's) from its tensors, the layers without experts (Qwen's
    mlp_only_layers), the top-k renormalisation as llama.cpp's architecture fixes it."""
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    layers = range(raw["num_hidden_layers"])
    routed = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" in shapes]
    width = shapes[f"blk.{routed[0]}.ffn_gate_exps.weight"][1]  # NOTE: [hidden, width, E]
    raw["num_experts_per_tok"] = int(metadata(reader, architecture, "expert_used_count"))
    count = _num_experts(reader, architecture)
    if architecture == GPT_OSS:
        raw.update(num_local_experts=count, intermediate_size=width)
        return
    if raw["architectures"] == [MIXTRAL] or architecture == "olmoe":
        raw["num_local_experts" if architecture == "llama" else "num_experts"] = count
        raw["intermediate_size"] = width
    else:
        raw.update(num_experts=count, moe_intermediate_size=width, decoder_sparse_step=1)
        raw["mlp_only_layers"] = [i for i in layers if i not in routed]
        dense = [i for i in layers if f"blk.{i}.ffn_gate.weight" in shapes]
        if dense:
            raw["intermediate_size"] = shapes[f"blk.{dense[0]}.ffn_gate.weight"][1]
        shared = shapes.get(f"blk.{routed[0]}.ffn_gate_shexp.weight")
        if shared is not None:
            raw["shared_expert_intermediate_size"] = shared[1]
    if architecture != "llama":
        norm = metadata(reader, architecture, "expert_weights_norm")
        raw["norm_topk_prob"] = bool(_MOE_RENORMALIZE[architecture] if norm is None else norm)


def _gemma_completed(
    raw: dict[str, Any], reader, architecture: str, head_dim: int
) -> dict[str, Any]:
    """Gemma's config.json from what llama.cpp writes and reads: the soft-caps (Gemma 2), the
    attention scale by llama.cpp's rule (_GEMMA_27B_LAYERS), the layers' pattern and Gemma
    3's local RoPE as llama.cpp fixes them (every other layer slides; five of six, by 10,000),
    the global RoPE's scaling."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = metadata(reader, architecture, key)
        raw[key] = None if value is None else float(value)
    wide = raw["num_hidden_layers"] in _GEMMA_27B_LAYERS
    raw["query_pre_attn_scalar"] = (
        raw["hidden_size"] // raw["num_attention_heads"] if wide else head_dim
    )
    pattern = metadata(reader, architecture, "attention.sliding_window_pattern")
    layers = range(raw["num_hidden_layers"])
    if isinstance(pattern, list):  # NOTE: llama.cpp's per-layer form: true where it slides
        slides = [bool(pattern[i]) for i in layers]
    else:
        every = int(pattern) if pattern else (2 if architecture == "gemma2" else 6)
        slides = [(i + 1) % every != 0 for i in layers]
    raw["layer_types"] = ["sliding_attention" if s else "full_attention" for s in slides]
    params = dict(raw.get("rope_parameters") or {})
    if architecture == "gemma3":
        full = dict(params.get("full_attention") or {"rope_type": "default"})
        theta = float(full.get("rope_theta", metadata(reader, architecture, "rope.freq_base")))
        full = {"rope_type": "default", "rope_theta": theta}
        full.update(rope_scaling(reader, architecture, head_dim, theta))
        local = {"rope_type": "default", "rope_theta": 10000.0}
        raw["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    raw.pop("rope_scaling", None)
    return raw


def convert(path: Path, out: Path) -> None:
    from gguf import GGUFReader

    started = time.monotonic()
    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError) as e:
        raise Unservable(f"not a GGUF file the gguf package can read ({e})") from None
    architecture = str(reader.fields["general.architecture"].contents())
    check_architecture(architecture)
    types = check_tensor_types(reader)
    config = write_config_and_tokenizer(path, out, reader, architecture)
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    scope = "block_sparse_moe" if config["architectures"] == [MIXTRAL] else "mlp"
    blocks: dict[str, int] = {}
    tensors = hf_tensors(reader, architecture, num_heads, num_kv_heads, scope, blocks)
    total = write_shards(tensors, out)
    source = {
        "file": str(path),
        "architecture": architecture,
        "tensor_types": types,
        "blocks": blocks,
    }
    (out / "gguf_source.json").write_text(json.dumps(source, indent=2) + "\n")
    for file in out.iterdir():
        file.chmod(0o644)  # NOTE: safetensors writes 0600; the cache is readable like a checkpoint
    print(
        f"converted {path.name} ({architecture}, {types}) into {total / 2**20:.0f} MiB of "
        f"safetensors in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tokenmill.cli.gguf_convert FILE.gguf OUT_DIR", file=sys.stderr)
        return 2
    path, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    try:
        convert(path, out)
    except Unservable as e:
        print(str(e), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
