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

import json
import operator
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "FALLBACK_CHAT_FORMAT",
    "ROLES",
    "chat_template",
    "check_messages",
    "check_text",
    "encode_prompt",
    "has_media",
    "held_back",
    "prompt_format",
    "set_chat_template",
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


def held_back(text: str, tags: Sequence[str]) -> int:
    """How many of `text`'s last characters could begin one of `tags` (a stop string, a call's or the
    reasoning's opening): streamed text holds them back until the next piece says."""
    return max((k for t in tags for k in range(1, len(t)) if text.endswith(t[:k])), default=0)


def has_media(content: Any) -> bool:
    """Whether chat content (OpenAI / transformers style parts) carries a non-text part."""
    parts = content if isinstance(content, Sequence) and not isinstance(content, str) else ()
    return any(isinstance(p, Mapping) and p.get("type", "text") != "text" for p in parts)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as plain dicts, or ValueError naming the first bad one. An assistant message may carry
    OpenAI `tool_calls` (their JSON arguments become objects, as chat templates read them) and no content;
    a tool message its `tool_call_id`."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("chat messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object {{'role', 'content'}}, got {m!r:.80}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r:.40}")
        if role == "assistant" and m.get("tool_calls"):
            out.append(_with_calls(m, i))
            continue
        if role == "tool" and isinstance(content, str):
            extra = {k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)}
            out.append({"role": role, "content": check_text(content, f"messages[{i}].content"), **extra})
            continue
        if not isinstance(content, str):
            if has_media(content):
                raise ValueError(
                    f"messages[{i}].content has an image / audio / video part: text prompts only"
                )
            raise ValueError(f"messages[{i}].content must be a string, got {content!r:.80}")
        out.append({"role": role, "content": check_text(content, f"messages[{i}].content")})
    return out


def _with_calls(m: Mapping, i: int) -> dict[str, Any]:
    """An assistant message with OpenAI `tool_calls`, arguments parsed (templates `tojson` them)."""
    calls = []
    for j, c in enumerate(m["tool_calls"] if isinstance(m["tool_calls"], list) else [None]):
        fn = c.get("function") if isinstance(c, Mapping) else None
        args = fn.get("arguments", "{}") if isinstance(fn, Mapping) else None
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            args = None
        if (
            not isinstance(fn, Mapping)
            or not isinstance(fn.get("name"), str)
            or not isinstance(args, Mapping)
        ):
            raise ValueError(
                f"messages[{i}].tool_calls[{j}] must be {{'type': 'function', 'function': {{'name', "
                "'arguments': JSON object text}}}"
            )
        call = {"type": "function", "function": {"name": fn["name"], "arguments": dict(args)}}
        calls.append({**call, "id": c["id"]} if isinstance(c.get("id"), str) else call)
    content = m.get("content") or ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string or null, got {content!r:.80}")
    return {
        "role": "assistant",
        "content": check_text(content, f"messages[{i}].content"),
        "tool_calls": calls,
    }


def chat_template(tokenizer: Any) -> str | None:
    """The tokenizer's chat template text (mlx_lm's wrapper: its HF tokenizer's); None where it has none."""
    inner = getattr(tokenizer, "_tokenizer", None)
    for t in (tokenizer, inner):
        text = getattr(t, "chat_template", None)
        if isinstance(text, str):
            return text
    return None


def set_chat_template(tokenizer: Any, template: str) -> None:
    """Render chat messages with `template` (Jinja) in place of the tokenizer's own."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer to give a chat template")
    inner = getattr(tokenizer, "_tokenizer", None)
    target = inner if hasattr(inner, "apply_chat_template") else tokenizer  # mlx_lm's wrapper: its HF one
    target.chat_template = template
    if isinstance(getattr(tokenizer, "has_chat_template", None), bool):  # mlx_lm's wrapper caches it
        tokenizer.has_chat_template = True


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


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, extra: dict[str, Any]
) -> list[int]:
    if tools and "tools" not in (chat_template(tokenizer) or ""):
        raise ValueError(
            "this model's chat template has no tool syntax, so it cannot be given tools: leave 'tools' out, "
            "or serve it with --chat-template FILE (a template that renders them)"
        )
    if any(m["role"] == "tool" or "tool_calls" in m for m in messages) and not has_chat_template(tokenizer):
        raise ValueError("tool calls and results need a chat template that renders them; this model has none")
    if not has_chat_template(tokenizer):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return list(tokenizer.encode(text))
    kw = {**extra, "tools": tools} if tools else extra
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    except Exception as e:
        from jinja2 import TemplateError  # transformers and mlx_lm render templates with jinja2

        if isinstance(e, TemplateError):
            raise ValueError(f"the chat template rejected these messages: {e}") from None
        raise
    # transformers 5 returns a BatchEncoding (a Mapping, not a dict); older versions and mlx_lm a list
    return [int(t) for t in (ids["input_ids"] if isinstance(ids, Mapping) else ids)]


def encode_prompt(
    verifier: Any, prompt: Prompt, *, tools: list[dict] | None = None, template_kwargs: dict | None = None
) -> list[int]:
    """Text, chat messages or token ids -> prompt ids for `verifier` (its tokenizer; see the module
    docstring); `tools` (OpenAI's, `specdec.tools.check_tools`) rendered by the chat template with chat
    messages, with `template_kwargs` (enable_thinking, ...). ValueError for anything no tokenizer can take,
    before any work."""
    chat = not isinstance(prompt, str) and isinstance(prompt, Sequence) and len(prompt) > 0
    chat = chat and isinstance(prompt[0], Mapping)
    if tools and not chat:
        raise ValueError("tools are given to a model with chat messages, not text or token ids")
    if template_kwargs and not chat:  # they reach a chat template only: refused, not ignored
        raise ValueError("chat template arguments go with chat messages, not text or token ids")
    if isinstance(prompt, str) or chat:
        tok = verifier.tokenizer
        if tok is None:
            raise ValueError(f"verifier {verifier.model_name!r} has no tokenizer: pass token ids")
        if isinstance(prompt, str):
            return list(tok.encode(check_text(prompt, "the prompt")))
        return _render(tok, check_messages(prompt), tools, template_kwargs or {})
    if not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise ValueError("empty prompt: give text, chat messages or token ids")
    ids = []
    for t in prompt:  # ints, numpy integers and 0-d integer tensors
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ValueError(f"token ids must be integers, got {t!r:.40}")
        ids.append(operator.index(t))
    return ids
