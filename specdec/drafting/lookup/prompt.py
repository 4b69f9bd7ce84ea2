"""Prompt-lookup drafting: propose what followed the most recent earlier occurrence of the last n-gram.

No weights and no features, so it runs against any verifier; a useful baseline next to DFlash and the
drafter of the stub demo. An index from n-gram to its latest position makes each proposal O(block). The
chances of acceptance of its drafts, by the length of the n-gram they matched, are measured on the
verifier's own answers (`LOOKUP_ACCEPT`, `lookup_chances`); `specdec.drafting.policy` cuts by them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from specdec.engine import common_prefix_len
from specdec.memory import probe_for_device
from specdec.protocols import MemoryProbe, Verifier

__all__ = [
    "LOOKUP_ACCEPT", "LOOKUP_BLOCK_SIZE", "LOOKUP_NGRAMS", "Chances", "PromptLookupDrafter", "lookup_accept",
    "lookup_chances", "sample_answers",
]  # fmt: skip


#: the block prompt lookup drafts in (it has no model, so no block size of its own): up to 15 tokens a step
LOOKUP_BLOCK_SIZE = 16


class PromptLookupDrafter:
    name = "prompt-lookup"
    runtime = "torch"
    target_layer_ids: tuple[int, ...] = ()
    feature_dim = 0
    vocab_size = None

    def __init__(
        self, *, block_size: int = LOOKUP_BLOCK_SIZE, max_ngram: int = 3, min_ngram: int = 1
    ) -> None:
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
        return self.match(last_token, n)[0]

    def match(self, last_token: int, n: int) -> tuple[list[int], int]:
        """(proposal, length of the n-gram it matched); ([], 0) where no n-gram occurred before."""
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
                return cont[:n], g
        return [], 0

    def rollback(self, n: int) -> None:
        kept = self._tokens[: len(self._tokens) - n]
        self.reset()
        self.extend(torch.empty(len(kept), 0), kept)

    def memory_probe(self) -> MemoryProbe:
        return probe_for_device("cpu")


#: the n-gram lengths `LookupFirstDrafter` (`specdec.drafting.mix`) matches, longest first: a longer match
#: picks the occurrence whose continuation is likelier to recur (on the answers below, the first drafted
#: token is right 0.95 of the time after a match of 8 or more and 0.63 after one of exactly 3; matching at
#: most 3, 0.86 after any 3 or more)
LOOKUP_NGRAMS = (2, 8)
#: the chance that prompt lookup's j-th drafted token is accepted, given the ones before it, by the length of
#: the n-gram it matched (the last row: that length or more); measured on 400 answers of the bundled SmolLM2
#: corpus (the verifier's own greedy answers, lookup over prompt + answer as in decoding) by
#: `python -m specdec.evals.chances --corpus bundled:smollm2-135m`
LOOKUP_ACCEPT = {
    2: (0.56, 0.63, 0.74, 0.81, 0.83, 0.85),
    3: (0.63, 0.70, 0.81, 0.83, 0.86, 0.87),
    4: (0.69, 0.81, 0.83, 0.86, 0.87, 0.88),
    5: (0.80, 0.83, 0.86, 0.87, 0.88, 0.87),
    6: (0.83, 0.86, 0.86, 0.88, 0.87, 0.88),
    7: (0.85, 0.86, 0.88, 0.87, 0.88, 0.93),
    8: (0.95, 0.95, 0.96, 0.96, 0.96, 0.97),
}
#: matched n-gram length -> chances of the drafted tokens, as `LOOKUP_ACCEPT`
Chances = Mapping[int, Sequence[float]]


def lookup_accept(g: int, n: int, chances: Chances = LOOKUP_ACCEPT) -> list[float]:
    """The chances of a lookup draft of `n` tokens matched on `g` tokens, from `chances` (a row it lacks or
    has empty: `LOOKUP_ACCEPT`'s); a row's last chance stands for the tokens past its end."""
    g = min(max(g, LOOKUP_NGRAMS[0]), LOOKUP_NGRAMS[1])
    curve = chances.get(g) or LOOKUP_ACCEPT[g]
    return [curve[min(j, len(curve) - 1)] for j in range(n)]


def lookup_chances(
    answers: Iterable[tuple[Sequence[int], Sequence[int]]],
    *,
    draft: int = 15,
    positions: int = 6,
    min_tries: int = 100,
) -> dict[int, tuple[float, ...]]:
    """Measure `LOOKUP_ACCEPT` on (prompt, answer) pairs of a verifier's own answers: {matched n-gram length:
    the chance that drafted token j is accepted given the ones before it, for the first `positions` j
    that at least `min_tries` checks reached}, rounded to 2 places. Lookup runs over prompt + answer as in
    decoding, with `LOOKUP_NGRAMS` (the last row counts matches of that length or more), drafting up to
    `draft` tokens as the engine's does with blocks of draft + 1."""
    lo, hi = LOOKUP_NGRAMS
    tried, right = np.zeros((hi + 1, draft)), np.zeros((hi + 1, draft))  # [g, j]
    for prompt, answer in answers:
        lookup = PromptLookupDrafter(block_size=draft + 1, min_ngram=lo, max_ngram=hi)
        lookup.extend(torch.empty(0), list(prompt))  # lookup ignores the features
        for i in range(len(answer) - 1):
            proposal, g = lookup.match(answer[i], min(draft, len(answer) - 1 - i))
            if proposal:
                a = common_prefix_len(proposal, answer[i + 1 :])
                tried[g, : min(len(proposal), a + 1)] += 1  # the accepted tokens and the first rejected
                right[g, :a] += 1
            lookup.extend(torch.empty(0), [answer[i]])
    out = {}
    for g in range(lo, hi + 1):
        seen = tried[g] >= min_tries
        n = min(positions, int(np.argmin(seen)) if not seen.all() else draft)  # leading, enough tries
        out[g] = tuple(round(float(r / t), 2) for r, t in zip(right[g, :n], tried[g, :n]))
    return out


def sample_answers(sequences: Sequence, *, n: int = 400, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """`n` (prompt, answer) pairs of a corpus' sequences (`specdec.corpus.TrainSequence`s), drawn
    without replacement (seeded): what `lookup_chances` measures on."""
    out = []
    for i in np.random.default_rng(seed).permutation(len(sequences))[:n]:
        ids, p = [int(t) for t in sequences[i].ids], sequences[i].prompt_len
        out.append((ids[:p], ids[p:]))
    return out
