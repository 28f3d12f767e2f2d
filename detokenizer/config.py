"""Configuration of the detokenizer process.

Built by the launcher in the frontend process and handed to `run_detokenizer` in the
detokenizer process as JSON (so it stays a plain dataclass).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DetokenizerConfig:
    tokenizer_path: str
    """The checkpoint directory (its tokenizer.json), or a tokenizer.json path."""

    input_addr: str
    """unix:// address the detokenizer listens on (a frame stream, protocol/step_channel.py):
    BatchOutput from the controller."""

    output_addr: str
    """ZMQ address the detokenizer connects to, PUSH: DetokenizedBatch to the frontend."""

    abort_addr: str | None = None
    """The controller's request input (PUSH): a request this process ends on a stop string
    is aborted there, so the engine stops generating it. None: no such socket (tests)."""

    parent_pid: int | None = None
    """Exit when this process is no longer our parent (the server died); None: no check."""

    niceness: int = 0
    """This process's niceness while busy (--serving-nice, protocol.process.ServingPriority);
    0 = the default priority always."""

    parent_check_s: float = 1.0
    """Seconds between checks that the parent is alive."""
