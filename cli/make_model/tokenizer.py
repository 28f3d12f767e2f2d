"""BPE tokenizers for the locally built demo and test checkpoints: byte-level (GPT-2 style,
as Llama 3 and Qwen2 ship) or SentencePiece-style (Llama 2, Mistral 7B v0.1: "▁" for a space,
a dummy prefix on the first word, <0x00>..<0xFF> byte-fallback pieces; Gemma's: the same
without the dummy prefix, and its turn markers).

Run by the frontend (once, when a checkpoint is built). It trains on text every Python
installation has, the stdlib's `pydoc_data.topics` and stdlib sources, so a fresh machine
with nothing downloaded gets a real tokenizer; same Python and inputs give the same file.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

UNK = "<unk>"
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# NOTE: trained first, so they take ids 0..4 whatever the vocab size.
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)
TOKENIZER_KINDS = ("auto", "byte-level", "sentencepiece")
_SP_SPACE = "\u2581"  # "▁"
_BYTE_PIECES = tuple(f"<0x{b:02X}>" for b in range(256))

# Stdlib source characters used per vocab entry asked for (beyond pydoc topics):
# enough text for the merges, capped so that medium (32768) trains in a few seconds.
_CHARS_PER_VOCAB = 300
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})

# NOTE: the families whose tokenizer is Qwen2's: no bos, its own pre-tokenizer split, a
# template that shows tools (Qwen3 ships Qwen2's tokenizer).
QWEN_ARCHS = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
# NOTE: the families whose tokenizer is Gemma's (SentencePiece-style, no dummy prefix, turns
# as <start_of_turn> / <end_of_turn>, the assistant's role named "model")
GEMMA_ARCHS = ("gemma2", "gemma3")
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
MASK = "<mask>"  # NOTE: GemmaTokenizer's mask token: in the vocab, or it adds one past it
GEMMA_SPECIALS = (START_OF_TURN, END_OF_TURN, MASK)
GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set prefix = messages[0]['content'] + '\n\n' %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set prefix = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for message in turns %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\n' + (prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)

# NOTE: one approach to bos, used by every arch that has one: the template itself emits
# {{ bos_token }}, and callers encode the rendered chat with add_special_tokens=False (as
# transformers' apply_chat_template and vLLM do), so the post-processor does not double it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# NOTE: Qwen2.5's way to show tools and calls (hermes: <tool_call> blocks, tool results as
# <tool_response> in a user turn); without tools it renders as CHAT_TEMPLATE does.
QWEN2_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set call = tool_call.function %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' '
    "+ (call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] "
    "+ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _stdlib_sources() -> Iterator[str]:
    """Stdlib .py files in sorted path order, tests and site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)
    )
    for path in paths:
        yield path.read_text(encoding="utf-8", errors="replace")


def training_texts(vocab_target: int) -> list[str]:
    """pydoc topics, then stdlib sources up to a budget that grows with the vocab target."""
    import pydoc_data.topics

    topics: dict[str, str] = pydoc_data.topics.topics
    texts = [topics[key] for key in sorted(topics)]
    budget = vocab_target * _CHARS_PER_VOCAB - sum(len(t) for t in texts)
    for source in _stdlib_sources():
        if budget <= 0:
            break
        texts.append(source)
        budget -= len(source)
    return texts


# NOTE: transformers 5 ignores tokenizer_class for qwen2 and rebuilds the pipeline as
# Qwen2Tokenizer does (NFC, this split regex, then ByteLevel without its own regex); the
# qwen2 tokenizer.json uses the same pipeline so that both ways of loading it agree.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _set_pre_tokenization(tokenizer: Tokenizer, qwen2_style: bool) -> None:
    """auto's Qwen2 pipeline, or plain byte-level (which transformers' Qwen2Tokenizer
    overrides when loading a qwen2 checkpoint: the case tokenmill must follow it in)."""
    if not qwen2_style:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        return
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _post_processor(add_bos: bool) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not add_bos:
        return byte_level
    template = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS}:1 $B:1",
        special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))],
    )
    return processors.Sequence([byte_level, template])


def train_tokenizer(vocab_target: int, arch: str, kind: str = "auto") -> Tokenizer:
    """Train a BPE of at most `vocab_target` tokens (fewer if the text runs out).

    Llama and Mistral add bos in the post-processor; Qwen2 and Qwen3 add nothing, as upstream.
    `kind`: auto (byte-level, with Qwen2's own split for qwen2), byte-level (plain, every
    arch), sentencepiece.
    """
    if kind == "sentencepiece" or (kind == "auto" and arch in GEMMA_ARCHS):
        return _train_sentencepiece_style(
            vocab_target, add_bos=arch not in QWEN_ARCHS, gemma=arch in GEMMA_ARCHS
        )
    tokenizer = Tokenizer(models.BPE())
    _set_pre_tokenization(tokenizer, qwen2_style=arch in QWEN_ARCHS and kind == "auto")
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        special_tokens=[AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_texts(vocab_target), trainer)
    tokenizer.post_processor = _post_processor(add_bos=arch not in QWEN_ARCHS)
    return tokenizer


def _train_sentencepiece_style(vocab_target: int, add_bos: bool, gemma: bool = False) -> Tokenizer:
    """Metaspace ("▁", prefix on the first word, no split), BPE with byte fallback, and
    Llama 2's decoder sequence. Trained on words, then rebuilt with the 256 byte pieces
    after the special tokens (ids 0..5, then 6..261), as SentencePiece models lay them out.
    `gemma`: no prefix on the first word (nor its strip in the decoder), and the turn markers
    after the other special tokens."""
    specials = (UNK, *SPECIAL_TOKENS, *(GEMMA_SPECIALS if gemma else ()))
    trainer_tok = Tokenizer(models.BPE(unk_token=UNK))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(_SP_SPACE, "first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target - len(_BYTE_PIECES),
        special_tokens=list(specials),
        limit_alphabet=200,  # NOTE: rarer characters go through byte fallback
        show_progress=False,
    )
    trainer_tok.train_from_iterator(training_texts(vocab_target), trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    learned = sorted(trained["vocab"].items(), key=lambda item: item[1])
    order = [*specials, *_BYTE_PIECES] + [t for t, _ in learned if t not in specials]
    vocab = {token: i for i, token in enumerate(order)}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=UNK, byte_fallback=True, fuse_unk=True)
    )
    prefix = "never" if gemma else "first"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(_SP_SPACE, prefix, split=False)
    steps = [decoders.Replace(_SP_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps if gemma else [*steps, decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A {BOS}:1 $B:1",
            special_tokens=[(BOS, vocab[BOS])],
        )
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> dict[str, Any]:
    """bos/eos/pad ids as the config files name them (eos a list where the tokenizer has
    Gemma's turns: a turn's end ends generation too, as Gemma's generation_config says)."""
    ids: dict[str, Any] = {}
    for name, token in (("bos", BOS), ("eos", EOS), ("pad", PAD)):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise RuntimeError(f"special token {token} missing from the trained vocab")
        ids[f"{name}_token_id"] = token_id
    end_of_turn = tokenizer.token_to_id(END_OF_TURN)
    if end_of_turn is not None:
        ids["eos_token_id"] = [ids["eos_token_id"], end_of_turn]
    return ids


def tokenizer_config(
    tokenizer: Tokenizer, arch: str, max_len: int, kind: str = "auto"
) -> dict[str, Any]:
    """tokenizer_config.json contents: `PreTrainedTokenizerFast` (byte-level) or
    `LlamaTokenizer` (SentencePiece-style, as Llama 2 and Mistral 7B v0.1 name it; Gemma's
    GemmaTokenizer)."""
    if kind == "sentencepiece" or (kind == "auto" and arch in GEMMA_ARCHS):
        gemma = arch in GEMMA_ARCHS
        names = (UNK, *SPECIAL_TOKENS, *(GEMMA_SPECIALS if gemma else ()))
        template = GEMMA_TEMPLATE if gemma else "{{- bos_token }}" + CHAT_TEMPLATE
        return {
            "tokenizer_class": "GemmaTokenizer" if gemma else "LlamaTokenizer",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": UNK,
            **({"mask_token": MASK} if gemma else {}),
            "add_bos_token": arch not in QWEN_ARCHS,
            "add_eos_token": False,
            "legacy": False,
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": _added_tokens(tokenizer, names),
            "chat_template": CHAT_TEMPLATE if arch in QWEN_ARCHS else template,
        }
    added = _added_tokens(tokenizer, SPECIAL_TOKENS)
    template = QWEN2_TOOLS_TEMPLATE if arch in QWEN_ARCHS else "{{- bos_token }}" + CHAT_TEMPLATE
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        # NOTE: explicit null, or transformers' Qwen2Tokenizer adds an <|endoftext|> unk.
        "unk_token": None,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": template,
    }


def _added_tokens(tokenizer: Tokenizer, names: tuple[str, ...]) -> dict[str, Any]:
    return {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in names
    }
