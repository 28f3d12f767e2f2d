"""Reasoning split from the answer (main process): `--reasoning-parser` for models that
think between `<think>` and `</think>` before they answer (Qwen3, QwQ, DeepSeek-R1 and its
distillations).

Whether an answer starts inside the thought is read from the prompt, not guessed: a chat
template that ends its generation prompt with an open `<think>` (DeepSeek-R1's, Qwen3's
thinking-only models') leaves the model thinking from its first token; otherwise the answer
thinks only if it starts with `<think>` (Qwen3's hybrid models; with `enable_thinking:
false` their template closes an empty thought in the prompt, and the answer is all
content). Text until `</think>` is the reasoning, the rest the content; an answer cut short
before `</think>` is all reasoning. Streamed and whole answers split the same way: the whole
one is the stream fed at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.frontend.api.tools import partial_suffix

# NOTE: vLLM's names; both families mark the thought with the same tags.
REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_opens_thought(prompt_text: str) -> bool:
    """Whether the prompt leaves the model inside a `<think>` it did not close."""
    start = prompt_text.rfind(THINK_OPEN)
    return start >= 0 and THINK_CLOSE not in prompt_text[start:]


@dataclass
class ReasoningStream:
    """One choice's text, split into reasoning and content deltas as it streams. A text
    that may still become a tag is held back until it is known."""

    thinking: bool  # the prompt opened the thought
    decided: bool = False  # whether the answer thinks is known
    done: bool = False  # `</think>` has come: the rest is content
    pending: str = ""

    def __post_init__(self) -> None:
        self.decided = self.thinking

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """(reasoning to send now, content to send now)."""
        self.pending += delta
        if not self.decided:
            head = self.pending.lstrip()
            if not final and THINK_OPEN.startswith(head):
                return "", ""  # NOTE: nothing yet, or the start of `<think>`
            self.decided = True
            self.thinking = head.startswith(THINK_OPEN)
            if self.thinking:
                self.pending = head[len(THINK_OPEN) :]
            else:
                self.done = True
        if self.done:
            content, self.pending = self.pending, ""
            return "", content
        end = self.pending.find(THINK_CLOSE)
        if end >= 0:
            reasoning, content = self.pending[:end], self.pending[end + len(THINK_CLOSE) :]
            self.pending, self.done = "", True
            return reasoning, content
        keep = 0 if final else partial_suffix(self.pending, THINK_CLOSE)
        reasoning = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(reasoning) :]
        return reasoning, ""


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(the reasoning, None where the answer did not think; the content)."""
    stream = ReasoningStream(thinking)
    reasoning, content = stream.feed(text, final=True)
    return (reasoning if stream.thinking else None), content
