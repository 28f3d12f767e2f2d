"""A GGUF file as a Hugging Face checkpoint directory (a subprocess of `tokenmill serve`, once
per file: gguf_checkpoint.py caches what it writes, keyed by the file's content).

Weights: the `gguf` package reads the file memory-mapped and dequantizes one tensor at a time
(F16 and BF16 tensors are kept as they are, every other type becomes the float32 values
llama.cpp's own dequantization gives); llama.cpp's row order of q and k (each head's rotary
halves interleaved) is undone; the names become Hugging Face's; safetensors shards of up to
2 GiB are written as they fill (a shard's tensors are in memory until it is written). The
worker then loads them into the serving dtype like any checkpoint.
The config and the tokenizer (chat template included) are what transformers builds from the
file's metadata, so ids and shapes are transformers' own, as for every checkpoint.

    python -m tokenmill.cli.gguf_convert FILE.gguf OUT_DIR

Exit status 2, with one line on stderr, for a file tokenmill cannot serve.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

# NOTE: the file's `general.architecture`: llama.cpp writes Mistral checkpoints as llama
# (transformers' config tells them apart by `general.name`), Qwen2 as qwen2.
ARCHITECTURES = ("llama", "qwen2")
MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# NOTE: llama.cpp permutes q and k rows for its llama architecture only (its rotary takes
# adjacent pairs; Hugging Face's takes halves), as transformers' GGUF loader undoes them.
PERMUTED = ("llama",)
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
}
# NOTE: llama.cpp writes a scaled RoPE as `rope_freqs.weight` (Llama 3.1 / 3.2's per-frequency
# factors) or `<arch>.rope.scaling.*` metadata; transformers' GGUF config reads neither, so the
# checkpoint it builds would rotate with plain RoPE: refused rather than served wrong.
_ROPE_FACTORS = "rope_freqs.weight"
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class Unservable(ValueError):
    """A file tokenmill cannot serve; the message names what and why."""


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _LAYER.fullmatch(name)
    if match is None or match[2] not in _LAYER_PARTS:
        raise Unservable(f"tensor {name!r} is not part of a Llama / Qwen2 / Mistral decoder")
    return f"model.layers.{match[1]}.{_LAYER_PARTS[match[2]]}.{match[3]}"


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


def check_rope(reader, architecture: str) -> None:
    """A scaled RoPE (see _ROPE_FACTORS) is refused, naming what the file holds."""
    scaling = reader.fields.get(f"{architecture}.rope.scaling.type")
    kind = str(scaling.contents()) if scaling is not None else "none"
    if kind != "none":
        raise Unservable(
            f"the file scales RoPE ({architecture}.rope.scaling.type = {kind!r}), which "
            "transformers' GGUF loader ignores; serve the Hugging Face checkpoint instead"
        )
    if any(t.name == _ROPE_FACTORS for t in reader.tensors):
        raise Unservable(
            f"the file scales RoPE by per-frequency factors ({_ROPE_FACTORS}: Llama 3.1 / 3.2), "
            "which transformers' GGUF loader ignores; serve the Hugging Face checkpoint instead"
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


def hf_tensors(
    reader, architecture: str, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for each tensor of the file, one at a time."""
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        values = dequantized(tensor)
        if architecture in PERMUTED and ".self_attn.q_proj." in name:
            values = unpermute(values, num_heads)
        elif architecture in PERMUTED and ".self_attn.k_proj." in name:
            values = unpermute(values, num_kv_heads)
        yield name, values.contiguous()


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


def write_config_and_tokenizer(path: Path, out: Path) -> dict:
    """transformers' config and tokenizer for the file, saved as a checkpoint's files."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if config.model_type not in MODEL_CLASSES:
        raise Unservable(f"model type {config.model_type!r} is not one tokenmill serves")
    config.architectures = [MODEL_CLASSES[config.model_type]]
    config.save_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(out)
    return config.to_dict()


def convert(path: Path, out: Path) -> None:
    from gguf import GGUFReader

    started = time.monotonic()
    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError) as e:
        raise Unservable(f"not a GGUF file the gguf package can read ({e})") from None
    architecture = str(reader.fields["general.architecture"].contents())
    check_architecture(architecture)
    check_rope(reader, architecture)
    types = check_tensor_types(reader)
    config = write_config_and_tokenizer(path, out)
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    total = write_shards(hf_tensors(reader, architecture, num_heads, num_kv_heads), out)
    source = {"file": str(path), "architecture": architecture, "tensor_types": types}
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
