"""The checkpoint's tokenizer as the frontend (main process) uses it.

Text becomes ids exactly as `transformers.AutoTokenizer.from_pretrained(dir)` makes them:
the source of truth is transformers, not tokenizer.json, because transformers' tokenizer
class for a model type may rebuild the pipeline its own way (Qwen2Tokenizer splits with
Qwen2's regex whatever tokenizer.json says; LlamaTokenizer sets up SentencePiece-style
prefixing), and users compare ids against transformers. The pipeline transformers builds
(its Rust backend, serialized) is made once per checkpoint and transformers version in a
subprocess and cached: importing transformers pulls in torch (2-3 s, ~250 MB) that the
frontend otherwise never needs; the frontend then runs that pipeline with `tokenizers`, the
same code transformers calls. Around it: bos/eos tokens and the chat template
(`tokenizer_config.json`), the eos ids that end generation (`generation_config.json`), the
model's vocab and context size (`config.json`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tokenizers

from tokenmill.frontend.cache import cache_dir

logger = logging.getLogger(__name__)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` (newer checkpoints), else tokenizer_config's `chat_template`
    (a string, or a list of named templates of which we take "default")."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# NOTE: run as `python -c` so that only that process imports transformers (and torch).
_BUILD = (
    "import sys; from transformers import AutoTokenizer; "
    "sys.stdout.write(AutoTokenizer.from_pretrained(sys.argv[1]).backend_tokenizer.to_str())"
)
_INPUTS = ("tokenizer.json", "tokenizer_config.json", "config.json", "special_tokens_map.json")


def transformers_pipeline(model_dir: Path) -> str:
    """The tokenizer.json transformers' tokenizer class for this checkpoint would run, cached
    under ~/.cache/tokenmill/tokenizers by the checkpoint's tokenizer files and the version
    of transformers; built once in a subprocess."""
    digest = hashlib.sha256(importlib.metadata.version("transformers").encode())
    for name in _INPUTS:
        path = model_dir / name
        digest.update(name.encode() + (path.read_bytes() if path.is_file() else b"-"))
    cached = cache_dir() / "tokenizers" / f"{digest.hexdigest()[:32]}.json"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    started = time.monotonic()
    built = subprocess.run(
        [sys.executable, "-c", _BUILD, str(model_dir)], capture_output=True, text=True
    )
    if built.returncode != 0:
        tail = built.stderr.strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"{model_dir}: transformers cannot load its tokenizer: {tail[0]}")
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(built.stdout, encoding="utf-8")
    partial.replace(cached)  # NOTE: atomic: a concurrent start reads a whole file or none
    logger.info("tokenizer pipeline from transformers in %.1fs", time.monotonic() - started)
    return built.stdout


class Tokenizer:
    """Encode/decode plus the checkpoint facts the API validates against."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tok = tokenizers.Tokenizer.from_str(transformers_pipeline(model_dir))
        config = _read_json(model_dir / "tokenizer_config.json")
        generation = _read_json(model_dir / "generation_config.json")
        model = _read_json(model_dir / "config.json")
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.chat_template: str | None = _chat_template(model_dir, config)
        eos_ids = _ids(generation.get("eos_token_id")) or _ids(model.get("eos_token_id"))
        if not eos_ids and self.eos_token is not None:
            eos_ids = _ids(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids: tuple[int, ...] = eos_ids
        self.generation_config: dict[str, Any] = generation  # sampling defaults (temperature...)
        num_tokens = self._tok.get_vocab_size(with_added_tokens=True)
        model_vocab = model.get("vocab_size")
        # NOTE: ids past the embedding rows would crash the engine, ids past the tokenizer's
        # vocab cannot be shown as text; a valid input id must be below both.
        self.vocab_size: int = min(num_tokens, model_vocab) if model_vocab else num_tokens
        self.max_position_embeddings: int | None = model.get("max_position_embeddings")
        self.model_dir = model_dir
        # NOTE: the logits' count (config.json), which grammar masks cover
        self.num_logits: int = model_vocab or num_tokens
        self.special_tokens: dict[str, int] = {
            t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }

    def vocab(self) -> dict[str, int]:
        """Every token's text and id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_piece(self, token_id: int) -> str:
        """A token as the vocabulary spells it ("Ġthe"; transformers'
        convert_ids_to_tokens)."""
        return self._tok.id_to_token(token_id) or ""

    def token_text(self, token_id: int) -> str:
        """One token shown as text (special tokens included), for logprob entries the engine
        does not format (the first prompt token, `token_ids_logprob` ids)."""
        return self._tok.decode([token_id], skip_special_tokens=False)


# The name the brief used for the same thing.
TokenizerInfo = Tokenizer
