"""Grammar engines for structured output, side by side on this machine's CPU: llguidance and
xgrammar (if it imports). Per vocabulary: tokenizer init; per grammar (JSON schemas, a regex,
a choice, a Lark grammar, any JSON object): compile time, the first mask, then the next-token
bitmask fill and the advance per token, down a fixed valid output, at batch 1 and batch 64.

    python benchmarks/grammar_engines.py [--engines llguidance,xgrammar] [--vocabs smollm2,qwen2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "skills", "address"],
}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "unit"],
        },
    },
    "required": ["name", "arguments"],
}
LARK = r"""start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    """json_schema, regex, lark or json_object (any JSON object)."""
    source: str
    instance: str
    """A valid output that the matchers are driven down."""


CASES = (
    Case(
        "classifier",
        "json_schema",
        '{"type":"object","properties":{"label":{"enum":["pos","neg"]}},"required":["label"]}',
        '{"label":"neg"}',
    ),
    Case(
        "person",
        "json_schema",
        json.dumps(PERSON),
        '{"name":"Ada Lovelace","age":36,"email":"ada@example.com",'
        '"skills":["mathematics","poetry","engines"],"address":{"city":"London","zip":"W1"}}',
    ),
    Case(
        "tool_call",
        "json_schema",
        json.dumps(TOOL_CALL),
        '{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius","days":3}}',
    ),
    Case("regex_phone", "regex", r"\d{3}-\d{4}", "555-1234"),
    Case("choice", "regex", "pos|neg|neutral", "neutral"),
    Case("lark_arith", "lark", LARK, "(12+34)*5-6/7"),
    Case(
        "json_object",
        "json_object",
        '{"type":"object"}',
        '{"id":7,"tags":["a","b"],"ok":true,"meta":{"x":1.5,"y":null},"note":"hi there"}',
    ),
)


@dataclass(frozen=True)
class Vocab:
    name: str
    directory: Path
    vocab_size: int
    """Rows of the model's logits (config.json), which the mask must cover."""
    num_tokens: int
    """Tokens the tokenizer knows; rows past them are padding and never allowed."""
    eos_ids: list[int]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="llguidance,xgrammar", help="comma-separated")
    p.add_argument(
        "--vocabs", default="smollm2,qwen2", help="smollm2, qwen2 (151,936 rows) or HF dirs"
    )
    p.add_argument("--grammars", default=",".join(c.name for c in CASES), help="comma-separated")
    p.add_argument("--runs", type=int, default=5, help="compiles and B=1 walks per grammar")
    p.add_argument("--batch", type=int, default=64, help="matchers in the batched step")
    p.add_argument("--steps", type=int, default=64, help="batched steps timed")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads")
    return p.parse_args()


def vocab_dir(name: str) -> Path:
    """SmolLM2-135M-Instruct's checkpoint, a Qwen2-size one built once, or a directory."""
    if name == "smollm2":
        from tokenmill.cli.default_model import resolve_model

        return resolve_model(None).directory
    if name == "qwen2":
        from tokenmill.cli.make_model import build_checkpoint
        from tokenmill.frontend.cache import cache_dir

        path = cache_dir() / "bench-grammar-qwen2-tiny-151936"
        if not (path / "config.json").exists():
            build_checkpoint(path, "qwen2", "tiny", vocab_size=151936)
        return path
    return Path(name)


def load_vocab(name: str) -> Vocab:
    directory = vocab_dir(name)
    config = json.loads((directory / "config.json").read_text())
    eos: Any = config.get("eos_token_id")
    generation = directory / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id", eos)
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_ids = eos if isinstance(eos, list) else [eos]
    return Vocab(name, directory, config["vocab_size"], num_tokens, eos_ids)


class Llguidance:
    """llguidance 1.9.1: LLTokenizer from tokenizer.json's text (no transformers), one
    LLMatcher per grammar whose deep copies serve the requests, LLExecutor for batches."""

    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int) -> None:
        import llguidance
        import llguidance.numpy

        self.llg, self.lln = llguidance, llguidance.numpy
        started = time.perf_counter()
        text = (vocab.directory / "tokenizer.json").read_text()
        # NOTE: eos_token is passed: from tokenizer.json alone it guesses (SmolLM2: id 0,
        # <|endoftext|>, not the <|im_end|> the model stops on).
        self.tokenizer = llguidance.LLTokenizer(
            text, n_vocab=vocab.vocab_size, eos_token=vocab.eos_ids
        )
        self.init_s = time.perf_counter() - started
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, case: Case) -> Any:
        """A matcher at the start: building it is llguidance's compile (lexer and parser;
        token masks are computed lazily, during decoding)."""
        matcher_cls = self.llg.LLMatcher
        if case.kind == "regex":
            grammar = matcher_cls.grammar_from_regex(case.source)
        elif case.kind == "lark":
            grammar = matcher_cls.grammar_from_lark(case.source)
        else:
            grammar = matcher_cls.grammar_from_json_schema(case.source)
        matcher = matcher_cls(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{case.name}: {matcher.get_error()}")
        return matcher

    def new_matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, mask: np.ndarray, index: int) -> None:
        self.lln.fill_next_token_bitmask(matcher, mask, index)

    def fill_batch(self, matchers: list[Any], mask: np.ndarray) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.lln.fill_next_token_bitmask_par(self.executor, pairs, mask)

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def advance_batch(self, matchers: list[Any], tokens: list[int]) -> bool:
        return all(self.executor.consume_token_par(list(zip(matchers, tokens, strict=True))))

    def reset(self, matcher: Any) -> None:
        matcher.reset()


class Xgrammar:
    """xgrammar: TokenizerInfo from the transformers tokenizer, a GrammarCompiler (its cache
    off, so that every compile is a real one), GrammarMatcher, BatchGrammarMatcher."""

    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int) -> None:
        import xgrammar
        from transformers import AutoTokenizer

        self.xgr = xgrammar
        started = time.perf_counter()
        hf = AutoTokenizer.from_pretrained(str(vocab.directory))
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab.vocab_size, stop_token_ids=vocab.eos_ids
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.init_s = time.perf_counter() - started
        self.batcher = xgrammar.BatchGrammarMatcher(threads)

    def compile(self, case: Case) -> Any:
        if case.kind == "regex":
            return self.compiler.compile_regex(case.source)
        if case.kind == "lark":
            return self.compiler.compile_lark(case.source)
        if case.kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(case.source)

    def new_matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, mask: np.ndarray, index: int) -> None:
        matcher.fill_next_token_bitmask(mask, index)

    def fill_batch(self, matchers: list[Any], mask: np.ndarray) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, mask)

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def advance_batch(self, matchers: list[Any], tokens: list[int]) -> bool:
        return all(self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens))

    def reset(self, matcher: Any) -> None:
        matcher.reset()


ENGINES: dict[str, type[Llguidance] | type[Xgrammar]] = {
    "llguidance": Llguidance,
    "xgrammar": Xgrammar,
}


@dataclass
class Result:
    compile_ms: float
    first_mask_ms: float
    new_matcher_us: float
    mask_us: float
    advance_us: float
    loop_ms: float
    batch_ms: float
    advance_batch_ms: float
    end_allowed: int
    """Tokens the mask allows once the instance is consumed (1 = EOS only)."""


def new_mask(batch: int, vocab: Vocab) -> np.ndarray:
    return np.full((batch, (vocab.vocab_size + 31) // 32), -1, dtype=np.int32)  # [B, V/32]


def allowed_ids(mask: np.ndarray, vocab: Vocab) -> np.ndarray:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[: vocab.vocab_size])


def elapsed_us(fn: Callable[[], object]) -> float:
    started = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - started) / 1e3


def time_compile(engine: Any, case: Case, vocab: Vocab, runs: int) -> tuple[Any, list[float]]:
    """The last compiled grammar, and medians of compile ms, first-mask ms, new-matcher µs."""
    compiles, firsts, news = [], [], []
    mask = new_mask(1, vocab)
    compiled = None
    for _ in range(runs):
        started = time.perf_counter_ns()
        compiled = engine.compile(case)
        compiles.append((time.perf_counter_ns() - started) / 1e6)
        news.append(elapsed_us(lambda c=compiled: engine.new_matcher(c)))
        matcher = engine.new_matcher(compiled)
        firsts.append(elapsed_us(lambda m=matcher: engine.fill(m, mask, 0)) / 1e3)
    return compiled, [statistics.median(x) for x in (compiles, firsts, news)]


def walk(engine: Any, compiled: Any, ids: list[int], vocab: Vocab, runs: int) -> list[float]:
    """Batch 1 down the instance on fresh matchers: median fill µs, median advance µs, and
    how many tokens the mask allows at the end."""
    mask = new_mask(1, vocab)
    fills, advances = [], []
    for _ in range(runs):
        matcher = engine.new_matcher(compiled)
        for token in ids:
            fills.append(elapsed_us(lambda m=matcher: engine.fill(m, mask, 0)))
            started = time.perf_counter_ns()
            if not engine.advance(matcher, token):
                raise RuntimeError(f"{engine.name} refused token {token} of the instance")
            advances.append((time.perf_counter_ns() - started) / 1e3)
    engine.fill(matcher, mask, 0)
    allowed = allowed_ids(mask, vocab)
    if not set(vocab.eos_ids) & set(allowed.tolist()):
        raise RuntimeError(f"{engine.name}: EOS not allowed at the end of the instance")
    return [statistics.median(fills), statistics.median(advances), len(allowed)]


def batched(
    engine: Any, compiled: Any, ids: list[int], vocab: Vocab, batch: int, steps: int, par: bool
) -> tuple[float, float]:
    """Median ms per step to fill [batch] masks (the engine's batch filler if `par`, else a
    loop) and to advance every row; rows are staggered along the instance and restart at its
    end, so every step has rows at all depths."""
    matchers = [engine.new_matcher(compiled) for _ in range(batch)]
    positions = [i * len(ids) // batch for i in range(batch)]
    for matcher, position in zip(matchers, positions, strict=True):
        for token in ids[:position]:
            engine.advance(matcher, token)
    mask = new_mask(batch, vocab)
    fill = engine.fill_batch if par else lambda ms, m: fill_loop(engine, ms, m)
    advance = engine.advance_batch if par else lambda ms, ts: advance_loop(engine, ms, ts)
    fills, advances = [], []
    for _ in range(steps):
        fills.append(elapsed_us(lambda: fill(matchers, mask)) / 1e3)
        tokens = [ids[p] for p in positions]
        started = time.perf_counter_ns()
        if not advance(matchers, tokens):
            raise RuntimeError(f"{engine.name} refused a token in the batch")
        advances.append((time.perf_counter_ns() - started) / 1e6)
        positions = restart_finished(engine, matchers, [p + 1 for p in positions], len(ids))
    return statistics.median(fills), statistics.median(advances)


def fill_loop(engine: Any, matchers: list[Any], mask: np.ndarray) -> None:
    for i, matcher in enumerate(matchers):
        engine.fill(matcher, mask, i)


def advance_loop(engine: Any, matchers: list[Any], tokens: list[int]) -> bool:
    # NOTE: every row advances, even after one refuses (no short circuit).
    accepted = [engine.advance(m, t) for m, t in zip(matchers, tokens, strict=True)]
    return all(accepted)


def restart_finished(engine: Any, matchers: list[Any], positions: list[int], n: int) -> list[int]:
    for i, position in enumerate(positions):
        if position == n:
            engine.reset(matchers[i])
            positions[i] = 0
    return positions


def measure(
    engine: Any, case: Case, ids: list[int], vocab: Vocab, args: argparse.Namespace
) -> Result:
    compiled, (compile_ms, first_ms, new_us) = time_compile(engine, case, vocab, args.runs)
    mask_us, advance_us, end_allowed = walk(engine, compiled, ids, vocab, args.runs)
    loop_ms, _ = batched(engine, compiled, ids, vocab, args.batch, args.steps, par=False)
    batch_ms, advance_batch_ms = batched(
        engine, compiled, ids, vocab, args.batch, args.steps, par=True
    )
    return Result(
        compile_ms,
        first_ms,
        new_us,
        mask_us,
        advance_us,
        loop_ms,
        batch_ms,
        advance_batch_ms,
        int(end_allowed),
    )


HEADER = (
    f"{'engine':<10} {'vocab':>7} {'grammar':<12} {'toks':>4} {'compile':>8} {'1st mask':>8}"
    f" {'new m.':>7} {'mask B=1':>8} {'adv B=1':>7} {'B loop':>7} {'B batch':>7}"
    f" {'per row':>7} {'B adv':>6} {'end':>4}"
)
UNITS = (
    f"{'':<10} {'rows':>7} {'':<12} {'':>4} {'ms':>8} {'ms':>8} {'µs':>7} {'µs':>8} {'µs':>7}"
    f" {'ms':>7} {'ms':>7} {'µs':>7} {'ms':>6} {'toks':>4}"
)


def row(engine: str, vocab: Vocab, case: Case, n: int, r: Result, batch: int) -> str:
    per_row = r.batch_ms * 1e3 / batch
    return (
        f"{engine:<10} {vocab.vocab_size:>7} {case.name:<12} {n:>4} {r.compile_ms:>8.2f}"
        f" {r.first_mask_ms:>8.3f} {r.new_matcher_us:>7.1f} {r.mask_us:>8.1f}"
        f" {r.advance_us:>7.1f} {r.loop_ms:>7.2f} {r.batch_ms:>7.2f} {per_row:>7.1f}"
        f" {r.advance_batch_ms:>6.2f} {r.end_allowed:>4}"
    )


def warm_up(engine: Any, vocab: Vocab) -> float:
    """Ms of the first mask this engine computes for this tokenizer (one-time lazy work)."""
    matcher = engine.new_matcher(engine.compile(Case("warm-up", "regex", "[a-z]+", "x")))
    return elapsed_us(lambda: engine.fill(matcher, new_mask(1, vocab), 0)) / 1e3


def make_engines(names: list[str], vocab: Vocab, threads: int) -> list[Any]:
    engines = []
    for name in names:
        try:
            engine = ENGINES[name](vocab, threads)
        except (ImportError, OSError) as e:
            print(f"{name}: not measured, it does not import ({e})")
            continue
        print(
            f"{name:<10} vocab {vocab.name}: {vocab.vocab_size} rows, {vocab.num_tokens} tokens,"
            f" EOS {vocab.eos_ids}; tokenizer init {engine.init_s:.2f} s,"
            f" first mask ever {warm_up(engine, vocab):.2f} ms"
        )
        engines.append(engine)
    return engines


def main() -> int:
    args = parse_args()
    names = args.engines.split(",")
    cases = [c for c in CASES if c.name in args.grammars.split(",")]
    vocabs = [load_vocab(v) for v in args.vocabs.split(",")]
    print(f"threads {args.threads}, batch {args.batch}, {args.runs} runs, {args.steps} steps")
    lines = []
    for vocab in vocabs:
        tokenizer = tokenizers.Tokenizer.from_file(str(vocab.directory / "tokenizer.json"))
        for engine in make_engines(names, vocab, args.threads):
            for case in cases:
                ids = tokenizer.encode(case.instance, add_special_tokens=False).ids
                result = measure(engine, case, ids, vocab, args)
                lines.append(row(engine.name, vocab, case, len(ids), result, args.batch))
    print("\n".join([HEADER, UNITS, *lines]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
