"""Prompts for `tokenmill bench` (client process): random, shared-prefix or a JSONL file.

For /v1/completions random prompts are lists of token ids drawn from the server's own
vocabulary, so the input length is exact. Chat needs text: there a prompt is made of random
words from a small list, one word being about one token (the length is approximate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# NOTE: tokenmill's demo tokenizers keep their special tokens at ids 0-4; starting at 10
# stays clear of them and of the first byte tokens on most real tokenizers too.
FIRST_ORDINARY_ID = 10

# Short, common English words: most tokenizers encode each, with its leading space, as one
# token, so a chat prompt of L words is about L tokens.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his it an were are which this "
    "be or has had one first their its new after who they have her she two been other when "
    "there all also into more time only some many most over made year part such city up can "
    "school out world may well state used three would between each both through under then "
    "name high four where life known while same since house early later team west film game"
)
WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: the prompt and how many tokens to ask for."""

    prompt: str | list[int]
    """Text (chat, or a JSONL prompt) or token ids (completions)."""
    prompt_len: int
    """Prompt tokens as far as the client knows (exact for token ids; the server's
    usage, when it reports one, replaces it in the results)."""
    output_len: int
    """max_tokens to ask for."""


def random_ids(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    """`length` token ids drawn uniformly from [FIRST_ORDINARY_ID, vocab_size)."""
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError(f"--vocab-size {vocab_size}: must be > {FIRST_ORDINARY_ID}")
    return rng.integers(FIRST_ORDINARY_ID, vocab_size, size=length).tolist()


def random_text(rng: np.random.Generator, length: int) -> str:
    """About `length` tokens of text: `length` random common words."""
    picks = rng.integers(0, len(WORDS), size=length)
    return " ".join(WORDS[i] for i in picks)


def _prompt(rng: np.random.Generator, length: int, as_text: bool, vocab_size: int):
    return random_text(rng, length) if as_text else random_ids(rng, length, vocab_size)


def random_requests(
    num_prompts: int, input_len: int, output_len: int, *, as_text: bool, vocab_size: int, seed: int
) -> list[BenchRequest]:
    """`num_prompts` independent random prompts of `input_len` tokens each."""
    rng = np.random.default_rng(seed)
    return [
        BenchRequest(_prompt(rng, input_len, as_text, vocab_size), input_len, output_len)
        for _ in range(num_prompts)
    ]


def shared_prefix_requests(
    num_prompts: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    *,
    as_text: bool,
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """Prompts of one shared `prefix_len`-token prefix plus `input_len` unique tokens each:
    the workload a prefix cache is for."""
    rng = np.random.default_rng(seed)
    prefix = _prompt(rng, prefix_len, as_text, vocab_size)
    requests: list[BenchRequest] = []
    for _ in range(num_prompts):
        suffix = _prompt(rng, input_len, as_text, vocab_size)
        prompt = f"{prefix} {suffix}" if as_text else prefix + suffix
        requests.append(BenchRequest(prompt, prefix_len + input_len, output_len))
    return requests


def jsonl_requests(path: Path, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """The first `num_prompts` lines of `path`, each {"prompt": str or [ids], "output_len"?}.

    A text prompt's length is counted in words until the server's usage says better.
    """
    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if len(requests) == num_prompts:
                break
            try:
                item = json.loads(line)
                prompt = item["prompt"]
                out = int(item.get("output_len", output_len))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: expected {{'prompt': ...}}: {e}") from e
            length = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            requests.append(BenchRequest(prompt, length, out))
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests


def load_dataset(
    dataset: str,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    prefix_len: int = 0,
    as_text: bool = False,
    vocab_size: int = 1000,
    seed: int = 0,
) -> list[BenchRequest]:
    """The requests of `dataset`: "random", "shared-prefix" or a path ending in .jsonl."""
    if dataset == "random":
        return random_requests(
            num_prompts, input_len, output_len, as_text=as_text, vocab_size=vocab_size, seed=seed
        )
    if dataset == "shared-prefix":
        return shared_prefix_requests(
            num_prompts,
            prefix_len,
            input_len,
            output_len,
            as_text=as_text,
            vocab_size=vocab_size,
            seed=seed,
        )
    if dataset.endswith(".jsonl"):
        return jsonl_requests(Path(dataset), num_prompts, output_len)
    raise ValueError(f"--dataset {dataset!r}: use random, shared-prefix or a PATH.jsonl")
