"""Logprob arrays from the controller -> the entries the APIs show.

Run by the detokenizer process. Each entry carries the token id, its string, its exact
bytes and its value as a Python float; -inf and NaN become -9999.0 here, as OpenAI does,
so that no non-finite value ever reaches JSON.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from msgspec.structs import replace

from tokenmill.detokenizer.token_table import TokenTable
from tokenmill.protocol.arrays import unpack, unpack_list
from tokenmill.protocol.outputs import PositionLogprobs, PromptLogprobs, RequestOutput, TokenEntry

# OpenAI's stand-in for a logprob of -inf.
MIN_LOGPROB = -9999.0
_INF = float("inf")


def clamp(values: np.ndarray) -> list[Any]:
    """float32 values -> (nested) lists of Python floats, non-finite ones -> MIN_LOGPROB."""
    values = np.asarray(values, dtype=np.float64)
    return np.where(np.isfinite(values), values, MIN_LOGPROB).tolist()


def clamp_list(values: list[float]) -> list[float]:
    """clamp for a list of Python floats (what unpack_list reads)."""
    # NOTE: a chained comparison is False for NaN and both infinities, and costs no call
    # (isfinite does); _entries clamps each entry's value the same way.
    return [v if -_INF < v < _INF else MIN_LOGPROB for v in values]


class LogprobFormatter:
    """Builds `TokenEntry`s for one request (its num_top and text_in_logprobs)."""

    def __init__(self, table: TokenTable, num_top: int | None, text_in_logprobs: bool) -> None:
        self._table = table
        self._num_top = num_top  # None: as wide as the arrays
        # NOTE: the table's own lists, indexed in _entries' loop (a step at batch 64 with top 5
        # builds ~400 entries): one token's output with top 5 in ~6.2 us, ~7.9 with two table
        # calls and a clamp call per entry (medians, timeit, interleaved).
        self._strings, self._bytes = table.lookup_lists(text_in_logprobs)

    def entry(self, token_id: int, logprob: float) -> TokenEntry:
        return self._entries([token_id], [logprob])[0]

    def _entries(self, ids: list[int], values: list[float]) -> list[TokenEntry]:
        """One entry per id and value, the value clamped (non-finite -> MIN_LOGPROB)."""
        strings, data, size = self._strings, self._bytes, len(self._bytes)
        entries = []
        for token_id, value in zip(ids, values, strict=True):
            logprob = value if -_INF < value < _INF else MIN_LOGPROB  # as clamp_list
            if 0 <= token_id < size:
                entries.append(TokenEntry(token_id, strings[token_id], data[token_id], logprob))
            else:
                entries.append(TokenEntry(token_id, "", None, logprob))
        return entries

    def positions(
        self,
        chosen_ids: list[int],
        logprobs: np.ndarray,  # [n] float32
        top_ids: np.ndarray | None,  # [n, K] int32
        top_logprobs: np.ndarray | None,  # [n, K] float32
        token_ids_logprobs: np.ndarray | None = None,  # [n, M] float32
    ) -> list[PositionLogprobs]:
        """One PositionLogprobs per chosen id (arrays may have more rows: they are cut)."""
        n = len(chosen_ids)
        tops = None
        if top_ids is not None and top_logprobs is not None:
            tops = (top_ids[:n].tolist(), top_logprobs[:n].tolist())
        extra = clamp(token_ids_logprobs[:n]) if token_ids_logprobs is not None else None
        return self._positions(chosen_ids, logprobs[:n].tolist(), tops, extra)

    def output(self, out: RequestOutput, chosen_ids: list[int]) -> list[PositionLogprobs]:
        """Entries for the kept new tokens of one RequestOutput; [] when none were asked."""
        if out.logprobs is None:
            if out.top_ids is not None or out.token_ids_logprobs is not None:
                raise ValueError(f"{out.req_id}: top or token_ids logprobs without logprobs")
            return []
        # NOTE: a step's output is a few values per request, which plain lists read faster
        # than numpy arrays (the detokenizer's time at batch 64 with top 5: ~2.8 -> ~1.4 ms).
        n = len(chosen_ids)
        tops = None
        if out.top_ids is not None and out.top_logprobs is not None:
            tops = (unpack_list(out.top_ids)[:n], unpack_list(out.top_logprobs)[:n])
        extra = None
        if out.token_ids_logprobs is not None:
            extra = [clamp_list(row) for row in unpack_list(out.token_ids_logprobs)[:n]]
        return self._positions(chosen_ids, unpack_list(out.logprobs)[:n], tops, extra)

    def _positions(
        self,
        chosen_ids: list[int],
        values: list[float],  # [n]
        tops: tuple[list[list[int]], list[list[float]]] | None,  # [n, K] ids and values
        extra: list[list[float]] | None,  # [n, M] clamped
    ) -> list[PositionLogprobs]:
        chosen = self._entries(chosen_ids, values)
        if tops is None:
            if extra is None:
                return [PositionLogprobs(entry) for entry in chosen]
            return [PositionLogprobs(e, [], row) for e, row in zip(chosen, extra, strict=True)]
        width = self._num_top  # None: as wide as the arrays
        top_entries = [
            self._entries(ids[:width], row[:width]) for ids, row in zip(*tops, strict=True)
        ]
        return [
            PositionLogprobs(entry, top, extra[i] if extra is not None else [])
            for i, (entry, top) in enumerate(zip(chosen, top_entries, strict=True))
        ]

    def prompt(self, prompt: PromptLogprobs) -> list[PositionLogprobs]:
        """Prompt entries from `start`; position 0 has no logprob (None) and no top."""
        token_ids = unpack(prompt.token_ids).tolist()  # from start
        first = max(prompt.start, 1)
        head = []
        if prompt.start == 0 and token_ids:
            head = [PositionLogprobs(replace(self.entry(token_ids[0], 0.0), logprob=None))]
        scored = token_ids[first - prompt.start :]
        top_ids = unpack(prompt.top_ids)
        top_logprobs = unpack(prompt.top_logprobs)
        has_top = top_ids.ndim == 2 and top_ids.shape[1] > 0
        entries = self.positions(
            scored,
            unpack(prompt.logprobs),
            top_ids if has_top else None,
            top_logprobs if has_top else None,
        )
        positions = head + entries
        if prompt.start == 0 and self._table.strips_first_space:
            self._drop_dummy_prefix(positions)
        return positions

    def _drop_dummy_prefix(self, positions: list[PositionLogprobs]) -> None:
        """At the prompt's first word, "▁The" reads "The": the text (and so text_offset)
        has no space there, and the entries (the chosen one and its alternatives) say so."""
        for i, position in enumerate(positions):
            if self._table.is_special(position.chosen.token_id):
                continue
            positions[i] = replace(
                position,
                chosen=_without_leading_space(position.chosen),
                top=[_without_leading_space(e) for e in position.top],
            )
            return


def _without_leading_space(entry: TokenEntry) -> TokenEntry:
    if entry.bytes is None or not entry.bytes.startswith(b" "):
        return entry
    data = entry.bytes[1:]
    token = entry.token[1:] if entry.token.startswith(" ") else entry.token
    return replace(entry, token=token, bytes=data)
