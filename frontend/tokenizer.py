"""The checkpoint's tokenizer as the frontend (main process) uses it.

Text becomes ids exactly as `transformers.AutoTokenizer.from_pretrained(dir)` makes them:
the source of truth is transformers, not tokenizer.json, because transformers' tokenizer
class for a model type may rebuild the pipeline its own way (Qwen2Tokenizer splits with
Qwen2's regex whatever tokenizer.json says; LlamaTokenizer sets up SentencePiece-style
prefixing), and users compare ids against transformers. It runs on the same Rust backend,
so it costs no speed. Around it: bos/eos tokens and the chat template
(`tokenizer_config.json`), the eos ids that end generation (`generation_config.json`), the
model's vocab and context size (`config.json`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

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


class Tokenizer:
    """Encode/decode plus the checkpoint facts the API validates against."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        # NOTE: our own limits refuse over-long prompts; transformers need not warn of them.
        self._hf.model_max_length = 1 << 62
        self._tok: tokenizers.Tokenizer = self._hf.backend_tokenizer
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token shown as text (special tokens included), for logprob entries the engine
        does not format (the first prompt token, `token_ids_logprob` ids)."""
        return self._tok.decode([token_id], skip_special_tokens=False)


# The name the brief used for the same thing.
TokenizerInfo = Tokenizer
