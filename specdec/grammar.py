"""Structured output inside verification, exactly: a grammar's token mask at every verify row.

A grammar (a JSON schema, any JSON object, a regex, a Lark grammar, or a choice of strings) is compiled by
llguidance (Microsoft's Rust engine, also behind llama.cpp's and vLLM's structured output). We chose it over
xgrammar for what speculation needs: its matcher consumes tokens and rolls them back cheaply (a rejected draft
costs nothing to undo), it computes the masks of a whole chain of drafts in one call, it validates a draft's
prefix (`validate_tokens`) and tells which tokens the grammar forces next (`compute_ff_tokens`); it needs
no torch and ships wheels for Linux and macOS; a mask takes tens of microseconds.

In a verify of `[last, *draft]` row i is masked with the grammar's state after the committed tokens plus
`draft[:i]` (a tree node: plus its path), so the verifier's token there is exactly the one autoregressive
decoding under the same grammar picks. Before the verify a chain draft is cut at the first token the grammar
forbids (its row would be rejected anyway), and the tokens the grammar forces next are put in front of it:
drafted for free, and verified like any draft (a forced text may be spelled by shorter tokens the model
prefers, so they are likely, not certain). JSON comes out with fixed separators (", " and ": ") and no
other whitespace, so a small model cannot loop on blank space.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GRAMMAR_KINDS", "JSON_OPTIONS", "Constraint", "GrammarSpec", "grammar_tokenizer"]

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark", "choice")
#: separators fixed, no free whitespace (json.dumps' defaults: what models read most)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.torch  # (llguidance.hf imports transformers: only for an HF tokenizer, below)
    except ImportError as e:
        raise ValueError(
            "structured output needs llguidance: pip install 'specdec[grammar]' (or llguidance)"
        ) from e
    return llguidance


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: `kind` one of GRAMMAR_KINDS and its `source` (a JSON schema as JSON text,
    a regex, a Lark grammar, the choices as a JSON list; "" for json_object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r:.40}")
        if not isinstance(self.source, str):
            raise ValueError(f"a grammar's source is text, got {type(self.source).__name__}")
        if self.kind in ("regex", "lark") and not self.source:
            raise ValueError(f"a {self.kind} grammar needs its text")

    @classmethod
    def json_schema(cls, schema: dict | str) -> GrammarSpec:
        """Output that validates against `schema` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # key order kept: properties come out in it

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        """Output that is exactly one of `options`."""
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice needs a list of non-empty strings")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def from_request(cls, body: dict) -> GrammarSpec | None:
        """The grammar an OpenAI-style request asks for (None: plain text): `response_format` {"type":
        "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}, or vLLM's
        `structured_outputs` {"json" | "regex" | "grammar" (Lark) | "choice": ...}. ValueError naming the
        field otherwise."""
        rf, so = body.get("response_format"), body.get("structured_outputs")
        asked = [] if rf is None or rf == {"type": "text"} else ["response_format"]
        asked += [] if so is None else ["structured_outputs"]
        if len(asked) > 1:
            raise ValueError("give one of 'response_format' and 'structured_outputs', not both")
        if not asked:
            return None
        if rf is not None:
            kind = rf.get("type") if isinstance(rf, dict) else None
            if kind == "json_object":
                return cls("json_object")
            if kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError("'response_format.json_schema.schema' must be a JSON schema object")
                return cls.json_schema(schema)
            raise ValueError(
                '\'response_format\' must be {"type": "text" | "json_object" | "json_schema"}, got '
                f"{json.dumps(rf)[:60]}"
            )
        keys = [k for k in ("json", "regex", "grammar", "choice") if k in so] if isinstance(so, dict) else []
        if len(keys) != 1 or len(so) != 1:
            raise ValueError(
                "'structured_outputs' must hold exactly one of json, regex, grammar (Lark), choice; got "
                f"{json.dumps(so)[:60]}"
            )
        value = so[keys[0]]
        if keys[0] == "json":
            return cls.json_schema(value)
        if keys[0] == "choice":
            return cls.choice(value)
        if not isinstance(value, str):
            raise ValueError(f"'structured_outputs.{keys[0]}' must be text")
        return cls("regex" if keys[0] == "regex" else "lark", value)

    def check(self) -> None:
        """ValueError for a grammar that does not compile whatever the tokenizer (before a model loads)."""
        error = _llguidance().LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ValueError(f"the {self.kind} grammar does not compile: {' '.join(error.split())[:300]}")

    def grammar(self) -> str:
        """The llguidance grammar."""
        M = _llguidance().LLMatcher
        if self.kind == "json_schema":
            return M.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return M.grammar_from_regex(self.source)
        if self.kind == "lark":
            return M.grammar_from_lark(self.source)
        return M.grammar_from_lark(_choice_lark(json.loads(self.source)))


def _choice_lark(options: list[str]) -> str:
    return "start: " + " | ".join(json.dumps(o) for o in options)


_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer: Any, vocab_size: int, stops: Sequence[int]) -> Any:
    """llguidance's view of a model's tokenizer (an HF fast tokenizer, or mlx_lm's wrapper of one) whose end
    tokens are `stops`; built once per tokenizer (about a second, plus a few the first mask takes)."""
    ll = _llguidance()
    inner = getattr(tokenizer, "_tokenizer", None)  # mlx_lm's TokenizerWrapper holds the HF one (an HF
    hf = inner if hasattr(inner, "backend_tokenizer") else tokenizer  # fast tokenizer's is a Rust one)
    key = (vocab_size, tuple(sorted(stops)))
    with _LOCK:
        known = _TOKENIZERS.get(hf, {})
        if key in known:
            return known[key]
        try:
            # no stop tokens (a run that ends at max_tokens): the tokenizer's own EOS ends the grammar
            if hasattr(hf, "tokenizer_json"):  # our own (the stub's bytes)
                eos = list(key[1]) or [hf.eos_token_id]
                tok = ll.LLTokenizer(hf.tokenizer_json(), n_vocab=vocab_size, eos_token=eos)
            else:
                import llguidance.hf

                tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=list(key[1]) or None)
        except ValueError as e:
            raise ValueError(f"structured output needs a Hugging Face fast tokenizer: {e}") from None
        warm = ll.LLMatcher(tok, ll.LLMatcher.grammar_from_regex("a"))
        warm.compute_bitmask()  # the first mask of a tokenizer builds its tables: here, not in a step
        _TOKENIZERS.setdefault(hf, {})[key] = tok
        return tok


def check_grammar(spec: GrammarSpec, tokenizer: Any, vocab_size: int, stops: Sequence[int]) -> None:
    """ValueError, before any work, for a grammar llguidance cannot compile, or a model without a tokenizer
    it reads."""
    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer; this model has none")
    tok = grammar_tokenizer(tokenizer, vocab_size, stops)
    error = _llguidance().LLMatcher.validate_grammar(spec.grammar(), tok)
    if error:
        raise ValueError(f"the {spec.kind} grammar does not compile: {' '.join(error.split())[:300]}")


class Constraint:
    """One run's grammar state: the matcher has consumed exactly the committed output."""

    def __init__(self, spec: GrammarSpec, tokenizer: Any, vocab_size: int, stops: Sequence[int]) -> None:
        ll = _llguidance()
        self._ll = ll
        tok = grammar_tokenizer(tokenizer, vocab_size, stops)
        self.matcher = ll.LLMatcher(tok, spec.grammar())
        self.end_tokens = frozenset(tok.eos_tokens)  # the grammar's end: they end the run too
        self._raise_on_error()
        self._words = (vocab_size + 31) // 32
        self.vocab_size = vocab_size
        self._executor = ll.LLExecutor(1)
        self._bits = torch.arange(32, dtype=torch.int32)

    def _raise_on_error(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"grammar: {' '.join(self.matcher.get_error().split())[:300]}")

    def forced(self) -> list[int]:
        """The tokens that spell what the grammar forces next ([] where it leaves a choice)."""
        return [] if self.matcher.is_stopped() else self.matcher.compute_ff_tokens()

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar takes in a row from here."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens now part of the output (a stop token past the grammar's end ends the run; not consumed)."""
        if tokens and not self.matcher.is_stopped():
            self.matcher.consume_tokens(list(tokens))
            self._raise_on_error()

    def mask(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """[T, V] bool, True where row r (after the committed tokens plus `paths[r]`) may take a token. A row
        whose path leaves the grammar or passes its end allows every token: no such row is ever committed
        (a stop or a rejection comes first), and it must still be a distribution."""
        bitmask = torch.full((len(paths), self._words), -1, dtype=torch.int32)  # [T, W]
        longest = max(paths, key=len)
        if len(paths) == 1 and not paths[0]:
            self._ll.torch.fill_next_token_bitmask(self.matcher, bitmask, 0)
        elif all(len(p) == i and list(p) == list(longest[:i]) for i, p in enumerate(paths)):  # a chain
            self._ll.torch.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, [(self.matcher, 0, list(longest))], bitmask
            )
        else:
            self._walk(paths, bitmask)
        allowed = ((bitmask[:, :, None] >> self._bits) & 1).bool().reshape(len(paths), -1)  # [T, 32W]
        allowed = allowed[:, : self.vocab_size]
        allowed[~allowed.any(-1)] = True
        return allowed

    def _walk(self, paths: Sequence[Sequence[int]], bitmask: torch.Tensor) -> None:
        """Masks of arbitrary paths (a tree's): walk them in order, consuming and rolling back."""
        m, held = self.matcher, []  # tokens consumed past the committed ones
        for r in sorted(range(len(paths)), key=lambda r: list(paths[r])):
            path = list(paths[r])
            n = 0
            while n < min(len(held), len(path)) and held[n] == path[n]:
                n += 1
            if len(held) > n:
                m.rollback(len(held) - n)
                del held[n:]
            rest = path[n:]
            if rest:  # past the grammar's end (stopped: only a stop token, which ends the run) or outside it
                if m.is_stopped() or m.validate_tokens(rest) < len(rest):
                    continue
                m.consume_tokens(rest)
                held += rest
            self._ll.torch.fill_next_token_bitmask(m, bitmask, r)
        if held:
            m.rollback(len(held))
