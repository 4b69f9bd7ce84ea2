"""Corpus n-gram drafting: what the verifier's own answers in a corpus put after the last few tokens.

`CorpusNgrams` looks further than the context (REST / SuffixDecoding style); `LookupFirstDrafter` tries it
where prompt lookup has nothing (`--corpus`). A corpus also tells how often the verifier repeats itself:
lookup's chances are measured on it at load (`chances_of`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from specdec.drafting.lookup.prompt import LOOKUP_ACCEPT, Chances, lookup_chances, sample_answers
from specdec.drafting.policy import DraftPolicy
from specdec.protocols import Verifier

__all__ = ["CorpusNgrams", "chances_of", "check_corpus", "load_corpus_ngrams"]


_BASE, _MASK = 1_000_003, (1 << 64) - 1  # n-gram keys: a polynomial hash of the ids, modulo 2**64


def _key(ids: Sequence[int]) -> int:
    h = 0
    for t in ids:
        h = (h * _BASE + int(t) + 1) & _MASK  # what numpy's uint64 arithmetic in CorpusNgrams computes
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
        self.source: str | None = None  # where the sequences came from (a corpus folder), for records
        #: prompt lookup's chances measured on these answers (`lookup_chances`, set by `load_corpus_ngrams`):
        #: `LookupFirstDrafter` with this corpus prices lookup's drafts by them (None: by `LOOKUP_ACCEPT`)
        self.lookup_chances: dict[int, tuple[float, ...]] | None = None
        # a (context, next) pair packs into one uint64, next in the low `_bits`: one plain sort groups both
        self._bits = max(1, int(toks.max()).bit_length() if len(toks) else 1)
        self._ctx_mask = (1 << (64 - self._bits)) - 1  # context keys keep the hash's low 64 - _bits bits
        self._tables: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per order: keys, next, share
        h = np.zeros(len(toks), np.uint64)  # h[j]: key of the n tokens ending at j (once j >= n - 1)
        with np.errstate(over="ignore"):
            for n in range(1, max_order + 1):
                h[n - 1 :] = (
                    h[n - 2 : -1] * np.uint64(_BASE) + toks[n - 1 :] + np.uint64(1) if n > 1 else toks + 1
                )
                j = np.arange(n - 1, len(toks) - 1)
                j = j[seq[j - n + 1] == seq[j + 1]]  # context and next token in one sequence
                self._tables.append(self._table((h[j] << np.uint64(self._bits)) | toks[j + 1]))

    def _table(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(context keys, their most frequent next token, its share), keys sorted, from packed pairs [M]."""
        bits = np.uint64(self._bits)
        if not len(packed):
            return packed, packed.astype(np.int64), np.zeros(0)
        pairs = np.sort(packed)  # by context, then by next token
        start = np.flatnonzero(np.r_[True, pairs[1:] != pairs[:-1]])  # runs of one (context, next)
        count = np.diff(np.r_[start, len(pairs)])  # [P]
        pair = pairs[start]
        ctx = pair >> bits
        first = np.flatnonzero(np.r_[True, ctx[1:] != ctx[:-1]])  # each context's first pair, [C]
        total, top = np.add.reduceat(count, first), np.maximum.reduceat(count, first)
        group = np.repeat(np.arange(len(first)), np.diff(np.r_[first, len(pair)]))  # [P] its context
        tied = np.flatnonzero(count == top[group])  # pairs at their context's highest count
        best = tied[np.r_[True, group[tied][1:] != group[tied][:-1]]]  # of those the smallest id, [C]
        keep = total >= self.min_count
        nxt = (pair[best] & ((np.uint64(1) << bits) - np.uint64(1))).astype(np.int64)
        return ctx[first][keep], nxt[keep], (count[best] / total)[keep]

    def next(self, context: Sequence[int]) -> tuple[int, float] | None:
        """(most frequent next token, its share) after the longest known suffix of `context`, or None."""
        for n in range(min(self.max_order, len(context)), 0, -1):
            keys, nxt, share = self._tables[n - 1]
            k = np.uint64(_key(context[len(context) - n :]) & self._ctx_mask)
            i = int(np.searchsorted(keys, k))
            if i < len(keys) and keys[i] == k:
                return int(nxt[i]), float(share[i])
        return None

    def chain(self, context: Sequence[int], n: int, *, cut: float = 0.0) -> list[tuple[int, float]]:
        """Up to `n` tokens drafted greedily, each after the context plus the ones before it, with their
        shares. The running product of these is the draft's confidence, as a DFlash block's: the chain
        ends before it falls below `cut`."""
        ctx, out, run = list(context[max(0, len(context) - self.max_order) :]), [], 1.0
        while len(out) < n and (hit := self.next(ctx)) is not None:
            run *= hit[1]
            if run < cut:
                break
            out.append(hit)
            ctx = [*ctx, hit[0]][-self.max_order :]
        return out


def chances_of(corpus: CorpusNgrams | None) -> Chances:
    """Lookup's chances with `corpus`: those measured on its answers where it has them (the verifier's own
    habits), else `LOOKUP_ACCEPT`."""
    return (corpus.lookup_chances if corpus is not None else None) or LOOKUP_ACCEPT


def check_corpus(path: str | os.PathLike[str], *, cut: float | None = None, target: Any = None) -> dict:
    """The verifier record of the corpus folder at `path` (cheap: before any model loads); an error where
    it is not one (its chunk files opened too: a truncated one fails here), where `cut` is not a share, or
    where `target` (a verifier, or its `model_name` and `vocab_size` read before it loads) did not write
    it. (That a corpus goes with a "+lookup" drafter: `load.check_corpus_for`.)"""
    from specdec.bundled import corpus_path
    from specdec.corpus import Corpus

    if cut is not None:
        DraftPolicy(corpus_cut=cut)  # a share, or a one-line error
    corpus = Corpus(corpus_path(path))
    corpus.check_chunks()
    meta = corpus.meta["verifier"]
    if target is not None and meta.get("vocab_size") != target.vocab_size:
        raise ValueError(
            f"corpus {str(path)!r} was written by {meta.get('model')!r} (vocab {meta.get('vocab_size')}), "
            f"not by the verifier's model {target.model_name!r} (vocab {target.vocab_size})"
        )
    return meta


def load_corpus_ngrams(path: str | os.PathLike[str], verifier: Verifier) -> CorpusNgrams:
    """`CorpusNgrams` of the answers in the corpus folder at `path` (written by `specdec train`, or
    "bundled:<model>" for a bundled one), which `verifier`'s model must have written: another
    vocabulary is an error. Lookup's chances are measured on 400 of its answers (`lookup_chances`). About
    2 s per million answer tokens plus ~3 s on a small CPU."""
    from specdec.bundled import corpus_path
    from specdec.corpus import Corpus

    path = corpus_path(path)
    check_corpus(path, target=verifier)
    t = time.perf_counter()
    sequences = Corpus(path).all_sequences()
    table = CorpusNgrams(s.ids[s.prompt_len :] for s in sequences)
    table.source = str(path)
    sample = sample_answers(sequences)
    table.lookup_chances = lookup_chances(sample)  # this verifier's own habits (a base model repeats more)
    took = time.perf_counter() - t
    print(
        f"corpus n-grams: {len(sequences)} answers of {str(path)!r}, lookup's chances from {len(sample)} of "
        f"them, in {took:.1f} s",
        file=sys.stderr,
    )
    return table
