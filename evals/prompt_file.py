"""A user's own prompts for `specdec eval --prompts FILE`: a JSON object per line, its format told per line.

- `{"prompt": "..."}`: raw text, encoded as it is (no chat template);
- `{"messages": [{"role": "user", "content": "..."}, ...]}`: a chat, through the verifier's chat template;
- `{"turns": ["...", "..."]}`: Spec-Bench / MT-Bench style user turns; the first is decoded, and with
  `--turns 2` the second after the verifier's own answer to the first.

Each line may also name an `id` (or `question_id`, as Spec-Bench and MT-Bench do) and a `category`; other
keys (`reference`, ...) are ignored. Lines of one category are one group of the report (`<file
stem>:<category>`, or `<file stem>` without one), and `--limit N` takes N per group, spread evenly over it.
Any line that is not one of these is one error naming the file and the line, before any model loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specdec.chat import check_messages, check_text
from specdec.evals.datasets import PromptRecord, spread

__all__ = ["FORMATS", "load_prompt_file"]

#: the keys that say a line's format (exactly one per line)
FORMATS = ("prompt", "messages", "turns")


def _record(row: Any, stem: str, n: int) -> PromptRecord:
    """One line's record, or ValueError saying what is wrong with it (the caller adds file and line)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    kinds = [k for k in FORMATS if k in row]
    if len(kinds) != 1:
        got = "none" if not kinds else " and ".join(kinds)
        raise ValueError(f"give exactly one of {', '.join(map(repr, FORMATS))} (got {got})")
    ident = row.get("id", row.get("question_id", n))
    if not isinstance(ident, (str, int)) or isinstance(ident, bool) or ident == "":
        raise ValueError(f"'id' must be a non-empty string or an integer, got {ident!r:.60}")
    category = row.get("category")
    if category is not None and (not isinstance(category, str) or not category.strip()):
        raise ValueError(f"'category' must be a non-empty string, got {category!r:.60}")
    kind, value = kinds[0], row[kinds[0]]
    text, messages, turns = None, [], []
    if kind == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError(f"'prompt' must be a non-empty string, got {value!r:.60}")
        text, turns = check_text(value, "'prompt'"), [value]
    elif kind == "messages":
        messages = check_messages(value)
        turns = [m["content"] for m in messages if m["role"] == "user"]
    else:
        if not isinstance(value, list) or not value or not all(isinstance(t, str) and t for t in value):
            raise ValueError(f"'turns' must be a non-empty list of non-empty strings, got {value!r:.60}")
        turns = [check_text(t, f"turns[{i}]") for i, t in enumerate(value)]
        messages = [{"role": "user", "content": turns[0]}]
    return PromptRecord(
        id=f"{stem}/{ident}",
        dataset=f"{stem}:{category}" if category else stem,
        messages=messages,
        turns=turns if kind != "messages" else [],  # a chat's later turns are already in `messages`
        meta={"line": n, "format": kind, **({"category": category} if category else {})},
        text=text,
    )


def load_prompt_file(path: str | os.PathLike[str], limit: int | None = None) -> list[PromptRecord]:
    """The prompts of a JSONL file (see the module's docstring), grouped by category in order of first
    appearance, `limit` per group spread evenly over it; ValueError `FILE:LINE: why` on the first bad line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"--prompts {str(path)!r}: no such file")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    groups: dict[str, list[PromptRecord]] = {}
    seen: dict[str, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: not JSON ({e.msg} at column {e.colno})") from None
        try:
            rec = _record(row, p.stem, n)
        except ValueError as e:
            raise ValueError(f"{p}:{n}: {e}") from None
        if rec.id in seen:
            raise ValueError(f"{p}:{n}: id {rec.id.split('/', 1)[1]!r} is already on line {seen[rec.id]}")
        seen[rec.id] = n
        groups.setdefault(rec.dataset, []).append(rec)
    if not groups:
        raise ValueError(f"{p}: no prompts (one JSON object per line)")
    return [r for recs in groups.values() for r in spread(recs, limit)]
