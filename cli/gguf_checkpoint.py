"""GGUF checkpoints: the file's converted Hugging Face directory, cached (main process).

The first start from a GGUF file converts it in a subprocess (gguf_convert.py: it imports
torch, transformers and gguf, which the frontend never needs) into
~/.cache/tokenmill/gguf/<key>/, where the key is the file's SHA-256 with the versions of
the converter, transformers and gguf. Every later start finds that directory and loads it as
it loads any safetensors checkpoint (its quantized matrices as the file's blocks, which the
worker multiplies as they are). The file's digest is kept by its path, size, mtime and
inode, so a later start reads the file's metadata, not its bytes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.frontend.cache import cache_dir

logger = logging.getLogger(__name__)

# NOTE: bumped whenever gguf_convert.py writes something else for the same file.
CONVERTER_VERSION = 2
_CHUNK = 1 << 20
_STALE_S = 24 * 3600


def gguf_file(path: Path) -> Path | None:
    """The GGUF file `--model path` names: the file itself, or the only .gguf in a directory
    that holds no config.json; None where `path` is no GGUF checkpoint."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or _has_gguf_magic(path) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf")
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"the directory holds several GGUF files ({names}): name one of them")
    return found[0] if found else None


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_checkpoint(path: Path) -> Path:
    """The Hugging Face directory converted from the GGUF file `path` (converted on first
    use). Raises ValueError, saying why (the caller names the file), for a file tokenmill
    cannot serve or a cache it cannot write."""
    path = path.resolve()
    try:
        out = cache_dir() / "gguf" / _key(path)
        if (out / "config.json").is_file():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        _sweep(out.parent)
        partial = Path(tempfile.mkdtemp(prefix=f"{out.name}.", suffix=".tmp", dir=out.parent))
    except (OSError, importlib.metadata.PackageNotFoundError) as e:
        raise ValueError(str(e)) from None
    started = time.monotonic()
    logger.info("converting %s into %s (once per file)", path, out)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tokenmill.cli.gguf_convert", str(path), str(partial)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise ValueError(_failure(done))
        _publish(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    summary = (done.stderr.strip().splitlines() or ["converted"])[-1]
    logger.info("%s (%.1f s with the subprocess's start)", summary, time.monotonic() - started)
    return out


def _failure(done: subprocess.CompletedProcess) -> str:
    """Why the converter failed: its one line for a file it refuses (status 2), else the end
    of what it printed with its status (the whole of it goes to the log)."""
    lines = done.stderr.strip().splitlines() or ["no output"]
    if done.returncode == 2:
        return lines[-1]
    logger.error("the GGUF converter exited with %d:\n%s", done.returncode, done.stderr)
    return f"the converter exited with status {done.returncode}: " + " | ".join(lines[-3:])


def _sweep(root: Path) -> None:
    """Conversions a killed start left half done, a day old or more (a live one is younger)."""
    for stale in root.glob("*.tmp"):
        if time.time() - stale.stat().st_mtime > _STALE_S:
            shutil.rmtree(stale, ignore_errors=True)


def _publish(partial: Path, out: Path) -> None:
    """partial becomes out, atomically; a concurrent start may have published its own."""
    try:
        partial.rename(out)
    except OSError as e:
        if not (out / "config.json").is_file():
            raise ValueError(f"cannot move the converted checkpoint into {out}: {e}") from None


def _key(path: Path) -> str:
    digest = hashlib.sha256(content_digest(path).encode())
    for package in ("transformers", "gguf"):
        digest.update(f"{package}={importlib.metadata.version(package)}".encode())
    digest.update(f"converter={CONVERTER_VERSION}".encode())
    return digest.hexdigest()[:32]


def content_digest(path: Path) -> str:
    """The SHA-256 of the file's bytes, hashed once per (path, size, mtime, inode)."""
    index_path = cache_dir() / "gguf" / "digests.json"
    stat = path.stat()
    seen = f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    index = _read_index(index_path)
    entry = index.get(str(path))
    if isinstance(entry, dict) and entry.get("stat") == seen:
        return str(entry["sha256"])
    logger.info("hashing %s (%.0f MiB; once per version of the file)", path, stat.st_size / 2**20)
    digest = file_sha256(path)
    index[str(path)] = {"stat": seen, "sha256": digest}
    index_path.parent.mkdir(parents=True, exist_ok=True)
    partial = index_path.with_name(f"digests.{os.getpid()}.json.part")
    partial.write_text(json.dumps(index, indent=1))
    partial.replace(index_path)
    return digest


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _read_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def transformers_model(model_dir: Path, dtype: Any) -> Any:
    """transformers' model of the checkpoint tokenmill serves from `model_dir` (tests'
    oracles, benchmarks' trainers): of a converted GGUF file, transformers loading the file
    itself under the converted config (the directory's quantized tensors are blocks that
    transformers does not read); else the directory's."""
    import transformers

    source = model_dir / "gguf_source.json"
    if not source.is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        return model.eval()
    file = Path(json.loads(source.read_text())["file"])
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, config=config, dtype=dtype
    )
    return model.eval()
