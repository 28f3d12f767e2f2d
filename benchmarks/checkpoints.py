"""Shared by the benchmarks of every folder: the checkpoint a benchmark runs on, --model or
the random-weight demo checkpoint of --preset.

Scripts in benchmarks/engine/ and benchmarks/serving/ put the repository's root on sys.path
and import it as benchmarks.checkpoints.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_model_args(parser: argparse.ArgumentParser, default_preset: str) -> None:
    parser.add_argument(
        "--model", type=Path, help="HF checkpoint dir or GGUF file (default: a demo one)"
    )
    parser.add_argument(
        "--preset",
        choices=("small", "medium"),
        default=default_preset,
        help=f"demo checkpoint size when no --model (default {default_preset})",
    )


def resolve_model(args: argparse.Namespace) -> Path:
    """--model (a GGUF file: the directory it converts to, as `tokenmill serve` makes it), or
    the demo checkpoint of --preset (built once into ~/.cache/tokenmill)."""
    if args.model is None:
        return demo_model(args.preset)
    if args.model.suffix == ".gguf":
        from tokenmill.cli.gguf_checkpoint import gguf_checkpoint

        return gguf_checkpoint(args.model)
    return args.model


def demo_model(preset: str) -> Path:
    """The llama demo checkpoint of `preset`, built once into ~/.cache/tokenmill."""
    from tokenmill.cli.demo_checkpoint import demo_checkpoint

    return demo_checkpoint("llama", preset)
