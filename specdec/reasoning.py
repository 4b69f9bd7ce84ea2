"""A thinking model's reasoning kept apart from its answer: `<think>...</think>` (Qwen3 / 3.5 / 3.6,
DeepSeek-R1, SmolLM3 and the others that write it so) split off the streamed text into `reasoning_content`.

The syntax is detected from the chat template (it names `<think>`); a template whose generation prompt
already opens the reasoning (the prompt ends with `<think>`) starts the reply inside it. What the model writes
is not changed: speculation stays exact, and the split is of the text alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["REASONING_SYNTAXES", "ReasoningStream", "ReasoningSyntax", "ThinkingBudget", "detect_reasoning"]


@dataclass(frozen=True)
class ReasoningSyntax:
    name: str
    start: str  # opens the reasoning
    end: str  # closes it; the answer follows


REASONING_SYNTAXES = {"think": ReasoningSyntax("think", "<think>", "</think>")}


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `tokens` tokens of reasoning: past them the end tag is forced, token by token. A logits
    processor (`LogitsParams.thinking`), so each verify row decides with its own history and speculation stays
    exact. `end` / `start`: the tags' token ids; `opened`: the prompt opened the reasoning (else a reply that
    begins with `start` is reasoning, and any other is not)."""

    tokens: int
    end: tuple[int, ...]
    start: tuple[int, ...] = ()
    opened: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"a thinking budget is a number of tokens >= 0, got {self.tokens!r:.20}")
        if not self.end:
            raise ValueError("a thinking budget needs the end tag's tokens")

    def forced(self, output: Sequence[int]) -> int | None:
        """The token the budget forces after `output` (the reply so far), or None."""
        n = len(self.start)
        if self.opened:
            body = list(output)
        elif n and list(output[:n]) == list(self.start):
            body = list(output[n:])
        else:
            return None
        e = list(self.end)
        if len(body) < self.tokens or any(body[i : i + len(e)] == e for i in range(len(body) - len(e) + 1)):
            return None
        k = next(k for k in range(len(e) - 1, -1, -1) if k == 0 or body[-k:] == e[:k])  # of the tag, written
        return self.end[k]


def detect_reasoning(template: str | None) -> ReasoningSyntax | None:
    """The reasoning syntax a chat template shows (None: none)."""
    if template and "<think>" in template and "</think>" in template:
        return REASONING_SYNTAXES["think"]
    return None


class ReasoningStream:
    """Streamed text split into (reasoning, content) deltas. `opened`: the prompt already opened the
    reasoning. A tag split across deltas is held back until it is whole; a reply that starts with anything
    but the opening tag (blank space aside) is all content."""

    def __init__(self, syntax: ReasoningSyntax, *, opened: bool = False) -> None:
        self.syntax = syntax
        self.mode = "reasoning" if opened else "start"  # start -> reasoning -> content, or start -> content
        self._held = ""
        self._fresh = False  # content just began after the reasoning

    def push(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        reasoning = content = ""
        while text:
            if self.mode == "start":
                body = text.lstrip()
                if self.syntax.start.startswith(body):  # blank, or the tag's beginning: wait
                    self._held = text
                    return reasoning, content
                if body.startswith(self.syntax.start):
                    self.mode, text = "reasoning", body[len(self.syntax.start) :]
                else:
                    self.mode = "content"
            elif self.mode == "reasoning":
                at = text.find(self.syntax.end)
                if at < 0:
                    keep = _partial(text, self.syntax.end)
                    reasoning += text[: len(text) - keep]
                    self._held = text[len(text) - keep :]
                    return reasoning, content
                reasoning += text[:at]
                self.mode, self._fresh, text = "content", True, text[at + len(self.syntax.end) :]
            else:
                if self._fresh:  # the blank lines between the reasoning and the answer are neither
                    text = text.lstrip("\n")
                    self._fresh = not text
                content += text
                text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning cut short stays reasoning; an unfinished tag is text."""
        held, self._held = self._held, ""
        if self.mode == "reasoning":
            return held, ""
        return "", held


def _partial(text: str, tag: str) -> int:
    """How many of `text`'s last characters could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
