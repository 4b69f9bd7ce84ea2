"""Gemma 4's call syntax, which is not JSON: `<|tool_call>call:NAME{key:value,...}<tool_call|>` per call,
calls written one after another. A value is a string between `<|"|>` marks (one special token each in
Gemma 4's tokenizer), a number, `true` / `false` / `null`, `{key:value,...}` with bare keys, or `[value,...]`.

`parse_call_args` reads the arguments into JSON; `value_lark` writes the Lark grammar of the values a JSON
schema allows, so a forced call is valid in Gemma's own syntax. Schema keywords the grammar cannot keep
(`pattern`, number bounds, ...) are refused by name rather than ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["QUOTE", "parse_call_args", "value_lark"]

QUOTE = '<|"|>'
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def parse_call_args(text: str) -> dict | None:
    """`{key:value,...}` in Gemma's value syntax -> a dict (None where it does not parse whole)."""
    try:
        value, end = _value(text, 0)
    except (ValueError, IndexError):
        return None
    return value if isinstance(value, dict) and not text[end:].strip() else None


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \n\t":
        i += 1
    return i


def _value(s: str, i: int) -> tuple[Any, int]:
    i = _skip(s, i)
    if s.startswith(QUOTE, i):
        end = s.index(QUOTE, i + len(QUOTE))
        return s[i + len(QUOTE) : end], end + len(QUOTE)
    if s[i] in "{[":
        close, out = ("}", {}) if s[i] == "{" else ("]", [])
        i = _skip(s, i + 1)
        while s[i] != close:
            if isinstance(out, dict):
                key = _KEY.match(s, i)
                if key is None or s[key.end()] != ":":
                    raise ValueError("a key")
                out[key.group()], i = _value(s, key.end() + 1)
            else:
                item, i = _value(s, i)
                out.append(item)
            i = _skip(s, i)
            if s[i] == ",":
                i = _skip(s, i + 1)
            elif s[i] != close:
                raise ValueError("a separator")
        return out, i + 1
    m = _SCALAR.match(s, i)
    if m is None:
        raise ValueError("a value")
    return json.loads(m.group()), m.end()


# ---- the grammar of the values a schema allows ---------------------------------------------------------

#: the keywords `value_lark` keeps; any other that constrains a value is refused
_KEPT = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "const",
    "anyOf",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "description",
    "title",
    "default",
    "examples",
    "$schema",
}
# digits bounded, so a model stuck on one cannot write a number forever
_NUMBER = r"/-?(0|[1-9][0-9]{0,19})(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,3})?/"
_INTEGER = r"/-?(0|[1-9][0-9]{0,19})/"
# a string's text: anything in which the closing mark does not occur (a regular language: read a run of
# '<' as the state "the mark may be starting" and leave it on any byte that breaks the mark)
_LOOP = r'(\|("\|?)?)?<'  # back to a fresh '<'
_BREAK = r'([^<|]|\|[^<"]|\|"[^<|]|\|"\|[^<>])'  # a byte that ends the run without the mark
_TEXT = rf"([^<]|<({_LOOP})*{_BREAK})*(<({_LOOP})*(\|(\"\|?)?)?)?"


class _Lark:
    """Rules for one function's arguments, named `{prefix}_...`: `rule(schema, where)` names the rule of
    the values `schema` allows (`where`: its path, for errors); `q`: the string mark as the grammar writes
    it."""

    def __init__(self, q: str, prefix: str) -> None:
        self.q, self.prefix, self.rules = q, prefix, {}
        self.special = q.startswith("<[")  # the mark is a special token, not text

    def rule(self, schema: Any, where: str) -> str:
        name = f"{self.prefix}_{len(self.rules)}"
        self.rules[name] = ""  # reserved before the body, which may add rules of its own
        self.rules[name] = self._body(schema, where)
        return name

    def _string(self, text: str) -> str:
        """A string whose text matches the regex `text`. With the mark as text, one lexeme from mark to
        mark (Lark's lexer cannot look past a lexeme's end for a closing mark of five bytes)."""
        if self.special:  # the text's lexeme ends where the mark's token comes
            return f"{self.q} /{text}/ {self.q}"
        mark = re.escape(QUOTE)
        return f"/{mark}{text}{mark}/"

    def _literal(self, v: Any) -> str:
        if isinstance(v, str):
            return f"{self.q} {json.dumps(v)} {self.q}" if self.special else json.dumps(QUOTE + v + QUOTE)
        if isinstance(v, (Mapping, list)):
            raise ValueError("an object or array in 'enum' / 'const'")
        return json.dumps(json.dumps(v))  # the number's (or true / false / null's) text, as a Lark string

    def _body(self, s: Any, where: str) -> str:
        if s is True or s == {}:
            return self._any()
        if not isinstance(s, Mapping):
            raise ValueError(f"the schema at {where} is not an object")
        bad = sorted(k for k in s if k not in _KEPT)
        if bad:
            raise ValueError(f"the schema keyword {bad[0]!r} at {where}")
        if "const" in s or "enum" in s:
            return " | ".join(self._literal(v) for v in ([s["const"]] if "const" in s else s["enum"]))
        if "anyOf" in s:
            return " | ".join(self.rule(a, f"{where}.anyOf[{i}]") for i, a in enumerate(s["anyOf"]))
        t = s.get("type")
        if isinstance(t, list):
            return " | ".join(self.rule({**s, "type": x}, where) for x in t)
        if t == "object" or "properties" in s:
            return self._object(s, where)
        if t == "array":
            return self._array(s, where)
        if t == "string":
            lo, hi = s.get("minLength", 0), s.get("maxLength")
            return self._string(
                _TEXT if (lo, hi) == (0, None) else f"[^<]{{{lo},{'' if hi is None else hi}}}"
            )
        simple = {"number": _NUMBER, "integer": _INTEGER, "boolean": '"true" | "false"', "null": '"null"'}
        if t in simple:
            return simple[t]
        if t is None:
            return self._any()
        raise ValueError(f"the type {t!r} at {where}")

    def _object(self, s: Mapping, where: str) -> str:
        props, required = s.get("properties", {}), set(s.get("required", []))
        if not props and s.get("additionalProperties", False) not in (False, {}):
            return self._any_object()
        keys = list(props)
        items = [f"{json.dumps(k + ':')} {self.rule(props[k], f'{where}.{k}')}" for k in keys]

        def seq(i: int, first: bool) -> str:  # properties i.. in order, the optional ones skippable
            if i == len(keys):
                return ""
            item = items[i] if first else f'"," {items[i]}'
            take = f"{item} {seq(i + 1, False)}".strip()
            if keys[i] in required:
                return f"({take})"
            skip = seq(i + 1, first)
            return f"({take} | {skip})" if skip else f"({take})?"

        return f'"{{" {seq(0, True)} "}}"'

    def _array(self, s: Mapping, where: str) -> str:
        item = self.rule(s.get("items", {}), f"{where}[]")
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if hi == 0:
            return '"[" "]"'
        more = f'("," {item}){{{max(lo - 1, 0)},{"" if hi is None else hi - 1}}}'
        return f'"[" {item} {more} "]"' if lo else f'"[" ({item} {more})? "]"'

    def _any(self) -> str:
        name = f"{self.prefix}_any"
        if name not in self.rules:
            self.rules[name] = ""  # reserved: the body refers to it
            strings = self._string(_TEXT)
            arr = f'"[" ({name} ("," {name})*)? "]"'
            self.rules[name] = " | ".join(
                [strings, _NUMBER, '"true" | "false" | "null"', self._any_object(), arr]
            )
        return name

    def _any_object(self) -> str:
        key, any_ = f"/{_KEY.pattern}/", self._any()
        return f'"{{" ({key} ":" {any_} ("," {key} ":" {any_})*)? "}}"'


def value_lark(schema: Any, *, quote: str, prefix: str) -> tuple[str, dict[str, str]]:
    """(the rule of `schema`'s values, all rules) in Gemma's value syntax, rules named `{prefix}_...`;
    `quote`: the string mark as the grammar writes it (a special token's `<[id]>`, or the text's literal).
    ValueError naming the first keyword the grammar cannot keep."""
    g = _Lark(quote, prefix)
    return g.rule(schema, "parameters"), g.rules
