"""Loads Hugging Face safetensors (one file or sharded) into this rank's CausalLM shard.

Each tensor is read once, sliced to this rank's rows or columns, and copied into the fused
parameter it belongs to; a checkpoint missing a tensor fails loudly with its name.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tokenmill.tp_worker.cpu.quantized import LAYOUTS, QuantRows
from tokenmill.tp_worker.model import mxfp4
from tokenmill.tp_worker.model.config import ModelConfig
from tokenmill.tp_worker.model.decoder import CausalLM, DecoderLayer, local_kv_heads
from tokenmill.tp_worker.model.moe import SparseMoe

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# NOTE: a layer's norms by where they sit (families.py's Family.norms): the checkpoint's name
# -> DecoderLayer's module. OLMo 2's and Gemma's post_attention_layernorm norms the
# attention's output, where Llama's (the same name) norms the MLP's input.
NORM_NAMES = {
    "pre": {
        "input_layernorm.weight": "input_layernorm",
        "post_attention_layernorm.weight": "post_attention_layernorm",
    },
    "post": {
        "post_attention_layernorm.weight": "attn_out_norm",
        "post_feedforward_layernorm.weight": "mlp_out_norm",
    },
    "both": {
        "input_layernorm.weight": "input_layernorm",
        "post_attention_layernorm.weight": "attn_out_norm",
        "pre_feedforward_layernorm.weight": "post_attention_layernorm",
        "post_feedforward_layernorm.weight": "mlp_out_norm",
    },
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def load_weights(model: CausalLM, model_dir: Path) -> None:
    # NOTE: imported here: model/blocks.py builds on this module's loading
    from tokenmill.tp_worker.model.blocks import load_blocks

    files = checkpoint_files(model_dir)
    expected = _expected_names(model)
    gguf_blocks = gguf_block_types(model_dir)
    started = time.monotonic()
    for number, path in enumerate(files, 1):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if _NOT_TEXT.fullmatch(name) or name.endswith(_SCALES):
                    continue  # NOTE: not read (a vision tower's hundreds of MB), or read below
                if name in gguf_blocks:
                    loaded = load_blocks(model, name, _quant_rows(f, name, gguf_blocks[name]))
                elif name.endswith(_BLOCKS):
                    loaded = load_tensor(model, *_dequantized(files, f, name))
                    name = name.removesuffix(_BLOCKS)
                else:
                    loaded = load_tensor(model, name, f.get_tensor(name))
                if loaded:
                    expected.discard(text_model_name(name))
        if len(files) > 1:
            logger.info(
                "loaded weights %d/%d (%s) in %.1fs",
                number,
                len(files),
                path.name,
                time.monotonic() - started,
            )
    if expected:
        raise ValueError(
            f"checkpoint {model_dir} lacks {len(expected)} tensors, e.g. {sorted(expected)[:3]}"
        )


def gguf_block_types(model_dir: Path) -> dict[str, int]:
    """The tensors a converted GGUF checkpoint holds as their blocks, with their ggml types
    (cli/gguf_convert.py's gguf_source.json); {} for any other checkpoint."""
    source = model_dir / "gguf_source.json"
    if not source.is_file():
        return {}
    return {str(k): int(v) for k, v in json.loads(source.read_text()).get("blocks", {}).items()}


def _quant_rows(f: Any, name: str, qtype: int) -> QuantRows:
    blocks = f.get_tensor(name)
    layout = LAYOUTS.get(qtype)
    if layout is None or blocks.dtype != torch.uint8 or blocks.shape[1] % layout.file_bytes:
        raise ValueError(f"{name}: blocks of ggml type {qtype} that tokenmill does not read")
    return QuantRows.of(qtype, blocks)


# NOTE: an MXFP4 tensor's two parts (gpt-oss's experts: model/mxfp4.py)
_BLOCKS, _SCALES = "_blocks", "_scales"


def _dequantized(files: list[Path], f: Any, name: str) -> tuple[str, torch.Tensor]:
    """An MXFP4 tensor's blocks (in the open file f) and its scales (in any of the files) ->
    its name and weights as transformers lays them out ([E, in, out]), in float32."""
    base = name.removesuffix(_BLOCKS)
    scales_name = base + _SCALES
    if scales_name in f.keys():  # noqa: SIM118
        scales = f.get_tensor(scales_name)
    else:
        holder = next((p for p in files if scales_name in _names_in(p)), None)
        if holder is None:
            raise ValueError(f"checkpoint has {name} but not {scales_name}")
        with safe_open(str(holder), framework="pt") as g:
            scales = g.get_tensor(scales_name)
    return base, mxfp4.dequantize(f.get_tensor(name), scales).transpose(-1, -2)


def _names_in(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """`--load-format dummy`: random weights from config.json alone (no checkpoint read), to
    benchmark a model's shape. Norms are 1; every matrix is uniform in +-1/sqrt(fan-in), so
    activations stay in range through the layers; drawn on the parameter's own device."""
    started = time.monotonic()
    for number, (_, param) in enumerate(sorted(model.named_parameters())):
        if param.dim() == 1:
            param.data.fill_(1.0)
            continue
        generator = torch.Generator(device=param.device).manual_seed(seed * 100_003 + number)
        bound = param.shape[-1] ** -0.5
        values = torch.rand(param.shape, generator=generator, device=param.device)
        param.data.copy_(values.mul_(2 * bound).sub_(bound))
    logger.info("dummy weights in %.1fs", time.monotonic() - started)


def _expected_names(model: CausalLM) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not model.config.tie_word_embeddings:
        names.add("lm_head.weight")
    per_layer = [
        *NORM_NAMES[model.config.norms],
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "self_attn.o_proj.weight",
    ]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkv"]
    if model.config.fused_checkpoint:
        per_layer = [p for p in per_layer if not re.search(r"\.(q|k|v|gate|up)_proj\.", p)]
        per_layer += ["self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"]
    if model.config.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if model.config.o_bias:
        per_layer.append("self_attn.o_proj.bias")
    if model.config.attention_sinks:
        per_layer.append("self_attn.sinks")
    if model.config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    config = model.config
    dense = [p for p in per_layer if not p.startswith("mlp.")]
    experts = [
        name for e in range(config.num_experts) for name in _expert_names(config.moe, e).values()
    ]
    if config.moe_stacked:
        experts = [f"mlp.experts.{n}" for n in STACKED] + ["mlp.router.bias"]
    shared = [f"mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")]
    shared += ["mlp.shared_expert_gate.weight"] if config.shared_expert_size else []
    router = "mlp.router.weight" if config.moe_stacked else f"{config.moe}.gate.weight"
    moe = [*dense, *experts, router] if config.moe else []
    moe += shared if config.shared_expert_size else []
    for i in range(config.num_layers):
        names.update(
            f"model.layers.{i}.{p}" for p in (moe if i in config.moe_layers else per_layer)
        )
    return names


def _expert_names(scope: str, expert: int) -> dict[str, str]:
    """An expert's tensors: gate, up, down -> their names in the checkpoint."""
    prefix = f"{scope}.experts.{expert}"
    if scope == "block_sparse_moe":  # NOTE: Mixtral's w1 (gate), w3 (up), w2 (down)
        return {
            k: f"{prefix}.{w}.weight" for k, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))
        }
    return {k: f"{prefix}.{k}_proj.weight" for k in ("gate", "up", "down")}


_EXPERT = re.compile(r"(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
# NOTE: gpt-oss's stacked experts' tensors (mlp.experts.*), transformers' layout: gate_up
# [E, hidden, 2 inter] with gate and up interleaved (columns 2i, 2i + 1), down [E, inter,
# hidden], x times them (not their transposes)
STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _load_stacked(model: CausalLM, moe: SparseMoe, part: str, tensor: torch.Tensor) -> bool:
    """gpt-oss's router and stacked experts into this rank's share: gate and up apart
    (gate rows, then up rows, as SparseMoe holds them), every expert's intermediate dimension
    sharded; the biases beside them (moe.biases: router, gate_up, down)."""
    if part == "mlp.router.weight":
        return _copy(moe.router, tensor)
    if part == "mlp.router.bias":
        return _copy(moe.biases[0], tensor)
    name = part.removeprefix("mlp.experts.")
    if name not in STACKED:
        return False
    if name.startswith("down_proj"):
        if name == "down_proj_bias":
            return _copy(moe.biases[2], tensor)
        start, end = model.group.shard(tensor.shape[1], "intermediate_size")
        return _copy(moe.down, _residual_scaled(model.config, tensor[:, start:end].transpose(1, 2)))
    rows = tensor if name == "gate_up_proj_bias" else tensor.transpose(1, 2)  # [E, 2 inter, ...]
    start, end = model.group.shard(rows.shape[1] // 2, "intermediate_size")
    target = moe.biases[1] if name == "gate_up_proj_bias" else moe.gate_up
    width = end - start
    return _copy(target[:, :width], rows[:, 0::2][:, start:end]) and _copy(
        target[:, width:], rows[:, 1::2][:, start:end]
    )


def _load_shared(
    model: CausalLM, shared: torch.nn.ParameterList, part: str, tensor: torch.Tensor
) -> bool:
    """Qwen2-MoE's shared expert (gate_up, down, sharded as a dense MLP) and its gate (every
    rank's)."""
    if part == "mlp.shared_expert_gate.weight":
        return _copy(shared[2], tensor)
    kind = part.removeprefix("mlp.shared_expert.").removesuffix("_proj.weight")
    if kind not in ("gate", "up", "down"):
        return False
    return _copy_mlp_part(
        model, kind, shared[0], shared[1], tensor, "shared_expert_intermediate_size"
    )


def _load_expert(model: CausalLM, layer: DecoderLayer, part: str, tensor: torch.Tensor) -> bool:
    """A mixture of experts' router or one of an expert's three tensors into this rank's
    share (every expert's intermediate dimension sharded)."""
    moe, config = layer.moe, model.config
    assert moe is not None
    if config.moe_stacked:
        return _load_stacked(model, moe, part, tensor)
    if part == f"{config.moe}.gate.weight":
        return _copy(moe.router, tensor)
    if moe.shared is not None and part.startswith("mlp.shared_expert"):
        return _load_shared(model, moe.shared, part, tensor)
    match = _EXPERT.fullmatch(part)
    if match is None or match[1] != config.moe:
        return False
    expert = int(match[2])
    kind = {v: k for k, v in _expert_names(config.moe, expert).items()}.get(part)
    if kind is None:
        return False
    return _copy_mlp_part(
        model, kind, moe.gate_up[expert], moe.down[expert], tensor, "moe_intermediate_size"
    )


def _copy_mlp_part(
    model: CausalLM,
    kind: str,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    tensor: torch.Tensor,
    width: str,
) -> bool:
    """An MLP's gate, up or down tensor into this rank's share of its fused gate_up (gate
    rows, then up rows) or its down (`width`: the intermediate size's name, for errors)."""
    if kind == "down":
        start, end = model.group.shard(tensor.shape[1], width)
        return _copy(down, _residual_scaled(model.config, tensor[:, start:end]))
    start, end = model.group.shard(tensor.shape[0], width)
    offset = 0 if kind == "gate" else end - start
    return _copy(gate_up[offset : offset + end - start], tensor[start:end])


# NOTE: an image and text checkpoint's text model (Gemma 3 4B-27B: cli/text_checkpoint.py):
# its tensors under the Hub's names (language_model.model.*) or transformers' own
# (model.language_model.*); the vision tower's and the projector's have no place here
_TEXT_MODEL = re.compile(r"(?:language_model\.model|model\.language_model)\.(.+)")
_NOT_TEXT = re.compile(r"(?:model\.)?(?:vision_tower|multi_modal_projector)\..+")


def text_model_name(name: str) -> str:
    """A tensor's name as a text-only checkpoint names it."""
    match = _TEXT_MODEL.fullmatch(name)
    if match is not None:
        return f"model.{match[1]}"
    return "lm_head.weight" if name == "language_model.lm_head.weight" else name


def load_tensor(model: CausalLM, name: str, tensor: torch.Tensor) -> bool:
    """One Hugging Face tensor into this rank's share of the parameter it belongs to; False
    for a tensor the model has no place for."""
    name = text_model_name(name)
    if name == "model.embed_tokens.weight":
        return _copy_vocab_rows(model.embed_tokens.weight, model.embed_tokens.vocab_start, tensor)
    if name == "lm_head.weight":
        if model.config.tie_word_embeddings:
            return False
        return _copy_vocab_rows(model.lm_head.weight, model.lm_head.vocab_start, tensor)
    if name == "model.norm.weight":
        return _copy(model.norm.weight, _norm_weight(model.config, tensor))
    match = _LAYER.fullmatch(name)
    if match is None:
        return False
    return _load_layer(model, model.layers[int(match[1])], match[2], tensor)


def _load_layer(model: CausalLM, layer: DecoderLayer, part: str, tensor: torch.Tensor) -> bool:
    group, config = model.group, model.config
    if layer.moe is not None and part.startswith(f"{config.moe}."):
        return _load_expert(model, layer, part, tensor)
    if part in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):
        return _load_fused(model, layer, part, tensor)
    norms = NORM_NAMES[config.norms]
    if part in norms:
        norm = getattr(layer, norms[part])
        return norm is not None and _copy(norm.weight, _norm_weight(config, tensor))
    if part in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        which = "q" if part.startswith("self_attn.q") else "k"
        norm = layer.q_norm if which == "q" else layer.k_norm
        if config.qk_norm == "projection":  # NOTE: OLMo 2's: this rank's heads' share
            heads = config.num_heads if which == "q" else config.num_kv_heads
            tensor = tensor[head_rows(heads, config.head_dim, which, model)]
        # NOTE: per head (Qwen3, Gemma 3): every rank's
        return norm is not None and _copy(norm.weight, _norm_weight(config, tensor))
    if part == "self_attn.o_proj.bias" and layer.o_proj.bias is not None:
        return _copy(layer.o_proj.bias, _residual_scaled(config, tensor))
    if part == "self_attn.sinks" and layer.sinks is not None:
        start, end = group.shard(tensor.shape[0], "num_attention_heads")
        return _copy(layer.sinks, tensor[start:end])
    if part == "self_attn.o_proj.weight":
        start, end = group.shard(tensor.shape[1], "num_attention_heads * head_dim")
        return _copy(layer.o_proj.weight, _residual_scaled(config, tensor[:, start:end]))
    dense = re.fullmatch(r"mlp\.(gate|up|down)_proj\.weight", part)
    if dense is not None and layer.gate_up_proj is not None and layer.down_proj is not None:
        gate_up, down = layer.gate_up_proj.weight, layer.down_proj.weight
        return _copy_mlp_part(model, dense[1], gate_up, down, tensor, "intermediate_size")
    proj = re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", part)
    if proj is None:
        return False
    rows = qkv_rows(model, proj[1])
    shard = tensor[
        head_rows(
            config.num_heads if proj[1] == "q" else config.num_kv_heads,
            config.head_dim,
            proj[1],
            model,
        )
    ]
    return _copy(getattr(layer.qkv_proj, proj[2])[rows], shard)


def _load_fused(model: CausalLM, layer: DecoderLayer, part: str, tensor: torch.Tensor) -> bool:
    """Phi-3's one q/k/v tensor (q rows, k rows, v rows) and one gate/up tensor (gate rows,
    then up rows), loaded as the separate tensors they hold."""
    config = model.config
    if part.startswith("mlp."):
        pieces = dict(zip(("gate", "up"), tensor.chunk(2), strict=True))
        names = {n: f"mlp.{n}_proj.weight" for n in pieces}
    else:
        q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        pieces = dict(zip("qkv", tensor.split([q_rows, kv_rows, kv_rows]), strict=True))
        names = {n: f"self_attn.{n}_proj.weight" for n in pieces}
    return all(_load_layer(model, layer, names[n], t) for n, t in pieces.items())


def _norm_weight(config: ModelConfig, tensor: torch.Tensor) -> torch.Tensor:
    """A norm's weight as the (float32) parameter holds it: Gemma's offset + w, the float32
    sum transformers computes each call, folded once."""
    if config.norm_offset == 0.0:
        return tensor
    return tensor.float() + config.norm_offset


def _residual_scaled(config: ModelConfig, tensor: torch.Tensor) -> torch.Tensor:
    """The products added to the residual stream times Granite's residual_multiplier, folded
    into their weights (in float32, rounded once to the serving dtype by the copy): free at
    run time, and the same in every path that loads weights (start, RL updates). NOTE: in
    float32 it moves a product by float32 rounding only (transformers multiplies after it)."""
    if config.residual_multiplier == 1.0:
        return tensor
    return tensor.float() * config.residual_multiplier


def qkv_rows(model: CausalLM, which: str) -> slice:
    head_dim = model.config.head_dim
    q_size = model.config.num_heads // model.group.size * head_dim
    kv_size = local_kv_heads(model.config, model.group) * head_dim
    start = {"q": 0, "k": q_size, "v": q_size + kv_size}[which]
    return slice(start, start + (q_size if which == "q" else kv_size))


def head_rows(num_heads: int, head_dim: int, which: str, model: CausalLM) -> slice:
    group = model.group
    if which != "q" and num_heads < group.size:
        # NOTE: fewer KV heads than ranks: each rank keeps a copy of the head its q heads use.
        head = group.rank * num_heads // group.size
        return slice(head * head_dim, (head + 1) * head_dim)
    start, end = group.shard(
        num_heads, "num_attention_heads" if which == "q" else "num_key_value_heads"
    )
    return slice(start * head_dim, end * head_dim)


def _copy_vocab_rows(param: torch.Tensor, vocab_start: int, tensor: torch.Tensor) -> bool:
    rows = tensor[vocab_start : vocab_start + param.shape[0]]
    param[: rows.shape[0]].copy_(rows)
    return True


def _copy(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    if param.shape != tensor.shape:
        raise ValueError(f"weight shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
    param.copy_(tensor)
    return True
