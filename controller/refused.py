"""Refused: a control command that cannot be carried out (controller process)."""

from __future__ import annotations


class Refused(Exception):
    """A command that cannot be carried out: its HTTP status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
