"""Anthropic's Messages API (`POST /v1/messages`), which coding agents speak: a request is translated into
the OpenAI chat request the server already honours (messages with text, `tool_use` and `tool_result`
blocks, `system`, `tools` with `input_schema`, `tool_choice`, `stop_sequences`, sampling), and the reply
back into content blocks (`thinking`, `text`, `tool_use`) with a `stop_reason`, whole or as Anthropic's
stream events."""

from __future__ import annotations

import json
import uuid
from typing import Any

from specdec.serve.protocol import RequestError
from specdec.tools import ToolCall

__all__ = ["MessageStream", "error_body", "message_body", "stop_reason", "to_openai"]


def error_body(message: str, status: int) -> dict:
    kind = {404: "not_found_error", 413: "request_too_large", 503: "overloaded_error"}.get(status)
    kind = kind or ("invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text(content: Any, where: str) -> str:
    """A text content: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise RequestError(
        f"{where} must be text or a list of text blocks (this server takes text only)", param=where
    )


def _message(m: Any, i: int) -> list[dict]:
    """One Anthropic message -> OpenAI messages (tool results become `tool` messages)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise RequestError(f"{where} must be {{'role': 'user' | 'assistant', 'content': ...}}", param=where)
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of blocks", param=where)
    text, calls, results = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind == "tool_use" and m["role"] == "assistant":
            args = json.dumps(b.get("input") or {})
            calls.append(
                {
                    "id": str(b.get("id", "")),
                    "type": "function",
                    "function": {"name": b.get("name"), "arguments": args},
                }
            )
        elif kind == "tool_result" and m["role"] == "user":
            body = _text(b.get("content", ""), f"{where}.content[{j}].content")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": str(b.get("tool_use_id", "")),
                    "content": ("Error: " if b.get("is_error") else "") + body,
                }
            )
        elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
            continue  # earlier reasoning is not sent back to the model
        else:
            raise RequestError(
                f"{where}.content[{j}]: a {kind!r} block is not taken here (text, tool_use, tool_result)",
                param=where,
            )
    out = results
    if text or calls or not results:
        msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
        out = [*results, {**msg, "tool_calls": calls} if calls else msg]
    return out


def to_openai(body: Any) -> dict:
    """An Anthropic Messages request as the equivalent OpenAI chat request; RequestError where it asks for
    what this server does not do."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if not isinstance(body.get("max_tokens"), int) or isinstance(body["max_tokens"], bool):
        raise RequestError("'max_tokens' is required: an integer >= 1", param="max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    out: dict[str, Any] = {"max_tokens": body["max_tokens"], "stream": body.get("stream", False)}
    system = body.get("system")
    head = [{"role": "system", "content": _text(system, "system")}] if system else []
    out["messages"] = head + [x for i, m in enumerate(msgs) for x in _message(m, i)]
    for ours, theirs in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop", "stop_sequences"),
        ("model", "model"),
    ]:
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RequestError("'tools' must be a list of {name, description, input_schema}", param="tools")
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema", {"type": "object", "properties": {}}),
                },
            }
            for t in tools
        ]
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind == "enabled":
            out["thinking_budget"] = thinking.get("budget_tokens")
        elif kind == "disabled":
            out["chat_template_kwargs"] = {"enable_thinking": False}
        else:
            raise RequestError(
                "'thinking' must be {type: enabled, budget_tokens} or {type: disabled}", param="thinking"
            )
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)  # type: ignore[arg-type]
        if kind == "tool":
            mapped = {"type": "function", "function": {"name": choice.get("name")}}
        if mapped is None:
            raise RequestError("'tool_choice' must be {type: auto | any | tool | none}", param="tool_choice")
        out["tool_choice"] = mapped
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def stop_reason(finish: str, calls: list[ToolCall], stop_string: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a reply."""
    if calls:
        return "tool_use", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return ("max_tokens", None) if finish in ("length", "context") else ("end_turn", None)


def _tool_use(call: ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": "toolu_" + uuid.uuid4().hex[:24],
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def message_body(
    model: str, reasoning: str, text: str, calls: list[ToolCall], reason: tuple[str, str | None], usage: dict
) -> dict:
    """A whole reply."""
    blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
    blocks += [{"type": "text", "text": text}] if text or not calls else []
    blocks += [_tool_use(c) for c in calls]
    return {
        "id": "msg_" + uuid.uuid4().hex,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
    }


class MessageStream:
    """A reply as Anthropic's stream events (`event: <type>` + `data: {...}`): message_start, then per
    content block its start, deltas and stop, then message_delta (the stop reason) and message_stop."""

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.model, self.prompt_tokens = model, prompt_tokens
        self.index, self.open = -1, None  # the open block's kind: "thinking" | "text" | None

    @staticmethod
    def event(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    def start(self) -> str:
        msg = {
            "id": "msg_" + uuid.uuid4().hex,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return self.event("message_start", {"message": msg})

    def _block(self, kind: str, block: dict) -> str:
        out = self.close()
        self.index, self.open = self.index + 1, kind
        return out + self.event("content_block_start", {"index": self.index, "content_block": block})

    def close(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return self.event("content_block_stop", {"index": self.index})

    def thinking(self, delta: str) -> str:
        out = "" if self.open == "thinking" else self._block("thinking", {"type": "thinking", "thinking": ""})
        return out + self.event(
            "content_block_delta",
            {"index": self.index, "delta": {"type": "thinking_delta", "thinking": delta}},
        )

    def text(self, delta: str) -> str:
        out = "" if self.open == "text" else self._block("text", {"type": "text", "text": ""})
        return out + self.event(
            "content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": delta}}
        )

    def tool_use(self, call: ToolCall) -> str:
        block = {**_tool_use(call), "input": {}}
        out = self._block("tool_use", block)
        out += self.event(
            "content_block_delta",
            {"index": self.index, "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
        )
        return out + self.close()

    def end(self, reason: tuple[str, str | None], output_tokens: int) -> str:
        delta = {"stop_reason": reason[0], "stop_sequence": reason[1]}
        return (
            self.close()
            + self.event("message_delta", {"delta": delta, "usage": {"output_tokens": output_tokens}})
            + self.event("message_stop", {})
        )
