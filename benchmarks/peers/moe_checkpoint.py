"""The mixture of experts the MoE figures are measured on: make-model's Qwen3-MoE (random
weights, its tokenizer) at the shape issue 57 names, which fits this machine: hidden 1,024,
16 layers, 16 / 8 heads of 128 (Qwen3's), 32 experts of width 512, 4 a token (renormalized,
as Qwen3-30B-A3B), no dense layer, Qwen3's vocabulary of 151,936 tied.

    python benchmarks/peers/moe_checkpoint.py DIR [--experts 32] [--top-k 4] [--layers 16]
        [--vocab-size 151936]

A token's active weights: attention 6.3 M and 4 experts 6.3 M a layer, 201 M over 16 layers,
and the lm_head's 156 M: 0.71 GB in bfloat16, what one user's decode step must read.
`--vocab-size 1024` keeps the vocabulary to the tokenizer's own tokens: the ids a random
model samples then all stream as text, so a client that counts tokens by their text (vLLM's
bench against llama-server) counts them right.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from tokenmill.cli.make_model import build_checkpoint
from tokenmill.cli.make_model.weights import write_weights


def moe_config(base: dict, experts: int, top_k: int, layers: int, vocab: int) -> dict:
    config = dict(base)
    config.update(
        hidden_size=1024,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=layers,
        vocab_size=vocab,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=512,
        norm_topk_prob=True,
        mlp_only_layers=[],
        max_window_layers=layers,
    )
    return config


def build(
    out: Path, experts: int = 32, top_k: int = 4, layers: int = 16, vocab: int = 151936
) -> Path:
    """The checkpoint in `out` (made; it must not exist)."""
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_checkpoint(Path(tmp) / "tiny", "qwen3_moe", "tiny")
        out.mkdir(parents=True)
        for path in tiny.iterdir():
            if not path.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy(path, out / path.name)
    base = json.loads((out / "config.json").read_text())
    config = moe_config(base, experts, top_k, layers, vocab)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_weights(out, config, seed=0, num_used_tokens=config["vocab_size"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=151936)
    args = p.parse_args()
    print(build(args.dir, args.experts, args.top_k, args.layers, args.vocab_size))


if __name__ == "__main__":
    main()
