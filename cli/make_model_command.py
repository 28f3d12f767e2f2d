"""`tokenmill make-model`: write a small random-weight Hugging Face checkpoint (main process)."""

from __future__ import annotations

import argparse

from tokenmill.cli.make_model import ARCHS, PRESETS, TOKENIZER_KINDS, build_checkpoint


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-model",
        help="build a small Hugging Face checkpoint with random weights and a trained tokenizer",
        description="Writes config.json, *.safetensors, tokenizer.json, tokenizer_config.json "
        "and generation_config.json into DIR. Weights are random but give peaked next-token "
        "distributions; the tokenizer is a BPE trained on the standard library's documentation "
        "and sources.",
    )
    p.add_argument("dir", help="output directory (created; must not exist or be empty)")
    p.add_argument("--arch", choices=ARCHS, default="llama", help="model family (default llama)")
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default="tiny",
        help="size: tiny (a few MB), small (~25M params), medium (~120M params)",
    )
    p.add_argument(
        "--vocab-size", type=int, default=None, help="model vocabulary rows (default: the preset's)"
    )
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument(
        "--tokenizer",
        choices=TOKENIZER_KINDS,
        default="auto",
        help="auto: byte-level BPE (with Qwen2's own split for qwen2; for gemma2 and gemma3 "
        "Gemma's SentencePiece style: no dummy prefix, its turn markers); byte-level: plain "
        "byte-level for every arch (for qwen2, transformers' Qwen2Tokenizer then overrides "
        "it); sentencepiece: Llama 2 / Mistral v0.1 style (a '▁' dummy prefix, <0xNN> byte "
        "fallback, loaded by transformers as LlamaTokenizer)",
    )


def run(args: argparse.Namespace) -> int:
    path = build_checkpoint(
        args.dir, args.arch, args.preset, args.vocab_size, args.seed, tokenizer=args.tokenizer
    )
    print(path)
    return 0
