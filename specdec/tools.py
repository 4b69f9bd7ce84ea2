"""Tool calls: tools go to the model through its chat template (`tools=`), its own call syntax comes back
parsed into OpenAI `tool_calls`, and `tool_choice` "required" or a named function is guaranteed a valid call
by a grammar (the call syntax around each function's parameter schema, `specdec.grammar`), so speculation
stays exact under it.

Call syntaxes (`SYNTAXES`; detected from the chat template, or named with `--tool-call-parser`):
- `hermes` (Hermes, Qwen 2.5 / 3 / 3.5 / 3.6): per call
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `llama3_json` (Llama 3.1-3.3): the message is `{"name": ..., "parameters": {...}}` (after `<|python_tag|>`
  where the model writes one), several joined by "; ";
- `mistral`: `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}, or (newer tokenizers) `name[ARGS]{...}`
  per call;
- `harmony` (gpt-oss): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`,
  one call per reply (`<|call|>` ends the turn);
- `gemma4` (Gemma 4): `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>` per call, arguments in
  Gemma's own value syntax (`specdec.gemma_calls`).
A reply whose call does not parse comes back as text (finish "stop"), never as an error.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.chat import held_back
from specdec.gemma_calls import QUOTE, parse_call_args, value_lark
from specdec.grammar import JSON_OPTIONS, GrammarSpec

__all__ = [
    "SYNTAXES",
    "ToolCall",
    "ToolChoice",
    "ToolStream",
    "check_tools",
    "detect_syntax",
    "special_ids",
    "tool_grammar",
]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict:
        call = {
            "id": self.id or "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's `tool_choice`: "none", "auto", "required" or one function by `name`."""

    mode: str = "auto"
    name: str | None = None

    @classmethod
    def parse(cls, value: Any) -> ToolChoice:
        if value is None:
            return cls()
        if value in ("none", "auto", "required"):
            return cls(value)
        fn = value.get("function") if isinstance(value, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str) and value.get("type") == "function":
            return cls("named", fn["name"])
        raise ValueError(
            '\'tool_choice\' must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )


def check_tools(tools: Any) -> list[dict]:
    """OpenAI `tools` ([{"type": "function", "function": {"name", "description", "parameters"}}]) checked;
    ValueError naming the first bad one."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("'tools' must be a non-empty list of {'type': 'function', 'function': {...}}")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 of a-z A-Z 0-9 _ . -, got {name!r:.40}")
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return [dict(t) for t in tools]


def _compact(tool: Mapping) -> dict:
    """A function's parameter schema for llguidance's `%json`, its JSON as compact as `specdec.grammar`'s."""
    return {**_parameters(tool), "x-guidance": JSON_OPTIONS}


def _parameters(tool: Mapping) -> dict:
    return dict(tool["function"].get("parameters") or {"type": "object", "properties": {}})


def _json_calls(items: Any, key: str) -> list[ToolCall] | None:
    """[{"name", key: {...}}] -> calls; None where any item is not one."""
    items = items if isinstance(items, list) else [items]
    calls = []
    for it in items:
        if not isinstance(it, Mapping) or not isinstance(it.get("name"), str):
            return None
        args = it.get(key, it.get("arguments", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, Mapping):
            return None
        calls.append(ToolCall(it["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _each(parts: Sequence[Any], key: str) -> list[ToolCall] | None:
    """Every part one call ({"name", key: {...}}); None where one is not."""
    calls = [_json_calls(p, key) for p in parts]
    return None if not calls or None in calls else [c for cs in calls for c in cs]  # type: ignore[union-attr]


def _named(found: Sequence[tuple[str, str]]) -> list[ToolCall] | None:
    """(name, arguments JSON text) pairs -> calls; None where one does not parse."""
    return _each([{"name": n, "arguments": _loads(a.strip())} for n, a in found], "arguments")


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]] | None:
    head, _, rest = text.partition("<tool_call>")
    bodies = re.findall(r"\s*(.*?)\s*</tool_call>\s*(?:<tool_call>|$)", rest, re.S)
    if not bodies or not rest.rstrip().endswith("</tool_call>"):
        return None
    calls = _each([_loads(b) for b in bodies], "arguments")
    return None if calls is None else (head, calls)


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]] | None:
    head, tag, rest = text.partition("<|python_tag|>")
    body, head = (rest, head) if tag else (text, "")
    calls = _each([_loads(p) for p in re.split(r"\s*;\s*(?=\{)", body.strip()) if p], "parameters")
    return None if calls is None else (head, calls)


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]] | None:
    head, _, rest = text.partition("[TOOL_CALLS]")
    rest = rest.strip()
    if rest.startswith("["):  # a JSON list of calls
        items = _loads(rest)
        calls = _each(items if isinstance(items, list) else [None], "arguments")
    else:  # newer tokenizers: name[ARGS]{...} per call
        calls = _named(re.findall(r"([A-Za-z0-9_.\-]+)\[ARGS\](.*?)(?=\[TOOL_CALLS\]|$)", rest, re.S))
    return None if calls is None else (head, calls)


_HARMONY_CALL = (
    r"to=functions\.([A-Za-z0-9_.\-]+)[^<]*(?:<\|constrain\|>\w+)?<\|message\|>(.*?)(?:<\|call\|>|$)"
)


def _parse_harmony(text: str) -> tuple[str, list[ToolCall]] | None:
    calls = _named(re.findall(_HARMONY_CALL, text, re.S))
    if calls is None:
        return None
    return "", calls  # the text around calls comes by channel (`specdec.reasoning.HarmonyStream`)


MAX_CALLS = 8  # calls in one forced reply (a model that would go on calling is stopped there)


def _lit(text: str, special: Mapping[str, int]) -> str:
    """`text` as Lark: the special tokens in `special` by id (`<[id]>`, as the model writes them), the rest
    as string literals."""
    if not text:
        return ""
    marks = sorted(special, key=len, reverse=True)
    parts = re.split("(" + "|".join(map(re.escape, marks)) + ")", text) if marks else [text]
    return " ".join(f"<[{special[p]}]>" if p in special else json.dumps(p) for p in parts if p)


@dataclass(frozen=True)
class CallForm:
    """How a family writes calls, for the grammar of a reply that is only calls: `before` them, each call as
    `head` (its `{name}` filled in) + the arguments (JSON) + `tail`, `sep` between calls, `after` them;
    `single`: the family's call ends the turn (one call per reply)."""

    head: str
    tail: str
    sep: str
    before: str = ""
    after: str = ""
    single: bool = False

    def lark(self, tools: Sequence[Mapping], many: bool, special: Mapping[str, int], lead: str = "") -> str:
        """The Lark grammar; `lead`: rules whose `lead` expression may come before the calls (a thinking
        model's reasoning)."""
        rules = {}
        alts = []
        for i, t in enumerate(tools):
            head, tail = (
                _lit(x.replace("{name}", t["function"]["name"]), special) for x in (self.head, self.tail)
            )
            alts.append(f"{head} {self.args(t, f'f{i}', special, rules)} {tail}")
        calls = (
            f"call ({_lit(self.sep, special)} call){{0,{MAX_CALLS - 1}}}"
            if many and not self.single
            else "call"
        )
        ends = [_lit(x, special) for x in (self.before, self.after)]
        body = "".join(f"{n}: {b}\n" for n, b in rules.items())
        first = "lead " if lead else ""
        return f"start: {first}{ends[0]} {calls} {ends[1]}\ncall: {' | '.join(alts)}\n{body}{lead}"

    def args(self, tool: Mapping, prefix: str, special: Mapping[str, int], rules: dict[str, str]) -> str:
        """The grammar of one function's arguments (rules it needs added to `rules`)."""
        return f"%json {json.dumps(_compact(tool))}"


@dataclass(frozen=True)
class GemmaForm(CallForm):
    """Gemma 4's calls: the arguments in its own value syntax (`specdec.gemma_calls`), not JSON."""

    def args(self, tool: Mapping, prefix: str, special: Mapping[str, int], rules: dict[str, str]) -> str:
        try:
            top, more = value_lark(_parameters(tool), quote=_lit(QUOTE, special), prefix=prefix)
        except ValueError as e:
            name = tool["function"]["name"]
            raise ValueError(
                f"forced gemma4 calls of {name!r} cannot keep {e}; use tool_choice 'auto'"
            ) from None
        rules.update(more)
        return top


def _parse_gemma4(text: str) -> tuple[str, list[ToolCall]] | None:
    head, _, rest = text.partition("<|tool_call>")
    found = re.findall(r"call:([A-Za-z0-9_.\-]+)(\{.*?\})<tool_call\|>\s*(?:<\|tool_call>|$)", rest, re.S)
    if not found or not rest.rstrip().endswith("<tool_call|>"):
        return None
    args = [parse_call_args(a) for _, a in found]
    if None in args:
        return None
    return head, [ToolCall(n, json.dumps(a, ensure_ascii=False)) for (n, _), a in zip(found, args)]


@dataclass(frozen=True)
class Syntax:
    """A family's call syntax: what in its chat template shows it, the text that opens a call, its parser
    (text -> (content before the calls, calls), None where it does not parse) and the grammar of calls."""

    name: str
    marker: str  # in the template
    start: str  # opens a call in the output ("" : the whole message is the call)
    parse: Callable[[str], tuple[str, list[ToolCall]] | None]
    form: CallForm
    special: bool = False  # written in special tokens: parsed from the text that keeps them


_ARGS = '{{"name": "{name}", "{key}": '
SYNTAXES = {
    s.name: s
    for s in [
        Syntax(
            "hermes",
            "<tool_call>",
            "<tool_call>",
            _parse_hermes,
            CallForm("<tool_call>\n" + _ARGS.format(name="{name}", key="arguments"), "}\n</tool_call>", "\n"),
        ),
        Syntax(
            "mistral",
            "[TOOL_CALLS]",
            "[TOOL_CALLS]",
            _parse_mistral,
            CallForm(_ARGS.format(name="{name}", key="arguments"), "}", ", ", "[TOOL_CALLS][", "]"),
        ),
        Syntax(
            "harmony",
            "to=functions",
            "to=functions.",
            _parse_harmony,
            CallForm(
                "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
                "<|call|>",
                "",
                single=True,
            ),
            special=True,
        ),
        Syntax(
            "gemma4",
            "<|tool_call>",
            "<|tool_call>",
            _parse_gemma4,
            GemmaForm("<|tool_call>call:{name}", "<tool_call|>", ""),
            special=True,
        ),
        Syntax(
            "llama3_json",
            "<|python_tag|>",
            "",
            _parse_llama3,
            CallForm(_ARGS.format(name="{name}", key="parameters"), "}", "; "),
        ),
    ]
}


def detect_syntax(template: str | None) -> Syntax | None:
    """The call syntax a chat template shows (None: none we know, or no template)."""
    for s in SYNTAXES.values():
        if template and s.marker in template:
            return s
    return None


#: the special tokens reasoning and call syntaxes are written in (a tokenizer that has one as a token gets
#: it so)
SPECIAL = (
    "<think>",
    "</think>",
    "<|channel>",
    "<channel|>",
    "<|start|>",
    "<|end|>",
    "<|channel|>",
    "<|constrain|>",
    "<|message|>",
    "<|call|>",
    "<|tool_call>",
    "<tool_call|>",
    QUOTE,
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
)


def special_ids(tokenizer: Any) -> dict[str, int]:
    """Which of `SPECIAL` are single tokens of `tokenizer` (an HF or mlx_lm tokenizer), by id."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return {s: vocab[s] for s in SPECIAL if s in vocab}


def tool_grammar(
    syntax: Syntax,
    tools: Sequence[Mapping],
    choice: ToolChoice,
    parallel: bool,
    *,
    special: Mapping[str, int] | None = None,
    reasoning: Any = None,
    opened: bool = False,
) -> GrammarSpec:
    """The grammar of a reply that is nothing but valid calls (of `choice.name` alone where named): each
    call's arguments validate against its function's parameter schema. `special`: the syntax's special
    tokens by id (`special_ids`), so the model writes them as the tokens it was trained on. `reasoning`: a
    thinking model's syntax (`specdec.reasoning.ReasoningSyntax`), whose reasoning may come first (must
    close first where the prompt `opened` it)."""
    pick = [t for t in tools if choice.name in (None, t["function"]["name"])]
    if not pick:
        raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
    lead = _lead(reasoning, opened, special or {}) if reasoning is not None else ""
    return GrammarSpec("lark", syntax.form.lark(pick, parallel and choice.name is None, special or {}, lead))


def _lead(reasoning: Any, opened: bool, special: Mapping[str, int]) -> str:
    """The rules of the reasoning a thinking model may write before forced calls: its text up to the end
    tag (one lazy lexeme where the tag is text: it ends at the tag's first occurrence), then what the
    syntax writes before the next message."""
    end = _lit(reasoning.end, special)
    if end.startswith("<["):  # a special token: the text's lexeme ends where it comes
        think = f"think: /(.|\\n)*/ {end}\n"
    else:
        tag = re.escape(reasoning.end).replace("/", "\\/")
        think = f"think[lazy]: /(.|\\n)*{tag}/\n"
    resume = _lit(reasoning.resume, special) or '"\\n"*'
    body = f"think {resume}" if opened else f"({_lit(reasoning.start, special)} think {resume})?"
    return f"lead: {body}\n{think}"


class ToolStream:
    """Text as it streams, with a call syntax watched for: `push` gives the text that is surely content (a
    call's opening, or the start of one, is held back); `finish` parses what was held: (content, calls)."""

    def __init__(self, syntax: Syntax) -> None:
        self.syntax, self.text, self.sent = syntax, "", 0

    def push(self, delta: str) -> str:
        self.text += delta
        start = self.syntax.start
        if not start:  # the whole message is the call: content only once the message shows it is none
            if self.text.lstrip()[:1] in ("{", "<") or not self.text.strip():
                return ""
            cut = len(self.text)
        else:
            at = self.text.find(start)
            cut = at if at >= 0 else len(self.text) - held_back(self.text, [start])
        out, self.sent = self.text[self.sent : max(cut, self.sent)], max(cut, self.sent)
        return out

    def finish(self, raw: str | None = None) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls) of the reply; `raw`: its text with special tokens kept, where a
        call syntax is made of them. No calls where the reply holds none that parse."""
        parsed = self.syntax.parse(self.text if raw is None else raw)
        if parsed is None or not parsed[1]:
            return self.text[self.sent :], []
        head, calls = parsed
        head = self.text[: self.text.find(self.syntax.start)] if self.syntax.start in self.text else head
        return (head[self.sent :].rstrip() if len(head) > self.sent else ""), calls
