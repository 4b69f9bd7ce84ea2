"""A model's reply as apps read it: a thinking model's reasoning apart from the content, and tool calls
parsed out of it, as it streams or at its end. One split for the server and the Python API.

`ReplyFormat.of(verifier)` reads how the model writes them from its chat template (or a named call
syntax): its reasoning syntax (`specdec.reasoning`), its call syntax (`specdec.tools`) and the special
tokens they are written in. Where a syntax is made of special tokens (Gemma 4, gpt-oss), the split reads the
reply's text with them kept and takes them out of what it gives back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specdec.chat import chat_template
from specdec.grammar import GrammarSpec
from specdec.processors import LogitsParams
from specdec.reasoning import ReasoningSyntax, detect_reasoning, reasoning_stream
from specdec.tools import SYNTAXES, Syntax, ToolCall, ToolChoice, ToolStream, detect_syntax, special_ids
from specdec.tools import tool_grammar as _tool_grammar

__all__ = ["ReplyFormat", "ReplySplit"]


def _without_special_tokens(tokenizer: Any) -> Callable[[str], str]:
    """text -> the text without the tokenizer's special tokens (as decoding that skips them gives it)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or [])
    found |= {
        t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values() if t.special
    }
    if not found:
        return str
    pattern = re.compile("|".join(map(re.escape, sorted(found, key=len, reverse=True))))
    return lambda text: pattern.sub("", text)


def _raw_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """ids -> their text with special tokens kept (where the tokenizer can keep them)."""
    if hasattr(tokenizer, "convert_ids_to_tokens") or hasattr(
        getattr(tokenizer, "_tokenizer", None), "decode"
    ):
        return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)
    return lambda ids: tokenizer.decode(list(ids))


@dataclass(frozen=True)
class ReplyFormat:
    """How a model writes its replies: `reasoning` and `calls` syntaxes (None: none known), the call syntax's
    special tokens by id (`marks`), its text with special tokens kept (`raw_text`) and taken out
    (`clean_text`), and its stop tokens."""

    reasoning: ReasoningSyntax | None
    calls: Syntax | None
    marks: Mapping[str, int]
    raw_text: Callable[[Sequence[int]], str]
    clean_text: Callable[[str], str]
    stop_ids: Collection[int]

    @classmethod
    def of(cls, verifier: Any, *, tool_parser: str | None = None) -> ReplyFormat:
        """The format of `verifier`'s replies, read from its tokenizer's chat template; `tool_parser` names
        the call syntax instead (one of `specdec.tools.SYNTAXES`)."""
        if tool_parser is not None and tool_parser not in SYNTAXES:
            raise ValueError(f"unknown tool call parser {tool_parser!r}; choose from {', '.join(SYNTAXES)}")
        tok = verifier.tokenizer
        template = chat_template(tok)
        return cls(
            reasoning=detect_reasoning(template),
            calls=SYNTAXES[tool_parser] if tool_parser else detect_syntax(template),
            marks=special_ids(tok) if tok is not None else {},
            raw_text=_raw_decoder(tok) if tok is not None else lambda ids: "",
            clean_text=_without_special_tokens(tok),
            stop_ids=frozenset(verifier.eos_token_ids),
        )

    def opened(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt leaves the reply inside the reasoning (its generation prompt opened it)."""
        start = self.reasoning.start if self.reasoning else None
        return bool(start) and self.raw_text(prompt_ids[-8:]).rstrip().endswith(start)

    def call_syntax(self) -> Syntax:
        """The call syntax; ValueError where the model shows none we parse."""
        if self.calls is None:
            raise ValueError(
                "this model's chat template writes tool calls in a syntax we do not parse: name one with "
                f"--tool-call-parser ({', '.join(SYNTAXES)})"
            )
        return self.calls

    def tool_grammar(
        self, tools: Sequence[Mapping], choice: ToolChoice, parallel: bool, *, opened: bool = False
    ) -> GrammarSpec | None:
        """The grammar of a reply that is only valid calls, under `choice` "required" or a named function
        (None under "auto" / "none"), a thinking model's reasoning allowed first (and closed first where
        the prompt `opened` it); ValueError for a choice the tools or the syntax cannot meet."""
        syntax = self.call_syntax()
        if choice.mode not in ("required", "named"):
            return None
        return _tool_grammar(
            syntax, tools, choice, parallel, special=self.marks, reasoning=self.reasoning, opened=opened
        )

    def constrain(
        self,
        logits: LogitsParams | None,
        *,
        tools: list[dict] | None,
        tool_choice: Any,
        parallel: bool,
        response_format: Mapping[str, Any] | None,
        opened: bool,
    ) -> LogitsParams | None:
        """`logits` with the grammar that a forced tool choice or `response_format` asks for (`opened`: the
        prompt opened a thinking model's reasoning); ValueError for options that contradict each other."""
        grammar = None
        if tools is not None:
            grammar = self.tool_grammar(tools, ToolChoice.parse(tool_choice), parallel, opened=opened)
        elif tool_choice is not None:
            raise ValueError("tool_choice is given without tools")
        if response_format is not None:
            if grammar is not None:
                raise ValueError("give a forced tool_choice or response_format, not both")
            grammar = GrammarSpec.from_request({"response_format": response_format})
        if grammar is None:
            return logits
        if logits is not None and logits.grammar is not None:
            raise ValueError("logits already holds a grammar: give it, tools or response_format, not two")
        return replace(logits or LogitsParams(), grammar=grammar)

    def split(self, *, tools: bool, opened: bool = False, chat: bool = True) -> ReplySplit:
        """A splitter for one reply (`tools`: calls are parsed out of it; not `chat`: a text completion,
        whose text is all content)."""
        return ReplySplit(self, tools=tools, opened=opened, chat=chat)


class _RawText:
    """A reply's text with special tokens kept, as its tokens come (stop tokens left out): each push gives
    the new text once it is whole (a character split across tokens waits for its last byte)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Collection[int]) -> None:
        self.decode, self.stops, self.ids, self.start, self.read = decode, stops, [], 0, 0

    def push(self, tokens: Sequence[int]) -> str:
        self.ids += [t for t in tokens if t not in self.stops]
        # decode from a few tokens back, so a token whose text depends on the one before comes out right
        before, now = self.decode(self.ids[self.start : self.read]), self.decode(self.ids[self.start :])
        if now.endswith("\ufffd") or len(now) < len(before):
            return ""
        self.start, self.read = self.read, len(self.ids)
        return now[len(before) :]


class ReplySplit:
    """One reply as it streams, split into reasoning and content, and the content into text and tool calls
    (held back until they parse). `push` each step's text and tokens; `finish` once it ended."""

    def __init__(self, fmt: ReplyFormat, *, tools: bool, opened: bool = False, chat: bool = True) -> None:
        self.fmt = fmt
        syntax = fmt.reasoning if chat else None
        self.reasoning = reasoning_stream(syntax, opened=opened) if syntax else None
        self.tools = ToolStream(fmt.call_syntax()) if tools else None
        syntaxes = (syntax, self.tools and self.tools.syntax)
        self.special = any(x is not None and x.special for x in syntaxes)
        # the text with special tokens kept, only where a syntax is written in them (the calls' parse at
        # the end reads it too, and a special call syntax makes `special` true)
        self.raw = _RawText(fmt.raw_text, fmt.stop_ids) if self.special else None
        self.clean = fmt.clean_text if self.special else str
        self.reasoning_text, self.content, self.calls = "", "", []  # what it gave so far

    def push(self, delta: str, tokens: Sequence[int]) -> tuple[str, str]:
        """(reasoning, content) that can go out now, given a step's text and tokens."""
        if self.raw is not None:
            delta = self.raw.push(tokens)
        thought, delta = self.reasoning.push(delta) if self.reasoning else ("", delta)
        return self._gave(self.clean(thought), self.clean(self.tools.push(delta) if self.tools else delta))

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, calls) left at the end."""
        thought, rest = self.reasoning.finish() if self.reasoning else ("", "")
        thought, rest = self.clean(thought), self.clean(rest)
        if self.tools is not None:
            more = self.tools.push(rest)
            special = self.tools.syntax.special  # then `raw` is kept (see __init__)
            tail, self.calls = self.tools.finish(self.fmt.raw_text(self.raw.ids) if special else None)
            rest = self.clean(more + tail)
        return (*self._gave(thought, rest), self.calls)

    def _gave(self, thought: str, content: str) -> tuple[str, str]:
        self.reasoning_text += thought
        self.content += content
        return thought, content

    def message(self) -> dict[str, Any]:
        """The whole reply as an OpenAI assistant message (after `finish`): "content", and where the model
        wrote them "reasoning_content" and "tool_calls"."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning_text or None
        if self.calls:
            out["tool_calls"] = [c.to_openai() for c in self.calls]
        return out
