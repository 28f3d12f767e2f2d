"""The quantized GGUF files benchmarks/serving/quantized.py serves, made once into
~/.cache/tokenmill-peers/gguf/ (random weights; SmolLM2's tokenizer):

- llama-1b-Q4_K_M.gguf, llama-1b-Q8_0.gguf: a 1.07B Llama with Llama-3.2-1B's layer shape
  (hidden 2,048, 16 layers, 32 / 8 heads of 64, intermediate 8,192, tied embeddings),
  written by transformers, converted by llama.cpp's converter to bfloat16 and quantized by
  its own `llama-quantize` (install_llama_cpp.sh builds both);
- llama-8b-Q4_K_M.gguf: Llama-3.1-8B's shape (hidden 4,096, 32 layers, 32 / 8 heads of 128,
  intermediate 14,336, an untied output), random blocks written with the `gguf` package in
  the types llama-quantize's Q4_K_M gives each tensor (Q6_K for the output and for attn_v and
  ffn_down in its "more bits" layers, Q4_K elsewhere).

    python benchmarks/serving/quantized_files.py   (prints the files' paths)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.peers import launch  # noqa: E402
from benchmarks.peers.to_gguf import convert  # noqa: E402

FOLDER = launch.CACHE / "gguf"
QUANTIZE = launch.LLAMA_CPP / "build" / "bin" / "llama-quantize"
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
}
LLAMA_8B = {"hidden": 4096, "inter": 14336, "layers": 32, "heads": 32, "kv_heads": 8}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def smollm2_directory() -> Path:
    from tokenmill.cli.default_model import resolve_model

    return resolve_model(None).directory


def llama_1b(kind: str) -> Path:
    """The 1.07B Llama quantized by llama-quantize to `kind` (Q4_K_M, Q8_0)."""
    out = FOLDER / f"llama-1b-{kind}.gguf"
    if out.exists():
        return out
    bf16 = FOLDER / "llama-1b-bf16.gguf"
    if not bf16.exists():
        convert(_llama_1b_checkpoint(), bf16, "bf16")
    launch.require(QUANTIZE, "run benchmarks/peers/install_llama_cpp.sh")
    subprocess.run([str(QUANTIZE), str(bf16), str(out), kind], check=True, capture_output=True)
    return out


def _llama_1b_checkpoint() -> Path:
    import torch
    import transformers

    directory = FOLDER / "llama-1b-hf"
    if (directory / "config.json").exists():
        return directory
    source = smollm2_directory()
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = transformers.LlamaConfig(vocab_size=vocab, **LLAMA_1B)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    return directory


def llama_8b_q4_k_m() -> Path:
    """Llama-3.1-8B's shape in Q4_K_M's types, random blocks (usual float16 scales)."""
    import gguf

    out = FOLDER / "llama-8b-Q4_K_M.gguf"
    if out.exists():
        return out
    small = gguf.GGUFReader(llama_1b("Q4_K_M"))
    writer = gguf.GGUFWriter(str(out) + ".part", "llama")
    shape = LLAMA_8B
    head_dim = shape["hidden"] // shape["heads"]
    writer.add_block_count(shape["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["inter"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    for field in small.fields.values():
        if field.name.startswith("tokenizer."):
            _copy_field(writer, field)
    rng = np.random.default_rng(0)
    vocab = len(small.fields["tokenizer.ggml.tokens"].data)
    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    hidden, inter, kv = shape["hidden"], shape["inter"], shape["kv_heads"] * head_dim
    _tensor(writer, "token_embd.weight", (vocab, hidden), q4, rng)
    for i in range(shape["layers"]):
        more = _more_bits(i, shape["layers"])
        _norm(writer, f"blk.{i}.attn_norm.weight", hidden)
        _norm(writer, f"blk.{i}.ffn_norm.weight", hidden)
        for name, rows, cols, kind in (
            ("attn_q", hidden, hidden, q4),
            ("attn_k", kv, hidden, q4),
            ("attn_v", kv, hidden, q6 if more else q4),
            ("attn_output", hidden, hidden, q4),
            ("ffn_gate", inter, hidden, q4),
            ("ffn_up", inter, hidden, q4),
            ("ffn_down", hidden, inter, q6 if more else q4),
        ):
            _tensor(writer, f"blk.{i}.{name}.weight", (rows, cols), kind, rng)
    _norm(writer, "output_norm.weight", hidden)
    _tensor(writer, "output.weight", (vocab, hidden), q6, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(out) + ".part").rename(out)
    return out


def _more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _tensor(writer, name: str, shape: tuple[int, int], kind, rng: np.random.Generator) -> None:
    import gguf

    rows, cols = shape
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = (rng.uniform(0.5, 2.0, size=raw.shape[:2]) / (16 * cols**0.5)).astype(np.float16)
    at = size - 2 if kind == gguf.GGMLQuantizationType.Q6_K else 0  # NOTE: Q6_K's d is last
    raw[..., at : at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    if kind == gguf.GGMLQuantizationType.Q4_K:
        raw[..., 2:4] = (scale * 8).view(np.uint8).reshape(*raw.shape[:2], 2)  # NOTE: dmin
    writer.add_tensor(name, raw.reshape(rows, -1), raw_dtype=kind)


def _norm(writer, name: str, width: int) -> None:
    writer.add_tensor(name, np.ones(width, dtype=np.float32))


def _copy_field(writer, field) -> None:
    import gguf

    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        writer.add_array(field.name, field.contents())
    elif kind == gguf.GGUFValueType.STRING:
        writer.add_string(field.name, field.contents())
    else:
        writer.add_key_value(field.name, field.contents(), kind)


def main() -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    for path in (llama_1b("Q4_K_M"), llama_1b("Q8_0"), llama_8b_q4_k_m()):
        print(path, f"{path.stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
