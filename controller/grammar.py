"""Grammar constraints as the controller runs them: one llguidance matcher per constrained
request, advanced by each token the request keeps, and the next-token bitmasks of a step's
constrained rows, filled together (controller process).

llguidance (no torch, no Python dependencies) was measured against xgrammar on this
project's machines (benchmarks/grammar_engines.py at c8228a0, docs/structured-output.md).
The frontend has already validated every grammar with the same tokenizer and limits, so a
matcher that fails here is an internal error, not a bad request.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from tokenmill.protocol.requests import Constraint

logger = logging.getLogger(__name__)


COMPILED_GRAMMARS = 256  # distinct grammars kept compiled (least recently used go)


def parser_limits() -> llguidance.LLParserLimits:
    """The caps every grammar is checked against (frontend) and run under (controller).
    NOTE: llguidance's own defaults; fuel, not time, so a grammar is in or out on every
    machine alike."""
    return llguidance.LLParserLimits(verbose_errors=False)


def mask_width(tokenizer_json: str, num_logits: int) -> int:
    """Ids a mask covers: the model's logits (config.json's vocab_size), or the tokenizer's
    ids where it has more (a GGUF file's tokenizer can hold a token past the embedding
    rows). The worker reads the first num_logits; ids past its logits are never drawn."""
    import tokenizers

    count = tokenizers.Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
    return max(num_logits, count)


def words_for(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


class GrammarEngine:
    """llguidance's view of the served vocabulary and the thread pool that fills masks."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.vocab_size = mask_width(tokenizer_json, vocab_size)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=self.vocab_size, eos_token=list(eos_ids)
        )
        self.num_words = words_for(self.vocab_size)
        self.limits = parser_limits()
        self.executor = llguidance.LLExecutor()
        # NOTE: compiled matchers by grammar, copied for each request (a copy ~5 us, a
        # compile ~1-2 ms of this process's loop): evaluation runs send one schema many times.
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @staticmethod
    def for_checkpoint(model_dir: str, eos_ids: tuple[int, ...]) -> GrammarEngine:
        """From the checkpoint's tokenizer.json (the detokenizer's source of token bytes too)
        and the logit count in its config.json."""
        path = Path(model_dir)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        tokenizer_json = (path / "tokenizer.json").read_text(encoding="utf-8")
        return GrammarEngine(tokenizer_json, int(config["vocab_size"]), eos_ids)

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for the constraint; its error state (is_error) says if it broke."""
        compiled = self._compiled.get(constraint.grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(
                self.tokenizer, constraint.grammar, log_level=0, limits=self.limits
            )
            if compiled.is_error():
                return compiled
            self._compiled[constraint.grammar] = compiled
            if len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint.grammar)
        return compiled.deep_copy()

    def masks_along(
        self,
        matchers: list[llguidance.LLMatcher | None],
        drafts: list[tuple[int, ...]],
        steps: int,
    ) -> np.ndarray:
        """[N * G, W]: the masks of a step that verifies drafts in N = `steps` iterations (1
        + the most drafts of any row in it, constrained or not): iteration i's rows are each
        matcher after its row's first i drafts (fewer where it has fewer: its later samples
        are not read). The matchers end as they began. NOTE: a matcher a draft stopped allows
        every id after it (the request ends at that draft; what is sampled after it is
        dropped)."""
        masks = []
        for i in range(steps):
            live = [m if m is None or not m.is_stopped() else None for m in matchers]
            masks.append(self.masks(live))
            for matcher, tokens in zip(matchers, drafts, strict=True):
                if matcher is not None and i < len(tokens):
                    matcher.consume_token(tokens[i])
        for matcher, tokens in zip(matchers, drafts, strict=True):
            if matcher is not None and tokens:
                matcher.rollback(len(tokens))
        return np.concatenate(masks)

    def masks(self, matchers: list[llguidance.LLMatcher | None]) -> np.ndarray:
        """[G, W] int32 next-token bitmasks; None (a row whose request ended while its step
        was in flight: its sample is dropped) allows every id."""
        bitmask = np.full((len(matchers), self.num_words), -1, dtype=np.int32)
        live = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if live:
            fill_next_token_bitmask_par(self.executor, live, bitmask)
        return bitmask
