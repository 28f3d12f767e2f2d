"""Builds small Hugging Face checkpoints (Llama, Qwen2, Mistral, Qwen3) from nothing.

Run by the frontend for `tokenmill serve` with no model (the cached demo checkpoint) and
by tests and benchmarks. The result is a standard HF directory that `transformers` loads;
it is built in a temporary sibling directory and renamed into place, so a half-built
checkpoint is never seen under `out_dir`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.cli.make_model.tokenizer import (
    TOKENIZER_KINDS,
    special_token_ids,
    tokenizer_config,
    train_tokenizer,
)
from tokenmill.cli.make_model.weights import (
    ARCHS,
    MAX_POSITION_EMBEDDINGS,
    PRESET_SHAPES,
    PRESETS,
    SHARD_BYTES,
    make_config,
    write_weights,
)

__all__ = ["ARCHS", "PRESETS", "TOKENIZER_KINDS", "build_checkpoint"]

logger = logging.getLogger(__name__)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _build_into(
    out_dir: Path,
    arch: str,
    preset: str,
    vocab_size: int | None,
    seed: int,
    shard_bytes: int,
    kind: str,
) -> None:
    """Write every checkpoint file into the (empty, existing) `out_dir`."""
    shape = PRESET_SHAPES[preset]
    if vocab_size is not None:
        shape = dataclasses.replace(shape, vocab_size=vocab_size)
    tokenizer = train_tokenizer(shape.vocab_size, arch, kind)
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if num_tokens > shape.vocab_size:
        raise RuntimeError(f"tokenizer has {num_tokens} tokens > vocab_size {shape.vocab_size}")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(
        out_dir / "tokenizer_config.json",
        tokenizer_config(tokenizer, arch, MAX_POSITION_EMBEDDINGS, kind),
    )
    token_ids = special_token_ids(tokenizer)
    config = make_config(arch, shape, token_ids)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {**token_ids, "do_sample": False})
    write_weights(out_dir, config, seed, num_tokens, shard_bytes)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished `src` to `dst`, replacing an older `dst` if there is one."""
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        dst.rename(old / dst.name)
    src.rename(dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_checkpoint(
    out_dir: str | Path,
    arch: str,
    preset: str,
    vocab_size: int | None = None,
    seed: int = 0,
    *,
    shard_bytes: int = SHARD_BYTES,
    tokenizer: str = "auto",
) -> Path:
    """Build a random-weight `arch` checkpoint of size `preset` into `out_dir`; return it.

    `vocab_size` overrides the preset's embedding rows (e.g. 128256); the tokenizer is
    trained towards it and may stay smaller when the training text runs out. The same
    arguments on the same Python give byte-identical files.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: expected one of {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: expected one of {PRESETS}")
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer={tokenizer!r}: expected one of {TOKENIZER_KINDS}")
    if vocab_size is not None and vocab_size < 512:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 512 (bytes plus specials)")
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _build_into(tmp, arch, preset, vocab_size, seed, shard_bytes, tokenizer)
        # NOTE: mkdtemp makes the directory 0700 and safetensors writes files 0600.
        os.chmod(tmp, 0o755)
        for path in tmp.iterdir():
            os.chmod(path, 0o644)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "built %s/%s checkpoint in %s (%.1f s)", arch, preset, out_dir, time.perf_counter() - start
    )
    return out_dir
