"""The prompt /v1/rerank scores, and its two answer tokens (main process).

A generative model becomes a reranker by reading the next-token distribution after a question
about each (query, document) pair: relevance = P(yes) / (P(yes) + P(no)). The template and the
answers are flags (`--rerank-template`, `--rerank-labels`), checked against the tokenizer when
the server starts, so that a template a model was not trained on fails there, not per request.

The prompt's ids are the template's text before {document} (with the query in it, and the
tokenizer's special tokens), then the document, then the rest of the template: tokenized
piece by piece, so that every document of one request shares the first piece token for token
and the prefix cache computes it once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tokenmill.frontend.server_config import ScoringArgs
from tokenmill.frontend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    'Judge whether the document answers the query. Answer "yes" or "no".\n'
    "Query: {query}\n"
    "Document: {document}\n"
    "Answer:\n"
)
QUERY, DOCUMENT = "{query}", "{document}"


@dataclass(frozen=True)
class RerankPrompt:
    head: str  # the template before {document}
    tail: str  # the template after it
    label_ids: tuple[int, int]  # the token ids of (relevant, not relevant)

    @staticmethod
    def from_flags(template: str, labels: str, tokenizer: Tokenizer) -> RerankPrompt:
        """The prompt of `--rerank-template` (text, a file, or "" for the default) and
        `--rerank-labels`; a ValueError names the flag and what to fix."""
        text = _template_text(template)
        if text.count(DOCUMENT) != 1 or QUERY not in text:
            raise ValueError(
                f"--rerank-template must hold {QUERY} and exactly one {DOCUMENT}; got {text!r:.200}"
            )
        head, tail = text.split(DOCUMENT)
        return RerankPrompt(head, tail, _label_ids(labels, tokenizer))

    def prompts(
        self, query: str, documents: list[str], tokenizer: Tokenizer
    ) -> tuple[list[list[int]], int]:
        """Each document's prompt ids, and how many leading ids they all share (the head,
        tokenized once, as the tail is)."""
        head = tokenizer.encode(self.head.replace(QUERY, query))
        tail = tokenizer.encode(self.tail.replace(QUERY, query), add_special_tokens=False)
        prompts = [head + tokenizer.encode(d, add_special_tokens=False) + tail for d in documents]
        return prompts, len(head)


def rerank_prompt(args: ScoringArgs, tokenizer: Tokenizer) -> RerankPrompt | None:
    """The configured prompt. Flags given but unusable raise (the server does not start);
    the defaults unusable with this tokenizer (an answer that is not one token) switch
    /v1/rerank off with a warning instead, so that a server that never reranks still starts."""
    try:
        return RerankPrompt.from_flags(args.rerank_template, args.rerank_labels, tokenizer)
    except ValueError as e:
        defaults = ScoringArgs()
        if (args.rerank_template, args.rerank_labels) != (
            defaults.rerank_template,
            defaults.rerank_labels,
        ):
            raise
        logger.warning("/v1/rerank is off: %s", e)
        return None


def _template_text(template: str) -> str:
    if not template:
        return DEFAULT_TEMPLATE
    path = Path(template)
    if DOCUMENT not in template and path.is_file():
        return path.read_text(encoding="utf-8")
    return template


def _label_ids(labels: str, tokenizer: Tokenizer) -> tuple[int, int]:
    words = labels.split(",")
    if len(words) != 2 or not all(words) or words[0] == words[1]:
        raise ValueError(
            f"--rerank-labels={labels!r}: give two different answers, comma-separated "
            "(relevant first), e.g. yes,no"
        )
    ids = []
    for word in words:
        tokens = tokenizer.encode(word, add_special_tokens=False)
        if len(tokens) != 1:
            raise ValueError(
                f"--rerank-labels: {word!r} is {len(tokens)} tokens {tokens} for this "
                "tokenizer; each answer must be exactly one token"
            )
        ids.append(tokens[0])
    if ids[0] == ids[1]:
        raise ValueError(f"--rerank-labels={labels!r}: both answers are token {ids[0]}")
    return ids[0], ids[1]
