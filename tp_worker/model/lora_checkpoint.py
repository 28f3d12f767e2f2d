"""A PEFT LoRA adapter read into this rank's share of the base model's projections
(tp_worker): `adapter_config.json` and `adapter_model.safetensors`, as PEFT saves them.

Each HF module's A [r, in] and B [out, r] land where weights.py puts the module's weight:
q, k and v in the fused qkv_proj (each its segment of columns and of the rank), gate and up
in gate_up_proj, o and down sharded by their input features. The scaling (lora_alpha / r,
or / sqrt(r) with use_rslora: PEFT's definitions) is folded into B in float32, with Granite's
residual multiplier on o and down, as weights.py folds it into their weights; A and B are
then held in the model's dtype (float32 or bfloat16).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tokenmill.tp_worker.model.decoder import CausalLM, DecoderLayer
from tokenmill.tp_worker.model.lora import EmbeddingDelta, ProjectionDelta, Segment, stored
from tokenmill.tp_worker.model.weights import head_rows, qkv_rows, text_model_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_LAYER = re.compile(
    r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|qkv|gate|up|down|gate_up)_proj"
    r"\.lora_([AB])\.weight"
)
_HEAD = re.compile(r"lm_head\.lora_([AB])\.weight")
_EMBED = re.compile(r"model\.embed_tokens\.lora_embedding_([AB])")
# NOTE: PEFT saves the base's embedding and lm_head beside a LoRA on them (its
# save_embedding_layers), unchanged unless the vocabulary was resized: their shape is checked
_BASE_COPY = re.compile(r"(model\.embed_tokens|lm_head)\.base_layer\.weight")
# NOTE: adapter_config.json's settings that change what the weights mean, and are not served
_REFUSED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
    "lora_bias": "lora_bias",
    "target_parameters": "target_parameters (LoRA on expert parameters)",
    "layer_replication": "layer_replication",
}


class BadAdapter(ValueError):
    """The caller's adapter does not fit the served model (a 400 naming why)."""


@dataclass(frozen=True)
class AdapterSettings:
    alpha: float
    rslora: bool
    alpha_pattern: tuple[tuple[str, float], ...] = ()  # PEFT's per-module lora_alpha

    @staticmethod
    def read(directory: Path) -> AdapterSettings:
        path = directory / CONFIG_FILE
        if not directory.is_dir():
            raise BadAdapter(f"{directory}: no such directory")
        if not path.is_file():
            raise BadAdapter(f"{directory}: no {CONFIG_FILE} (a PEFT LoRA adapter's directory)")
        try:
            config: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise BadAdapter(f"{path}: {e}") from e
        if str(config.get("peft_type", "LORA")).upper() != "LORA":
            raise BadAdapter(f"{path}: peft_type {config.get('peft_type')!r}, not LORA")
        for key, what in _REFUSED.items():
            if config.get(key):
                raise BadAdapter(f"{path}: {what} is not supported")
        if config.get("bias", "none") != "none":
            raise BadAdapter(f"{path}: bias {config['bias']!r} is not supported (use none)")
        alphas = {"lora_alpha": config.get("lora_alpha", 8)}
        pattern = config.get("alpha_pattern") or {}
        if not isinstance(pattern, dict):
            raise BadAdapter(f"{path}: alpha_pattern {pattern!r} is not a mapping")
        alphas.update({f"alpha_pattern {k!r}": v for k, v in pattern.items()})
        for name, alpha in alphas.items():
            if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
                raise BadAdapter(f"{path}: {name} {alpha!r} is not a number")
        return AdapterSettings(
            float(alphas["lora_alpha"]),
            bool(config.get("use_rslora", False)),
            tuple((k, float(v)) for k, v in pattern.items()),
        )

    def scaling(self, module: str, rank: int) -> float:
        """PEFT's scaling of `module` (its name in the model: model.layers.0.self_attn.q_proj),
        of rank `rank` (PEFT's rank_pattern gives it the rank its weights have)."""
        alpha = next(
            (a for p, a in self.alpha_pattern if re.match(rf"(.*\.)?({p})$", module)), self.alpha
        )
        return alpha / (math.sqrt(rank) if self.rslora else rank)


@dataclass
class Adapter:
    """One adapter's deltas on this rank, by where they add."""

    rank: int = 0  # its largest module rank
    projections: dict[tuple[int, str], ProjectionDelta] = field(default_factory=dict)
    embed: EmbeddingDelta | None = None
    lm_head: ProjectionDelta | None = None


def read_adapter(
    directory: Path,
    model: CausalLM,
    max_rank: int,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Adapter:
    """The adapter at `directory` for `model` (`tensors`: its weights as a trainer sent
    them, instead of the directory's file); BadAdapter where it does not fit."""
    settings = AdapterSettings.read(directory)
    config = model.config
    source = str(directory / WEIGHTS_FILE) if tensors is None else "the trainer's tensors"
    tensors = _read_file(directory) if tensors is None else tensors
    pairs = _read_pairs(tensors, source, (config.vocab_size, config.hidden_size))
    adapter = Adapter()
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for target, (module, a, b) in pairs.items():
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise BadAdapter(f"{target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}")
        if rank > max_rank:
            raise BadAdapter(f"{target}: rank {rank} is over --max-lora-rank {max_rank}")
        adapter.rank = max(adapter.rank, rank)
        b = b.float() * settings.scaling(module, rank)
        if target == "embed_tokens":
            adapter.embed = _embedding(model, a.float(), b)
        elif target == "lm_head":
            adapter.lm_head = _lm_head(model, a.float(), b)
        else:
            number, module = target.split(".")
            layers.setdefault(int(number), {})[module] = (a.float(), b)
    for index, modules in sorted(layers.items()):
        if index >= len(model.layers):
            raise BadAdapter(f"layer {index}: the base has {len(model.layers)} layers")
        layer = model.layers[index]
        assert isinstance(layer, DecoderLayer)
        adapter.projections.update(_layer_deltas(model, layer, index, modules))
    return _in_dtype(adapter, model.dtype if model.dtype == torch.bfloat16 else torch.float32)


def _in_dtype(adapter: Adapter, dtype: torch.dtype) -> Adapter:
    """The adapter's A and B as the kernels hold them (lora.py's stored)."""

    def projection(delta: ProjectionDelta) -> ProjectionDelta:
        segments = tuple(replace(s, b=stored(s.b, dtype)) for s in delta.segments)
        return ProjectionDelta(stored(delta.a, dtype), segments)

    embed = adapter.embed
    return Adapter(
        adapter.rank,
        {key: projection(delta) for key, delta in adapter.projections.items()},
        None if embed is None else EmbeddingDelta(stored(embed.a, dtype), stored(embed.b, dtype)),
        None if adapter.lm_head is None else projection(adapter.lm_head),
    )


def _read_file(directory: Path) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors' tensors by name."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        pickled = " (adapter_model.bin is pickled: save with safe_serialization)"
        extra = pickled if (directory / "adapter_model.bin").exists() else ""
        raise BadAdapter(f"{directory}: no {WEIGHTS_FILE}{extra}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (OSError, ValueError, RuntimeError) as e:
        raise BadAdapter(f"{path}: {e}") from e


def _read_pairs(
    tensors: dict[str, torch.Tensor], source: str, expected_vocab_shape: tuple[int, int]
) -> dict[str, tuple[str, torch.Tensor, torch.Tensor]]:
    """target ("3.q", "embed_tokens", "lm_head") -> (its module's name, A, B) of `tensors`
    (PEFT's names, from `source`); copies of the base's [vocab, hidden] embedding or lm_head
    must have its shape."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    modules: dict[str, str] = {}
    base_copies: dict[str, tuple[int, ...]] = {}
    for name, tensor in tensors.items():
        if _BASE_COPY.fullmatch(text_model_name(name.removeprefix(_PREFIX))):
            base_copies[name] = tuple(tensor.shape)
            continue
        target, half = _target(name)
        halves.setdefault(target, {})[half] = tensor
        modules[target] = re.sub(r"\.lora_(embedding_)?[AB](\.weight)?$", "", name)
        modules[target] = modules[target].removeprefix(_PREFIX)
    if not halves:
        raise BadAdapter(f"{source}: no LoRA weights")
    for target, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise BadAdapter(f"{target}: lora_A or lora_B is missing")
    for name, shape in base_copies.items():
        if shape != expected_vocab_shape:
            raise BadAdapter(
                f"{name}: {list(shape)}, the base's {list(expected_vocab_shape)} (a resized "
                "vocabulary is not supported)"
            )
    return {t: (modules[t], p["A"], p["B"]) for t, p in halves.items()}


def _target(name: str) -> tuple[str, str]:
    """A PEFT tensor name -> (target, "A" or "B")."""
    bare = text_model_name(name.removeprefix(_PREFIX))
    if match := _LAYER.fullmatch(bare):
        return f"{match[1]}.{match[2]}", match[3]
    if match := _HEAD.fullmatch(bare):
        return "lm_head", match[1]
    if match := _EMBED.fullmatch(bare):
        return "embed_tokens", match[1]
    raise BadAdapter(
        f"{name}: not a LoRA weight of a module the base has (q/k/v/o_proj, gate/up/down_proj"
        " of a dense MLP, embed_tokens, lm_head)"
    )


def _layer_deltas(
    model: CausalLM,
    layer: DecoderLayer,
    index: int,
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> dict[tuple[int, str], ProjectionDelta]:
    config, group = model.config, model.group
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    mlp = {"gate", "up", "down", "gate_up"} & set(modules)
    if mlp and (layer.gate_up_proj is None or layer.down_proj is None):
        raise BadAdapter(f"layer {index}: {sorted(mlp)} target experts (not supported)")
    shapes = {
        "q": (q_out, hidden), "k": (kv_out, hidden), "v": (kv_out, hidden),
        "qkv": (q_out + 2 * kv_out, hidden), "o": (hidden, q_out),
        "gate": (inter, hidden), "up": (inter, hidden), "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }  # fmt: skip
    for module, (a, b) in modules.items():
        if (b.shape[0], a.shape[1]) != shapes[module]:
            raise BadAdapter(
                f"layer {index} {module}_proj: LoRA [out {b.shape[0]}, in {a.shape[1]}], the "
                f"base's {list(shapes[module])}"
            )
    out: dict[tuple[int, str], ProjectionDelta] = {}
    qkv = _fused(modules, "qkv", ("q", "k", "v"), (q_out, kv_out, kv_out))
    if qkv:
        out[(index, "qkv")] = _column_delta(qkv, lambda part: _qkv_shard(model, part))
    gate_up = _fused(modules, "gate_up", ("gate", "up"), (inter, inter))
    if gate_up:
        local = inter // group.size
        out[(index, "gate_up")] = _column_delta(
            gate_up,
            lambda part: (group.shard(inter, "intermediate_size"), 0 if part == "gate" else local),
        )
    for module, width in (("o", "num_attention_heads * head_dim"), ("down", "intermediate_size")):
        if module in modules:
            a, b = modules[module]
            start, end = group.shard(a.shape[1], width)
            b = b * config.residual_multiplier if config.residual_multiplier != 1.0 else b
            segment = Segment(b.t().contiguous(), 0, 0)
            out[(index, module)] = ProjectionDelta(a[:, start:end].t().contiguous(), (segment,))
    return out


def _fused(
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
    whole: str,
    parts: tuple[str, ...],
    widths: tuple[int, ...],
) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """A fused projection's LoRA as (part, first u, A, B of the part) for each part it adds
    to: the parts' own modules, or one module over them all (Phi-3's qkv_proj, gate_up_proj),
    whose B splits into the parts' rows that share one A."""
    if whole in modules:
        if set(parts) & set(modules):
            raise BadAdapter(f"{whole}_proj and its parts {list(parts)} both have LoRA weights")
        a, b = modules[whole]
        return [(p, 0, a, piece) for p, piece in zip(parts, b.split(list(widths)), strict=True)]
    found, u_start = [], 0
    for part in parts:
        if part in modules:
            a, b = modules[part]
            found.append((part, u_start, a, b))
            u_start += a.shape[0]
    return found


def _column_delta(
    found: list[tuple[str, int, torch.Tensor, torch.Tensor]],
    shard: Any,
) -> ProjectionDelta:
    """`shard(part)` -> ((first, end) rows of the part's B on this rank, first column)."""
    a_parts: dict[int, torch.Tensor] = {}
    segments = []
    for part, u_start, a, b in found:
        a_parts.setdefault(u_start, a)
        (start, end), col = shard(part)
        segments.append(Segment(b[start:end].t().contiguous(), col, u_start))
    a = torch.cat([a_parts[u] for u in sorted(a_parts)])
    return ProjectionDelta(a.t().contiguous(), tuple(segments))


def _qkv_shard(model: CausalLM, part: str) -> tuple[tuple[int, int], int]:
    config = model.config
    heads = config.num_heads if part == "q" else config.num_kv_heads
    rows = head_rows(heads, config.head_dim, part, model)
    return (rows.start, rows.stop), qkv_rows(model, part).start


def _lm_head(model: CausalLM, a: torch.Tensor, b: torch.Tensor) -> ProjectionDelta:
    config, head = model.config, model.lm_head
    if a.shape[1] != config.hidden_size or b.shape[0] != config.vocab_size:
        raise BadAdapter(
            f"lm_head: LoRA [out {b.shape[0]}, in {a.shape[1]}], the base's "
            f"[{config.vocab_size}, {config.hidden_size}]"
        )
    rows = head.vocab_end - head.vocab_start
    local = b.new_zeros(rows, b.shape[1])
    piece = b[head.vocab_start : head.vocab_end]
    local[: piece.shape[0]] = piece
    return ProjectionDelta(a.t().contiguous(), (Segment(local.t().contiguous(), 0, 0),))


def _embedding(model: CausalLM, a: torch.Tensor, b: torch.Tensor) -> EmbeddingDelta:
    config = model.config
    if a.shape[1] != config.vocab_size or b.shape[0] != config.hidden_size:
        raise BadAdapter(
            f"embed_tokens: LoRA [vocab {a.shape[1]}, hidden {b.shape[0]}], the base's "
            f"[{config.vocab_size}, {config.hidden_size}]"
        )
    if config.embedding_multiplier != 1.0:
        raise BadAdapter(
            f"embed_tokens: LoRA on the embeddings of {config.architecture}, which scales them "
            "(not supported)"
        )
    return EmbeddingDelta(a.t().contiguous(), b.t().contiguous())
