"""Token id -> exact UTF-8 bytes and display string, built once from `tokenizer.json`.

Run by the detokenizer process at start. Incremental decoding and every logprob entry
look tokens up here in O(1): bytes come from the vocabulary itself (byte-level BPE
alphabet mapped back to bytes), never from re-encoding a decoded string, so a token that
holds part of a character keeps its exact bytes.
"""

from __future__ import annotations

import json
import logging
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

# sentencepiece-style byte-fallback pieces, e.g. "<0x0A>"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SP_SPACE = "\u2581"  # "▁"


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table, inverted: the printable stand-in char -> its byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {char: b for b, char in chars.items()}


def byte_level_piece_bytes(piece: str) -> bytes:
    """Bytes of a byte-level BPE piece (chars outside the alphabet pass through as UTF-8)."""
    alphabet = byte_level_alphabet()
    out = bytearray()
    for char in piece:
        byte = alphabet.get(char)
        if byte is None:
            out += char.encode()
        else:
            out.append(byte)
    return bytes(out)


def sentencepiece_piece_bytes(piece: str) -> bytes:
    """Bytes of a sentencepiece-style piece: "<0xNN>" is that byte, "▁" is a space."""
    match = _BYTE_PIECE.fullmatch(piece)
    if match is not None:
        return bytes([int(match.group(1), 16)])
    return piece.replace(_SP_SPACE, " ").encode()


def display_string(data: bytes) -> str:
    """The UTF-8 text of `data`, or "bytes:\\xNN..." when it is not valid UTF-8 by itself."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _has_type(node: Any, name: str) -> bool:
    """Whether a tokenizer.json component (possibly a Sequence) contains `type == name`."""
    if isinstance(node, dict):
        return node.get("type") == name or any(_has_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, name) for v in node)
    return False


def _strips_first_space(decoder: Any) -> bool:
    """Whether decoding drops the space a "▁" dummy prefix put before the first word: Llama
    2's Strip(" ", 1, 0) step, or a Metaspace decoder that prepends."""
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "Sequence":
        return any(_strips_first_space(d) for d in decoder.get("decoders", []))
    if decoder.get("type") == "Strip":
        return decoder.get("content") == " " and int(decoder.get("start", 0)) > 0
    if decoder.get("type") == "Metaspace":
        return decoder.get("prepend_scheme", "always") != "never" and decoder.get(
            "add_prefix_space", True
        )
    return False


def _tokenizer_file(path: str | Path) -> Path:
    path = Path(path)
    return path / "tokenizer.json" if path.is_dir() else path


class TokenTable:
    """Per token id: its exact bytes (None for special tokens), display string, special flag.

    Ids outside the vocabulary (embedding rows past the tokenizer, padding ids) look up as
    bytes None, string "" and not special, so a stray id never raises.
    """

    def __init__(
        self,
        piece_bytes: list[bytes | None],
        strings: list[str],
        special: list[bool],
        strips_first_space: bool = False,
    ) -> None:
        self._bytes = piece_bytes
        self._strings = strings
        self._special = special
        self._blanks: list[str] | None = None  # lookup_lists without text, made once
        # SentencePiece-style: the first word's "▁" is a dummy prefix the decoder drops
        self.strips_first_space = strips_first_space

    @classmethod
    def from_file(cls, path: str | Path) -> TokenTable:
        """Build from a checkpoint dir (its tokenizer.json) or a tokenizer.json path."""
        tokenizer = Tokenizer.from_file(str(_tokenizer_file(path)))
        return cls.from_tokenizer(tokenizer)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> TokenTable:
        spec = json.loads(tokenizer.to_str())
        byte_level = _has_type(spec.get("decoder"), "ByteLevel") or _has_type(
            spec.get("pre_tokenizer"), "ByteLevel"
        )
        to_bytes = byte_level_piece_bytes if byte_level else sentencepiece_piece_bytes
        vocab = tokenizer.get_vocab(with_added_tokens=False)
        added = tokenizer.get_added_tokens_decoder()
        size = max([*vocab.values(), *added.keys(), -1]) + 1
        piece_bytes: list[bytes | None] = [None] * size
        strings = [""] * size
        special = [False] * size
        for piece, token_id in vocab.items():
            data = to_bytes(piece)
            piece_bytes[token_id] = data
            strings[token_id] = display_string(data)
        for token_id, token in added.items():
            # NOTE: special tokens have no byte form; their string is their content.
            special[token_id] = token.special
            piece_bytes[token_id] = None if token.special else token.content.encode()
            strings[token_id] = token.content
        strips = not byte_level and _strips_first_space(spec.get("decoder"))
        logger.info("token table: %s ids, byte-level=%s, dummy prefix=%s", size, byte_level, strips)
        return cls(piece_bytes, strings, special, strips)

    def __len__(self) -> int:
        return len(self._bytes)

    def lookup_lists(self, with_text: bool = True) -> tuple[list[str], list[bytes | None]]:
        """The display strings (all "" without text) and bytes by id, the table's own lists
        (not to be changed): for loops over many ids, where a call per lookup costs more than
        the lookup."""
        if with_text:
            return self._strings, self._bytes
        if self._blanks is None:
            self._blanks = [""] * len(self._strings)
        return self._blanks, self._bytes

    def token_bytes(self, token_id: int) -> bytes | None:
        """Exact bytes of the token's piece; None for special tokens and unknown ids."""
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else None

    def token_string(self, token_id: int) -> str:
        """UTF-8 text of the piece, "bytes:\\xNN..." if not valid alone, content if special."""
        return self._strings[token_id] if 0 <= token_id < len(self._strings) else ""

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < len(self._special) and self._special[token_id]

    def text_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes:
        """What the token adds to the output text, as bytes (special: content, or nothing)."""
        data = self.token_bytes(token_id)
        if data is not None:
            return data
        if skip_special_tokens or not self.is_special(token_id):
            return b""
        return self._strings[token_id].encode()
