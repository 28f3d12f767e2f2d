"""Incremental detokenization of one request: new token ids in, new text out.

Run by the detokenizer process, one `IncrementalDetokenizer` per running request. Works on
token bytes from the token table (O(new tokens), no full re-decode): incomplete UTF-8 is
held until it completes, and so is any tail of the text that could start a stop string,
so a streamed delta is never cut later.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.detokenizer.token_table import TokenTable
from tokenmill.protocol.requests import DetokenizeParams


@dataclass(frozen=True, slots=True)
class Delta:
    """What one `feed` or `finish` produced."""

    text: str  # new text to show
    num_ids: int  # ids of the feed kept in the output (fewer when a stop string matched)
    stop: str | None = None  # the stop string that matched, if one did


class StopMatcher:
    """Finds stop strings across pushes; holds back a tail that could begin one."""

    def __init__(self, stops: Sequence[str], include_stop_str: bool) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop_str
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Take new text; return what is safe to show now (all of it, up to a match)."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        found = self._first_match(buf)
        if found is not None:
            index, stop = found
            self.matched = stop
            self._held = ""
            return buf[: index + len(stop)] if self._include else buf[:index]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """Release the held tail (the request ended without it becoming a stop string)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = buf.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        longest = max(len(s) for s in self._stops) - 1
        for size in range(min(longest, len(buf)), 0, -1):
            tail = buf[len(buf) - size :]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0


class IncrementalDetokenizer:
    """Token ids -> text deltas for one request, stop strings applied."""

    def __init__(self, table: TokenTable, params: DetokenizeParams) -> None:
        self._table = table
        self._skip_special = params.skip_special_tokens
        # NOTE: Python's incremental UTF-8 decoder holds back an incomplete trailing
        # sequence and decodes the rest; errors="replace" matches a one-shot decode.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopMatcher(params.stop, params.include_stop_str)
        self.finished = False

    @property
    def stop(self) -> str | None:
        """The stop string that ended the request, if one did."""
        return self._stops.matched

    def feed(self, ids: Sequence[int]) -> Delta:
        """Decode new ids; stops at (and keeps) the token that completes a stop string."""
        if self.finished:
            return Delta("", 0, None)
        parts: list[str] = []
        for i, token_id in enumerate(ids):
            data = self._table.text_bytes(token_id, self._skip_special)
            if not data:
                continue
            parts.append(self._stops.push(self._utf8.decode(data)))
            if self._stops.matched is not None:
                self.finished = True
                return Delta("".join(parts), i + 1, self._stops.matched)
        return Delta("".join(parts), len(ids), None)

    def finish(self) -> Delta:
        """End of the request: flush incomplete bytes (as U+FFFD) and the held-back tail."""
        if self.finished:
            return Delta("", 0, None)
        self.finished = True
        text = self._stops.push(self._utf8.decode(b"", final=True))
        if self._stops.matched is not None:
            return Delta(text, 0, self._stops.matched)
        return Delta(text + self._stops.flush(), 0, None)
