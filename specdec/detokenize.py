"""Text from tokens as they stream: the decode that does not rewrite streamed text, and incremental
detokenisation with stop strings (`specdec.stream`'s contract: only stable text is emitted; a trailing
U+FFFD and any suffix that could start a stop string wait until they resolve)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specdec.chat import held_back

__all__ = ["Detokenizer", "text_decoder"]


def text_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """ids -> text without special tokens and without transformers' space clean-up (which rewrites text
    already streamed when the next token arrives, e.g. "a ," -> "a,")."""
    if hasattr(tokenizer, "convert_ids_to_tokens"):  # a transformers tokenizer
        return lambda ids: tokenizer.decode(
            list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
    return tokenizer.decode


class Detokenizer:
    """Incremental detokenisation with stop strings: `push` each step's tokens, get the new stable text."""

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        *,
        stop: Sequence[str] = (),
        skip_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._decode, self._skip = decode, skip_ids
        self.stop = tuple(s for s in stop if s)
        self._ids: list[int] = []  # text-bearing tokens
        self._n_of: list[int] = []  # _n_of[i]: tokens pushed when _ids[i] came
        self.n_tokens = 0  # tokens pushed (stop tokens included)
        self.text = ""  # emitted so far
        self.stop_string: str | None = None
        self.n_keep: int | None = None  # once stopped: tokens up to the one that completed the stop string

    def push(self, tokens: Sequence[int]) -> str:
        if self.stop_string is not None:
            return ""
        start = len(self._ids)
        for t in tokens:
            self.n_tokens += 1
            if t not in self._skip:
                self._ids.append(t)
                self._n_of.append(self.n_tokens)
        full = self._decode(self._ids)
        if not full.startswith(self.text):
            return ""  # the tokenizer rewrote streamed text (see the module docstring): wait for the end
        hit = self._find_stop(full)
        if hit is not None:
            idx, s = hit
            self.stop_string = s
            self.n_keep = self._n_until(idx + len(s), start)
            return self._emit(full[:idx])
        stable = full.rstrip("\ufffd")
        return self._emit(stable[: len(stable) - held_back(stable, self.stop)])

    def flush(self) -> str:
        """The held-back text at the end of the output (nothing after a stop string)."""
        if self.stop_string is not None:
            return ""
        full = self._decode(self._ids)
        return self._emit(full) if full.startswith(self.text) else ""

    def _emit(self, upto: str) -> str:
        if len(upto) <= len(self.text):
            return ""
        delta = upto[len(self.text) :]
        self.text = upto
        return delta

    def _find_stop(self, full: str) -> tuple[int, str] | None:
        # a stop string cannot start inside emitted text: its start would have been held back
        hits = [(i, s) for s in self.stop if (i := full.find(s, len(self.text))) >= 0]
        return min(hits, key=lambda h: h[0]) if hits else None

    def _n_until(self, n_chars: int, start: int) -> int:
        """Tokens pushed up to the first text-bearing token (from `start`, the first of this push: earlier
        ones did not complete the stop string) whose text reaches n_chars."""
        for i in range(start, len(self._ids)):
            if len(self._decode(self._ids[: i + 1]).rstrip("\ufffd")) >= n_chars:
                return self._n_of[i]
        return self.n_tokens
