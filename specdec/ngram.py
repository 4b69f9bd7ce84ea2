"""Prompt-lookup drafting: propose what followed the most recent earlier occurrence of the last n-gram.

No weights and no features, so it runs against any verifier; a useful baseline next to DFlash and the
drafter of the stub demo. An index from n-gram to its latest position makes each proposal O(block).
`LookupFirstDrafter` pairs it with a model drafter: lookup where the text repeats, the model elsewhere.
`CorpusNgrams` looks further than the context: what the verifier's own answers in a corpus put after
the last few tokens (studied offline by `specdec.evals.replay --corpus`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from specdec.memory import probe_for_device
from specdec.protocols import Drafter, MemoryProbe, Verifier


class PromptLookupDrafter:
    name = "prompt-lookup"
    target_layer_ids: tuple[int, ...] = ()
    feature_dim = 0
    vocab_size = None

    def __init__(self, *, block_size: int = 16, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.block_size, self.max_ngram, self.min_ngram = block_size, max_ngram, min_ngram
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.reset()

    @property
    def context_len(self) -> int:
        return len(self._tokens)

    def bind(self, verifier: Verifier) -> None:
        pass

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> position of its last token, latest

    def extend(self, features: torch.Tensor, tokens: Sequence[int]) -> None:
        start = len(self._tokens)
        self._tokens += tokens
        for end in range(start, len(self._tokens)):
            for g in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._index[tuple(self._tokens[end - g + 1 : end + 1])] = end

    def propose(self, last_token: int, n: int) -> list[int]:
        seq = self._tokens
        for g in range(self.max_ngram, self.min_ngram - 1, -1):
            if g - 1 > len(seq):
                continue
            key = (*seq[len(seq) - g + 1 :], last_token) if g > 1 else (last_token,)
            end = self._index.get(key)
            if end is not None:
                cont = [*seq[end + 1 : end + 1 + n]]
                if len(cont) < n and end + 1 + len(cont) == len(seq):
                    cont.append(last_token)  # the match ran into the present: `last` comes next
                return cont[:n]
        return []

    def rollback(self, n: int) -> None:
        kept = self._tokens[: len(self._tokens) - n]
        self.reset()
        self.extend(torch.empty(len(kept), 0), kept)

    def memory_probe(self) -> MemoryProbe:
        return probe_for_device("cpu")


class LookupFirstDrafter:
    """Prompt lookup where the context repeats itself, the wrapped drafter everywhere else.

    When the last `min_ngram`..`max_ngram` tokens occurred before, what followed them is proposed (up to
    `block_size` - 1 tokens, free to draft, and in code or a looping answer often long runs); otherwise
    the wrapped drafter (DFlash) proposes its block. The wrapped drafter sees every commit either way, so
    its context stays exact. Proposals are deterministic (no `propose_logits`): at T > 0 they are
    verified as point-mass drafts, which keeps the output distribution exact.
    """

    def __init__(
        self, drafter: Drafter, *, block_size: int = 16, min_ngram: int = 2, max_ngram: int = 3
    ) -> None:
        self.drafter = drafter
        self.lookup = PromptLookupDrafter(block_size=block_size, max_ngram=max_ngram, min_ngram=min_ngram)
        self.name = f"{drafter.name}+lookup"
        self.block_size = max(block_size, drafter.block_size)
        self.target_layer_ids = drafter.target_layer_ids
        self.feature_dim = drafter.feature_dim
        self.vocab_size = drafter.vocab_size
        self.device, self.dtype = drafter.device, drafter.dtype
        self.runtime = getattr(drafter, "runtime", "torch")  # features come in the wrapped drafter's runtime
        self.counts = {"lookup": 0, "drafter": 0}  # proposals by source since construction

    @property
    def context_len(self) -> int:
        return self.drafter.context_len

    def bind(self, verifier: Verifier) -> None:
        self.drafter.bind(verifier)

    def reset(self) -> None:
        self.drafter.reset()
        self.lookup.reset()

    def extend(self, features: torch.Tensor, tokens: Sequence[int]) -> None:
        self.drafter.extend(features, tokens)
        self.lookup.extend(features, tokens)  # lookup ignores the features

    def propose(self, last_token: int, n: int) -> list[int]:
        draft = self.lookup.propose(last_token, n)
        if draft:
            self.counts["lookup"] += 1
            return draft
        self.counts["drafter"] += 1
        return self.drafter.propose(last_token, min(n, self.drafter.block_size - 1))

    def rollback(self, n: int) -> None:
        self.drafter.rollback(n)
        self.lookup.rollback(n)

    def memory_probe(self) -> MemoryProbe:
        return self.drafter.memory_probe()


_BASE, _MASK = 1_000_003, (1 << 64) - 1  # n-gram keys: a polynomial hash of the ids, modulo 2**64


def _key(ids: Sequence[int]) -> int:
    h = 0
    for t in ids:
        h = (h * _BASE + t + 1) & _MASK  # what numpy's uint64 arithmetic in CorpusNgrams computes
    return h


class CorpusNgrams:
    """Next-token statistics of a corpus (REST / SuffixDecoding style): for each context of 1..max_order
    tokens seen at least `min_count` times in `sequences`, its most frequent next token (ties: the
    smallest id) and that token's share of what came next. Built with numpy from token ids (seconds
    per million tokens); a lookup is one binary search per order, longest order first. Built from the
    verifier's own answers, it predicts the verifier's habits; a key collision only costs a draft."""

    def __init__(self, sequences: Iterable[Sequence[int]], *, max_order: int = 6, min_count: int = 2) -> None:
        if max_order < 1 or min_count < 1:
            raise ValueError(f"need max_order >= 1 and min_count >= 1, got {max_order}, {min_count}")
        seqs = [np.asarray(s, dtype=np.uint64) for s in sequences if len(s) > 1]
        toks = np.concatenate(seqs) if seqs else np.zeros(0, np.uint64)  # [N]
        seq = np.repeat(np.arange(len(seqs)), [len(s) for s in seqs])  # [N] which sequence
        self.max_order, self.min_count = max_order, min_count
        self._tables: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per order: keys, next, share
        h = np.zeros(len(toks), np.uint64)  # h[j]: key of the n tokens ending at j (once j >= n - 1)
        with np.errstate(over="ignore"):
            for n in range(1, max_order + 1):
                h[n - 1 :] = (
                    h[n - 2 : -1] * np.uint64(_BASE) + toks[n - 1 :] + np.uint64(1) if n > 1 else toks + 1
                )
                j = np.arange(n - 1, len(toks) - 1)
                j = j[seq[j - n + 1] == seq[j + 1]]  # context and next token in one sequence
                self._tables.append(self._table(h[j], toks[j + 1].astype(np.int64)))

    def _table(self, ctx: np.ndarray, nxt: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not len(ctx):
            return ctx, nxt, np.zeros(0)
        o = np.lexsort((nxt, ctx))
        ctx, nxt = ctx[o], nxt[o]
        pair = np.flatnonzero(np.r_[True, (ctx[1:] != ctx[:-1]) | (nxt[1:] != nxt[:-1])])  # (ctx, next) runs
        count = np.diff(np.r_[pair, len(ctx)])
        pctx, pnxt = ctx[pair], nxt[pair]
        group = np.cumsum(np.r_[True, pctx[1:] != pctx[:-1]]) - 1  # context index of each pair
        total = np.bincount(group, weights=count).astype(np.int64)
        best = np.lexsort((pnxt, -count, group))  # per context: highest count, then smallest id, first
        first = best[np.r_[True, group[best][1:] != group[best][:-1]]]
        keep = total >= self.min_count
        return pctx[first][keep], pnxt[first][keep], (count[first] / total)[keep]

    def next(self, context: Sequence[int]) -> tuple[int, float] | None:
        """(most frequent next token, its share) after the longest known suffix of `context`, or None."""
        for n in range(min(self.max_order, len(context)), 0, -1):
            keys, nxt, share = self._tables[n - 1]
            k = np.uint64(_key(context[len(context) - n :]))
            i = int(np.searchsorted(keys, k))
            if i < len(keys) and keys[i] == k:
                return int(nxt[i]), float(share[i])
        return None

    def chain(self, context: Sequence[int], n: int) -> list[tuple[int, float]]:
        """Up to `n` tokens drafted greedily, each after the context plus the ones before it, with their
        shares (the running product of these is the draft's confidence, as a DFlash block's)."""
        ctx, out = list(context[max(0, len(context) - self.max_order) :]), []
        while len(out) < n and (hit := self.next(ctx)) is not None:
            out.append(hit)
            ctx = [*ctx, hit[0]][-self.max_order :]
        return out
