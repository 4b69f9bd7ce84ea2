"""A thinking model's reasoning kept apart from its answer, split off the streamed text into
`reasoning_content`:
- `think`: `<think>...</think>` (Qwen3 / 3.5 / 3.6, DeepSeek-R1, SmolLM3 and the others that write it so);
- `gemma4`: `<|channel>thought\n...<channel|>` (Gemma 4, special tokens);
- `harmony` (gpt-oss): messages by channel, `<|channel|>analysis<|message|>...<|end|>` the reasoning and
  `<|start|>assistant<|channel|>final<|message|>...` the answer (`HarmonyStream`).

The syntax is detected from the chat template; a template whose generation prompt already opens the
reasoning (the prompt ends with its start tag) starts the reply inside it. A syntax written in special
tokens is split on the text that keeps them. What the model writes is not changed: speculation stays
exact, and the split is of the text alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.chat import held_back

__all__ = [
    "REASONING_SYNTAXES",
    "HarmonyStream",
    "ReasoningStream",
    "ReasoningSyntax",
    "ThinkingBudget",
    "detect_reasoning",
    "reasoning_stream",
]


@dataclass(frozen=True)
class ReasoningSyntax:
    name: str
    start: str  # opens the reasoning
    end: str  # closes it; the answer follows
    label: str = ""  # written right after `start`, not part of the reasoning
    special: bool = False  # the tags are special tokens: split the text that keeps them
    resume: str = ""  # written after `end` before the next message (harmony's header)


REASONING_SYNTAXES = {
    s.name: s
    for s in [
        ReasoningSyntax("think", "<think>", "</think>"),
        ReasoningSyntax("gemma4", "<|channel>", "<channel|>", label="thought\n", special=True),
        ReasoningSyntax(
            "harmony", "<|channel|>analysis<|message|>", "<|end|>", special=True, resume="<|start|>assistant"
        ),
    ]
}


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
    marks = {
        "think": ("<think>", "</think>"),
        "gemma4": ("<|channel>", "<channel|>"),
        "harmony": ("<|channel|>", "analysis"),
    }
    for name, (a, b) in marks.items():
        if template and a in template and b in template:
            return REASONING_SYNTAXES[name]
    return None


def reasoning_stream(syntax: ReasoningSyntax, *, opened: bool = False) -> ReasoningStream | HarmonyStream:
    """The stream that splits `syntax`'s replies."""
    return HarmonyStream() if syntax.name == "harmony" else ReasoningStream(syntax, opened=opened)


class ReasoningStream:
    """Streamed text split into (reasoning, content) deltas. `opened`: the prompt already opened the
    reasoning. A tag split across deltas is held back until it is whole; a reply that starts with anything
    but the opening tag (blank space aside) is all content."""

    def __init__(self, syntax: ReasoningSyntax, *, opened: bool = False) -> None:
        self.syntax = syntax
        # start -> label -> reasoning -> content, or start -> content
        self.mode = "label" if opened else "start"
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
                    self.mode, text = "label", body[len(self.syntax.start) :]
                else:
                    self.mode = "content"
            elif self.mode == "label":  # the label after the start tag is dropped, once whole
                label = self.syntax.label
                if label.startswith(text) and len(text) < len(label):
                    self._held = text
                    return reasoning, content
                self.mode, text = "reasoning", text.removeprefix(label)
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
        if self.mode == "label":
            return "", ""
        return "", held


class HarmonyStream:
    """gpt-oss's reply, in the text that keeps its special tokens, split by channel: `analysis` messages are
    reasoning, `final` ones (and `commentary` without a recipient: preambles) content; a message to a
    recipient (a tool call) is neither (`specdec.tools` parses it). A reply that opens no channel is all
    content. Tags split across deltas are held back until whole."""

    ENDS = ("<|end|>", "<|call|>", "<|return|>")

    def __init__(self) -> None:
        self.mode, self.kind, self._held = "header", "", ""

    def push(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        out = {"reasoning": "", "content": "", "call": ""}
        while text:
            if self.mode == "header":
                at = text.find("<|message|>")
                if at < 0:
                    head = text.lstrip()
                    if head and not "<|".startswith(head[:2]):  # a header opens with a special token
                        self.mode = "plain"  # no channels: all of it is content
                        continue
                    self._held = text
                    break
                header, text = text[:at], text[at + len("<|message|>") :]
                channel = header.rsplit("<|channel|>", 1)[-1]
                to = " to=" in f" {header}"  # a recipient: the message is a call
                self.kind = "reasoning" if channel.startswith("analysis") else "call" if to else "content"
                self.mode = "body"
            elif self.mode == "body":
                ends = [(text.find(e), e) for e in self.ENDS if e in text]
                if not ends:
                    keep = held_back(text, list(self.ENDS))
                    out[self.kind] += text[: len(text) - keep]
                    self._held = text[len(text) - keep :]
                    break
                at, tag = min(ends)
                out[self.kind] += text[:at]
                self.mode, text = "header", text[at + len(tag) :]
            else:
                out["content"] += text
                text = ""
        return out["reasoning"], out["content"]

    def finish(self) -> tuple[str, str]:
        """What was held back: a message cut short stays what it was; an unfinished header is dropped."""
        held, self._held = self._held, ""
        if self.mode == "body" and self.kind != "call":
            return (held, "") if self.kind == "reasoning" else ("", held)
        return "", held if self.mode == "plain" else ""
