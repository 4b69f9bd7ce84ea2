"""The OpenAI wire format of `specdec serve`: request parsing (every error a `RequestError` with its HTTP
status and the offending field) and the response, chunk and error bodies."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specdec.chat import check_messages, check_text, has_media
from specdec.grammar import GrammarSpec
from specdec.processors import LogitsParams
from specdec.records import TokenLogprob
from specdec.sampling import SamplingParams
from specdec.stream import StreamResult
from specdec.tools import ToolChoice, check_tools

__all__ = [
    "Params", "RequestError", "chunk", "error_body", "finish_reason", "logprobs_body", "parse_request",
    "response_body", "usage",
]  # fmt: skip


def logprobs_body(
    chat: bool, entries: Sequence[TokenLogprob], spell: Callable[[int], bytes], offset: int = 0
) -> dict:
    """OpenAI's `logprobs` of some tokens: chat {"content": [{token, logprob, bytes, top_logprobs}]},
    completions {tokens, token_logprobs, top_logprobs, text_offset} (`offset`: the text before them).
    `spell`: a token id's bytes."""

    def text(t: int) -> str:
        return spell(t).decode("utf-8", errors="replace")

    if chat:
        return {
            "content": [
                {
                    "token": text(e.token),
                    "logprob": e.logprob,
                    "bytes": list(spell(e.token)),
                    "top_logprobs": [
                        {"token": text(t), "logprob": p, "bytes": list(spell(t))} for t, p in e.top
                    ],
                }
                for e in entries
            ]
        }
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(text(e.token))
    return {
        "tokens": [text(e.token) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text(t): p for t, p in e.top} for e in entries],
        "text_offset": offsets,
    }


class RequestError(ValueError):
    """What a client sent wrong: its HTTP status and, where one field is at fault, that field."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}."""
    if status in (404, 503):
        kind = {404: "not_found_error", 503: "server_busy"}[status]
    else:  # a 4xx is the client's request (405, 413, ...); a 5xx is ours
        kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(r: StreamResult) -> dict[str, int]:
    n = len(r.output_tokens)
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": n, "total_tokens": r.prompt_tokens + n}


def finish_reason(r: StreamResult) -> str:
    return "length" if r.finish_reason in ("length", "context") else r.finish_reason


def chunk(
    job_id: str,
    chat: bool,
    created: int,
    model: str,
    delta: str | None,
    finish: str | None,
    logprobs: dict | None = None,
) -> dict:
    """One streamed chunk (`chat.completion.chunk` or `text_completion`)."""
    if chat:
        d = {} if delta is None else {"content": delta}
        choice = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": job_id, "object": obj, "created": created, "model": model, "choices": [choice]}


def response_body(
    chat: bool, model: str, text: str, r: StreamResult, stats: dict, logprobs: dict | None = None
) -> dict:
    """A whole (non-streamed) response, with `usage` and our per-request stats under "specdec"."""
    if chat:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(r)}
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(r)}
        obj, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + uuid.uuid4().hex,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(r),
        "specdec": stats,
    }


@dataclass
class Params:
    prompt: Any  # chat messages (list of {role, content}) or text or token ids
    chat: bool
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    logits: LogitsParams | None = None  # bias, penalties and grammar; None: none asked for
    grammar_field: str = "response_format"  # the field that asked for the grammar (errors name it)
    logprobs: int | None = None  # report each token's log-probability and this many top ones; None: off
    tools: list[dict] | None = None  # OpenAI's, given to the model (None: none, or tool_choice "none")
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # to the chat template (enable_thinking)
    reasoning_opened: bool = False  # the prompt already opened a thinking model's reasoning
    thinking_budget: int | None = None  # reasoning tokens at most (the worker makes it a processor)


def _number(
    body: dict,
    name: str,
    default: float,
    *,
    lo: float,
    hi: float,
    integer: bool = False,
    open_lo: bool = False,
    open_hi: bool = False,
) -> Any:
    """`body[name]` checked to lie in [lo, hi] (`open_lo` / `open_hi`: the bound excluded), else
    `default`; a RequestError naming the field otherwise."""
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if not ok or isinstance(v, bool):
        kind = "an integer" if integer else "a number"
        raise RequestError(f"'{name}' must be {kind}, got {json.dumps(v)}", param=name)
    if not (lo < v if open_lo else lo <= v) or not (v < hi if open_hi else v <= hi):
        span = f"{'(' if open_lo else '['}{lo}, {hi}{')' if open_hi else ']'}"
        raise RequestError(f"'{name}' must be in {span}, got {v}", param=name)
    return v


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in c):
        return "".join(str(p.get("text", "")) for p in c)
    if has_media(c):
        raise RequestError(
            f"messages[{i}].content has an image / audio / video part: this server takes text prompts only",
            param=f"messages[{i}].content",
        )
    raise RequestError(
        f"messages[{i}].content must be a string or a list of text parts, got {json.dumps(c)[:80]}",
        param=f"messages[{i}].content",
    )


def _checked(text: str, where: str, param: str) -> str:
    try:
        return check_text(text, where)
    except ValueError as e:
        raise RequestError(str(e), param=param) from None


#: OpenAI request fields this server does not honour, with the values that ask for nothing (accepted, as
#: clients send them by default); any other value is refused rather than silently ignored
UNHONOURED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""),
}  # fmt: skip


#: fields only a chat request can honour
CHAT_ONLY = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "reasoning_effort",
    "thinking_budget",
)


def _unhonoured(body: dict) -> None:
    """A RequestError for the first field of `UNHONOURED` that asks for something."""
    for name, nothing in UNHONOURED.items():
        v = body.get(name)
        if v not in nothing:  # by value: 0 and 0.0, 1 and 1.0 alike
            raise RequestError(
                f"'{name}' is not supported by this server (plain text from the verifier's own "
                f"distribution), got {json.dumps(v)[:60]}: leave it out",
                param=name,
            )


def parse_request(body: Any, *, chat: bool, model: str, defaults: SamplingParams) -> Params:
    """Validate an OpenAI request body; RequestError (4xx) with the offending field otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    name = body.get("model")
    if name is not None and name != model:
        raise RequestError(
            f"model {name!r} does not exist; this server serves {model!r} (GET /v1/models)",
            status=404,
            param="model",
            code="model_not_found",
        )
    prompt = _messages(body) if chat else _prompt(body)
    _unhonoured(body)
    n = _number(body, "n", 1, lo=1, hi=1, integer=True)
    assert n == 1
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        raise RequestError(f"'max_tokens' must be an integer >= 1, got {json.dumps(mt)}", param="max_tokens")
    stop = _stop(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {json.dumps(stream)}", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    sampling = _sampling(body, defaults)
    include_usage = bool(opts.get("include_usage"))
    asked = "structured_outputs" if body.get("structured_outputs") is not None else "response_format"
    p = Params(
        prompt, chat, mt, sampling, stop, stream, include_usage, _logits(body), asked, _logprobs(body, chat)
    )
    if not chat:
        for name in CHAT_ONLY:  # a text completion has no chat template to take them: refused, not ignored
            if body.get(name) is not None:
                raise RequestError(
                    f"'{name}' goes with chat messages (/v1/chat/completions), not a text completion",
                    param=name,
                )
        return p
    budget = _number(body, "thinking_budget", None, lo=0, hi=2**31, integer=True)
    return replace(_tools(body, p), template_kwargs=_template_kwargs(body), thinking_budget=budget)


#: what a request may not set through `chat_template_kwargs` (the server sets them)
_RESERVED = {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "conversation"}


def _template_kwargs(body: dict) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs` ({"enable_thinking": false}, ...) and OpenAI's `reasoning_effort`
    (gpt-oss templates read it), for the chat template."""
    kw = body.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if _RESERVED & kw.keys():
        bad = sorted(_RESERVED & kw.keys())[0]
        raise RequestError(f"'chat_template_kwargs' may not set {bad!r}", param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("minimal", "low", "medium", "high"):
            raise RequestError(
                f"'reasoning_effort' must be minimal, low, medium or high, got {json.dumps(effort)[:30]}",
                param="reasoning_effort",
            )
        kw = {**kw, "reasoning_effort": effort}
    return dict(kw)


def _tools(body: dict, p: Params) -> Params:
    """`tools`, `tool_choice`, `parallel_tool_calls` (the grammar of forced calls is the worker's: it knows
    the model's call syntax)."""
    try:
        choice = ToolChoice.parse(body.get("tool_choice"))
    except ValueError as e:
        raise RequestError(str(e), param="tool_choice") from None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    if body.get("tools") in (None, []):
        if choice.mode in ("required", "named"):
            raise RequestError(f"tool_choice {choice.mode!r} needs 'tools'", param="tool_choice")
        return p
    try:
        tools = check_tools(body["tools"])
    except ValueError as e:
        raise RequestError(str(e), param="tools") from None
    if choice.mode == "none":
        return replace(p, tool_choice=choice)
    if choice.name is not None and choice.name not in {t["function"]["name"] for t in tools}:
        raise RequestError(f"tool_choice names {choice.name!r}, which is not in 'tools'", param="tool_choice")
    if p.logits is not None and p.logits.grammar is not None:
        raise RequestError(f"give 'tools' or '{p.grammar_field}', not both", param=p.grammar_field)
    return replace(p, tools=tools, tool_choice=choice, parallel_tool_calls=parallel)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: `logprobs` true and `top_logprobs` 0..20; completions: `logprobs` 0..5 (the top count)."""
    if not chat:
        return _number(body, "logprobs", None, lo=0, hi=5, integer=True)
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise RequestError(f"'logprobs' must be true or false, got {json.dumps(on)[:40]}", param="logprobs")
    top = _number(body, "top_logprobs", None, lo=0, hi=20, integer=True)
    if top is not None and not on:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if on else None


def _messages(body: dict) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty list of {role, content}", param="messages")
    prompt = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        if m["role"] == "assistant" and m.get("tool_calls"):  # content may be null beside calls
            prompt.append({**m, "content": "" if m.get("content") is None else _content(m, i)})
        else:
            extra = {"tool_call_id": m["tool_call_id"]} if m["role"] == "tool" and "tool_call_id" in m else {}
            prompt.append({"role": m["role"], "content": _content(m, i), **extra})
    try:
        return check_messages(prompt)
    except ValueError as e:
        raise RequestError(str(e), param="messages") from None


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise RequestError(
            "'prompt' must be a non-empty string or list of token ids (one prompt per request)",
            param="prompt",
        )
    if isinstance(prompt, str):
        _checked(prompt, "'prompt'", "prompt")
    return prompt


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError(
            f"'stop' must be a string or a list of strings, got {json.dumps(stop)}", param="stop"
        )
    for s in stop:
        _checked(s, "'stop'", "stop")
    return [s for s in stop if s]


def _sampling(body: dict, defaults: SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", defaults.temperature, lo=0, hi=2),
            top_p=_number(body, "top_p", defaults.top_p, lo=0, hi=1, open_lo=True),
            top_k=max(0, _number(body, "top_k", defaults.top_k, lo=-1, hi=2**31, integer=True)),  # -1: off
            min_p=_number(body, "min_p", defaults.min_p, lo=0, hi=1, open_hi=True),
            seed=_number(body, "seed", defaults.seed, lo=0, hi=2**63 - 1, integer=True),
            rule=defaults.rule,
            proposal=defaults.proposal,
        )
    except RequestError:
        raise
    except ValueError as e:  # SamplingParams' own checks name their field first
        field = str(e).split(" ", 1)[0]
        raise RequestError(str(e), param=field if field in body else None) from e


def _logits(body: dict) -> LogitsParams | None:
    """`logit_bias` ({"token id": bias}), `presence_penalty`, `frequency_penalty` (OpenAI's, over the
    output), `repetition_penalty` (vLLM's and mlx_lm's), `penalty_context` (the last N tokens, as
    mlx_lm's context sizes) and the grammar (`GrammarSpec.from_request`); None where none changes a logit."""
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise RequestError(
            f"'logit_bias' must be an object {{token id: bias}}, got {json.dumps(bias)[:60]}",
            param="logit_bias",
        )
    kw = {
        "logit_bias": bias or {},
        "presence_penalty": _number(body, "presence_penalty", 0.0, lo=-2, hi=2),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, lo=-2, hi=2),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, lo=0, hi=100, open_lo=True),
        "penalty_context": _number(body, "penalty_context", None, lo=1, hi=2**31, integer=True),
    }
    try:
        p = LogitsParams(**kw)
    except ValueError as e:  # the bias map's own checks
        raise RequestError(str(e), param="logit_bias") from None
    try:
        grammar = GrammarSpec.from_request(body)
    except ValueError as e:
        param = "structured_outputs" if "structured_outputs" in str(e) else "response_format"
        raise RequestError(str(e), param=param) from None
    p = replace(p, grammar=grammar)
    return p if p.active else None
