"""The frontend's tokenization speed on 8k-token prompts, side by side in one process: its
Tokenizer (the pipeline transformers' AutoTokenizer builds, run by `tokenizers`), that
AutoTokenizer itself, and tokenizer.json read directly (what the frontend used before).

    python benchmarks/engine/tokenization.py [--preset small|medium | --model DIR] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.checkpoints import add_model_args, resolve_model  # noqa: E402
from tokenmill.frontend.tokenizer import Tokenizer  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "medium")
    p.add_argument("--tokens", type=int, default=8192, help="prompt length in tokens")
    p.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    return p.parse_args()


def prompt_of(tokenizer: Tokenizer, tokens: int) -> str:
    """Stdlib source text cut to `tokens` tokens."""
    source = (Path(sysconfig.get_paths()["stdlib"]) / "typing.py").read_text()
    text = source
    while len(tokenizer.encode(text)) < tokens:
        text += source
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:tokens])


def rate(encode: Callable[[str], list[int]], text: str, seconds: float) -> float:
    """Prompts per second."""
    encode(text)
    started, count = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        encode(text)
        count += 1
    return count / (time.perf_counter() - started)


def main() -> int:
    args = parse_args()
    model = resolve_model(args)
    frontend = Tokenizer(model)
    direct = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    text = prompt_of(frontend, args.tokens)
    n = len(frontend.encode(text))
    same = frontend.encode(text) == direct.encode(text).ids
    print(f"{model}: a {n}-token prompt; the two give the same ids: {same}")
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(model))
    for _ in range(3):  # NOTE: interleaved, so that none always runs on a colder machine
        new = rate(frontend.encode, text, args.seconds)
        hf = rate(auto.encode, text, args.seconds)
        old = rate(lambda t: direct.encode(t).ids, text, args.seconds)
        print(
            f"frontend {new:6.1f} prompts/s; AutoTokenizer {hf:6.1f}; tokenizer.json direct "
            f"{old:6.1f}; frontend / direct {new / old:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
