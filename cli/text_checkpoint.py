"""An image and text checkpoint served as its text model alone (main process): Gemma 3 4B-27B.

`Gemma3ForConditionalGeneration` checkpoints hold a vision tower beside a Gemma 3 text model,
whose config is a `text_config` the Hub writes sparse (Gemma 3 4B's names 6 fields; the rest
is transformers' Gemma3TextConfig's defaults). The first start writes, into
~/.cache/tokenmill/text/<key>/, the text model's config.json as transformers completes it (in
a subprocess: the frontend never imports transformers), and links every other file of the
checkpoint there: the tokenizer and the weights are the checkpoint's own, and the worker
takes the text model's tensors under their names (tp_worker/model/weights.py) and skips the
vision tower's. The key is the config's SHA-256 with the checkpoint's path and
transformers' version.

    python -m tokenmill.cli.text_checkpoint CHECKPOINT_DIR OUT_DIR
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tokenmill.frontend.cache import cache_dir

# NOTE: the architecture -> (the text model's, its transformers config class)
TEXT_MODELS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "Gemma3TextConfig")}
# NOTE: bumped whenever this writes something else for the same checkpoint
VERSION = 1


def text_model(path: Path) -> tuple[str, str] | None:
    """(text architecture, config class) where `path` is an image and text checkpoint whose
    text model tokenmill serves, else None."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = [TEXT_MODELS[a] for a in raw.get("architectures") or [] if a in TEXT_MODELS]
    return found[0] if found else None


def text_checkpoint(path: Path) -> Path:
    """The text model's directory for the image and text checkpoint `path` (written on first
    use). Raises ValueError saying why it cannot be written."""
    path = path.resolve()
    config = (path / "config.json").read_bytes()
    digest = hashlib.sha256(config)
    digest.update(f"{path}|transformers={importlib.metadata.version('transformers')}".encode())
    out = cache_dir() / "text" / f"{digest.hexdigest()[:32]}-v{VERSION}"
    if (out / "config.json").is_file():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise ValueError(str(e)) from None
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tokenmill.cli.text_checkpoint", str(path), str(partial)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["no output"]
            raise ValueError(f"its text model's config could not be written: {lines[-1]}")
        try:
            partial.rename(out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def text_config(raw: dict[str, Any], architecture: str, config_class: str) -> dict[str, Any]:
    """The checkpoint's config.json as its text model's: `text_config` completed by
    transformers' class, the ids that end generation from the top level where it has them."""
    import transformers

    text = getattr(transformers, config_class)(**raw.get("text_config", {})).to_dict()
    ends = {k: raw[k] for k in ("eos_token_id", "bos_token_id") if raw.get(k) is not None}
    return {**text, **ends, "architectures": [architecture]}


def write(path: Path, out: Path) -> None:
    """config.json for the text model into `out`; every other file of `path` linked."""
    found = text_model(path)
    if found is None:
        raise ValueError(f"{path} is not an image and text checkpoint tokenmill serves")
    raw = json.loads((path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(text_config(raw, *found), indent=2) + "\n")
    for source in path.iterdir():
        if source.name != "config.json":
            (out / source.name).symlink_to(source.resolve())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: python -m tokenmill.cli.text_checkpoint CHECKPOINT_DIR OUT_DIR", file=sys.stderr
        )
        return 2
    write(Path(argv[0]), Path(argv[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
