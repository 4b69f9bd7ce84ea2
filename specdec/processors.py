"""Logits processors inside verification, exactly: logit bias, the repetition, presence and frequency
penalties, and a grammar's mask (`specdec.grammar`).

A processor sees the history up to the position it decides. In a verify of `[last, *draft]` row i decides
the token after `draft[:i]`, so it is processed with the committed tokens plus `draft[:i]` (a tree node:
plus the tokens on its path); the verifier's token at every row is then exactly the one autoregressive
decoding with the same processors picks there, and the committed text is too (at T > 0 the processed logits
are what `specdec.sampling.warp` turns into the distribution, so it is that of plain sampling with the
processors). Drafters know nothing of the processors: a draft they disagree with is rejected, never kept.

Semantics (in this order, as mlx_lm applies them; every step in fp32):
- `logit_bias` {token id: bias}: added to the token's logit (OpenAI: -100..100; -100 bans in practice);
- `repetition_penalty` r (CTRL, Keskar et al. 2019; transformers' and mlx_lm's): a token in the window has
  its logit divided by r where positive and multiplied by r where negative;
- `presence_penalty` p and `frequency_penalty` f (OpenAI's, -2..2): a token's logit minus p if it is in
  the window, minus f times its count there.
The window (`penalty_context`): None, as OpenAI, vLLM and transformers: the output so far for presence and
frequency, the prompt and the output for repetition; N, as mlx_lm (its default is 20): the last N tokens
of prompt and output for all three.
Then `grammar`: tokens the grammar forbids after the row's history get -inf.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.grammar import Constraint, GrammarSpec, check_grammar
from specdec.reasoning import ThinkingBudget

__all__ = ["LogitsParams", "Processor"]


def _number(name: str, value: object, lo: float, hi: float, *, open_lo: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r:.40}")
    if value < lo or value > hi or (open_lo and value == lo):
        raise ValueError(f"{name} must be in {'(' if open_lo else '['}{lo:g}, {hi:g}], got {value:g}")
    return float(value)


def _bias_pairs(
    bias: Mapping[int | str, float] | Sequence[tuple[int, float]],
) -> tuple[tuple[int, float], ...]:
    """{id: bias} (ids may be decimal strings, as JSON keys are) or (id, bias) pairs -> sorted pairs."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    out: dict[int, float] = {}
    for key, value in items:
        ok = isinstance(key, int) and not isinstance(key, bool)
        ok = ok or (isinstance(key, str) and key.strip().isdigit())
        if not ok or int(key) < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r:.40}")
        out[int(key)] = _number(f"logit_bias[{key}]", value, -100, 100)
    return tuple(sorted(out.items()))


@dataclass(frozen=True, kw_only=True)
class LogitsParams:
    """What to do to the verifier's logits before a token is picked (module docstring)."""

    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # (token id, bias); a dict is accepted
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_context: int | None = None  # None: OpenAI's windows; N: the last N tokens (mlx_lm)
    grammar: GrammarSpec | None = None  # structured output (`specdec.grammar`)
    thinking: ThinkingBudget | None = None  # reasoning cut at a budget (`specdec.reasoning`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        _number("repetition_penalty", self.repetition_penalty, 0, 100, open_lo=True)
        _number("presence_penalty", self.presence_penalty, -2, 2)
        _number("frequency_penalty", self.frequency_penalty, -2, 2)
        n = self.penalty_context
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"penalty_context must be an integer >= 1 (or None), got {n!r:.40}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")

    @property
    def active(self) -> bool:
        """Whether anything changes a logit."""
        return bool(self.logit_bias) or self.penalized or (self.grammar or self.thinking) is not None

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def check_bias(self, vocab_size: int) -> None:
        """ValueError for a biased token outside the vocabulary (known before a model loads)."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} outside the vocabulary 0..{vocab_size - 1}")

    def check(self, vocab_size: int, tokenizer: Any = None, stops: Sequence[int] = ()) -> None:
        """ValueError, before any work, for a biased token outside the vocabulary or a grammar that does
        not compile for the model's tokenizer (whose end tokens are `stops`)."""
        self.check_bias(vocab_size)
        if self.grammar is not None:
            check_grammar(self.grammar, tokenizer, vocab_size, stops)


class Processor:
    """One run's processors: its prompt and committed output, and the rows of each verify. `constraint`: the
    run's grammar state, where `params.grammar` is set (`LogitsParams.constraint` makes it)."""

    def __init__(
        self, params: LogitsParams, prompt: Sequence[int], *, constraint: Constraint | None = None
    ) -> None:
        if (params.grammar is None) != (constraint is None):
            raise ValueError("a grammar's Processor needs its Constraint, and only it")
        self.params, self.constraint = params, constraint
        self.prompt, self.output = list(prompt), []
        self._all: Counter[int] = Counter(prompt)  # prompt + output (repetition's window when unlimited)
        self._out: Counter[int] = Counter()  # output (presence's and frequency's when unlimited)
        self._thought = False  # the output closed its reasoning (a thinking budget has nothing to do)
        self._think_lo = 0  # the end tag does not start in the output before this
        ids, vals = zip(*params.logit_bias) if params.logit_bias else ((), ())
        self._bias = (torch.tensor(ids, dtype=torch.long), torch.tensor(vals, dtype=torch.float32))

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens now part of the output."""
        self.output += tokens
        self._all.update(tokens)
        self._out.update(tokens)
        budget = self.params.thinking
        if budget is not None and not self._thought:  # the end tag searched once, in the new tokens
            self._thought = budget.ended(self.output, lo=self._think_lo)
            self._think_lo = max(0, len(self.output) - len(budget.end) + 1)
        if self.constraint is not None:
            self.constraint.commit(tokens)

    def __call__(self, logits: torch.Tensor, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """logits [T, V] whose row r decides the token after the committed ones plus `paths[r]` -> the
        processed logits [T, V], fp32 (a copy: the verifier's own are left as they are)."""
        x = logits.to(torch.float32, copy=True)  # [T, V]
        ids, vals = self._bias
        if len(ids):
            x[:, ids.to(x.device)] += vals.to(x.device)
        if self.params.penalized:
            self._penalize(x, paths)
        if self.constraint is not None:
            x = torch.where(self.constraint.mask(paths).to(x.device), x, float("-inf"))
        budget = self.params.thinking
        if budget is not None and not self._thought:  # a row past it takes the end tag's next token alone
            for r, path in enumerate(paths):
                t = budget.forced([*self.output, *path], lo=self._think_lo)
                if t is not None:
                    keep = x[r, t].clone()
                    x[r] = float("-inf")
                    x[r, t] = keep if torch.isfinite(keep) else 0.0
        return x

    def _penalize(self, x: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        """The penalties, in place on x [T, V]."""
        p = self.params
        rep, pf = self._counts(paths, x.device)  # [T, U] each, over the columns `u`
        if rep is None:
            return
        u, rep = rep
        sel = x[:, u]  # [T, U]
        if p.repetition_penalty != 1:
            r = p.repetition_penalty
            sel = torch.where(rep > 0, torch.where(sel < 0, sel * r, sel / r), sel)
        if p.presence_penalty:
            sel = sel - p.presence_penalty * (pf > 0).float()
        if p.frequency_penalty:
            sel = sel - p.frequency_penalty * pf
        x[:, u] = sel

    def _counts(
        self, paths: Sequence[Sequence[int]], device: torch.device
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
        """((columns u [U], repetition's counts [T, U]), presence / frequency's counts [T, U]): per row, how
        often each token is in its windows; (None, None) where no window holds a token."""
        n = self.params.penalty_context
        if n is not None:  # short windows: counted per row
            tail = (self.prompt + self.output)[-n:] if len(self.output) < n else self.output[-n:]
            rows = [Counter([*tail, *path][-n:]) for path in paths]
            keys = sorted(set().union(*rows))
            if not keys:
                return None, None
            col = {t: j for j, t in enumerate(keys)}
            m = _scatter(
                len(paths), col, [(i, t, k) for i, c in enumerate(rows) for t, k in c.items()], device
            )
            return (torch.tensor(keys, dtype=torch.long, device=device), m), m
        # the whole history: its counts once, plus each row's path (no per-row copy of the history)
        extra = {t for path in paths for t in path}
        keys = sorted(self._all.keys() | extra)
        if not keys:
            return None, None
        col = {t: j for j, t in enumerate(keys)}
        along = _scatter(len(paths), col, [(i, t, 1) for i, path in enumerate(paths) for t in path], device)
        base_all = torch.tensor([float(self._all[t]) for t in keys], device=device)  # [U]
        base_out = torch.tensor([float(self._out[t]) for t in keys], device=device)  # [U]
        u = torch.tensor(keys, dtype=torch.long, device=device)
        return (u, base_all + along), base_out + along


def _scatter(
    n_rows: int, col: dict[int, int], entries: list[tuple[int, int, int]], device: torch.device
) -> torch.Tensor:
    """[n_rows, len(col)] zeros plus each (row, token, count) entry, summed."""
    out = torch.zeros(n_rows, len(col), device=device)
    if entries:
        r, t, k = zip(*entries)
        idx = (torch.tensor(r, device=device), torch.tensor([col[x] for x in t], device=device))
        out.index_put_(idx, torch.tensor(k, dtype=out.dtype, device=device), accumulate=True)
    return out
