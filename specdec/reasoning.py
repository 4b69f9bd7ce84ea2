"""A thinking model's reasoning kept apart from its answer: `<think>...</think>` (Qwen3 / 3.5 / 3.6,
DeepSeek-R1, SmolLM3 and the others that write it so) split off the streamed text into `reasoning_content`.

The syntax is detected from the chat template (it names `<think>`); a template whose generation prompt
already opens the reasoning (the prompt ends with `<think>`) starts the reply inside it. What the model writes
is not changed: speculation stays exact, and the split is of the text alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.chat import held_back

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

    def _begin(self, output: Sequence[int]) -> int | None:
        """Where the reasoning begins in `output` (None: the reply has none)."""
        if self.opened:
            return 0
        n = len(self.start)
        return n if n and tuple(output[:n]) == self.start else None

    def ended(self, output: Sequence[int], *, lo: int = 0) -> bool:
        """Whether the end tag closes the reasoning in `output`, searched from position `lo` on (a caller
        that knows it does not start before)."""
        begin, e = self._begin(output), self.end
        if begin is None:
            return False
        return any(
            tuple(output[i : i + len(e)]) == e for i in range(max(begin, lo), len(output) - len(e) + 1)
        )

    def forced(self, output: Sequence[int], *, lo: int = 0) -> int | None:
        """The token the budget forces after `output` (the reply so far), or None; `lo` as `ended`'s."""
        begin = self._begin(output)
        if begin is None or len(output) - begin < self.tokens or self.ended(output, lo=lo):
            return None
        e, body = self.end, len(output) - begin
        # how much of the tag is written already
        k = next(
            k for k in range(len(e) - 1, -1, -1) if k == 0 or (k <= body and tuple(output[-k:]) == e[:k])
        )
        return e[k]


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
                    keep = held_back(text, [self.syntax.end])
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
