"""Prompts to token ids, in one place: text, chat messages or token ids (API, streaming, server, evals and
training data all encode through `encode_prompt`).

- Text: the tokenizer's `encode`.
- Chat messages, `[{"role", "content"}, ...]`: checked first (known roles, string contents, valid Unicode:
  a lone surrogate such as "\\ud800" is valid JSON but no tokenizer can encode it), then rendered by the
  tokenizer's chat template with the generation prompt. A template that rejects the conversation (e.g.
  Gemma's "roles must alternate") raises ValueError with its message. A tokenizer without a chat template
  (the stub's bytes) gets `FALLBACK_CHAT_FORMAT`: "<role>: <content>\\n" per message, then "assistant:".
- Token ids: a sequence of ints, kept as they are (the engine checks them against the vocabulary).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "FALLBACK_CHAT_FORMAT",
    "ROLES",
    "check_messages",
    "check_text",
    "encode_prompt",
    "has_media",
    "prompt_format",
]

FALLBACK_CHAT_FORMAT = "<role>: <content>\\n per message, then 'assistant:'"
#: roles a chat message may have (OpenAI's; a template may accept fewer and say so)
ROLES = ("system", "developer", "user", "assistant", "tool")

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


def check_text(text: str, where: str) -> str:
    """`text` if it encodes as UTF-8; ValueError naming `where` and the offending character otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where} is not valid Unicode text: {text[e.start : e.end]!r} at index {e.start} is a lone "
            "surrogate (an unpaired \\ud800-\\udfff escape)"
        ) from None
    return text


def has_media(content: Any) -> bool:
    """Whether chat content (OpenAI / transformers style parts) carries a non-text part."""
    parts = content if isinstance(content, Sequence) and not isinstance(content, str) else ()
    return any(isinstance(p, Mapping) and p.get("type", "text") != "text" for p in parts)


def check_messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages as plain dicts, or ValueError naming the first bad one."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("chat messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object {{'role', 'content'}}, got {m!r:.80}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r:.40}")
        if not isinstance(content, str):
            if has_media(content):
                raise ValueError(
                    f"messages[{i}].content has an image / audio / video part: text prompts only"
                )
            raise ValueError(f"messages[{i}].content must be a string, got {content!r:.80}")
        out.append({"role": role, "content": check_text(content, f"messages[{i}].content")})
    return out


def has_chat_template(tokenizer: Any) -> bool:
    """True for HF tokenizers with a template and mlx_lm TokenizerWrappers that report one."""
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        return False
    flag = getattr(tokenizer, "has_chat_template", None)  # mlx_lm TokenizerWrapper
    if isinstance(flag, bool):
        return flag
    return getattr(tokenizer, "chat_template", None) is not None


def prompt_format(tokenizer: Any) -> str:
    """How chat messages are rendered for `tokenizer`: "chat" (its template) or "fallback"."""
    return "chat" if has_chat_template(tokenizer) else "fallback"


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if not has_chat_template(tokenizer):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return list(tokenizer.encode(text))
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:
        from jinja2 import TemplateError  # transformers and mlx_lm render templates with jinja2

        if isinstance(e, TemplateError):
            raise ValueError(f"the chat template rejected these messages: {e}") from None
        raise
    # transformers 5 returns a BatchEncoding (a Mapping, not a dict); older versions and mlx_lm a list
    return [int(t) for t in (ids["input_ids"] if isinstance(ids, Mapping) else ids)]


def encode_prompt(verifier: Any, prompt: Prompt) -> list[int]:
    """Text, chat messages or token ids -> prompt ids for `verifier` (its tokenizer; see the module
    docstring); ValueError for anything no tokenizer can take, before any work."""
    if isinstance(prompt, str) or (
        isinstance(prompt, Sequence) and len(prompt) > 0 and isinstance(prompt[0], Mapping)
    ):
        tok = verifier.tokenizer
        if tok is None:
            raise ValueError(f"verifier {verifier.model_name!r} has no tokenizer: pass token ids")
        if isinstance(prompt, str):
            return list(tok.encode(check_text(prompt, "the prompt")))
        return _render(tok, check_messages(prompt))
    if not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise ValueError("empty prompt: give text, chat messages or token ids")
    ids = []
    for t in prompt:  # ints, numpy integers and 0-d integer tensors
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ValueError(f"token ids must be integers, got {t!r:.40}")
        ids.append(operator.index(t))
    return ids
