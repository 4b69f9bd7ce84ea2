"""Prompt-lookup drafting: propose what followed the most recent earlier occurrence of the last n-gram.

No weights and no features, so it runs against any verifier; a useful baseline next to DFlash and the
drafter of the stub demo. An index from n-gram to its latest position makes each proposal O(block).
`LookupFirstDrafter` pairs it with a model drafter: lookup where the text repeats, the model elsewhere.
`CorpusNgrams` looks further than the context: what the verifier's own answers in a corpus put after
the last few tokens; `LookupFirstDrafter` tries it where lookup has nothing (`--corpus`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from specdec.costs import VerifyCosts
from specdec.engine import common_prefix_len
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


#: the n-gram lengths `LookupFirstDrafter` matches, longest first: a longer match picks the occurrence whose
#: continuation is likelier to recur (on the answers below, the first drafted token is right 0.95 of the time
#: after a match of 8 or more and 0.63 after one of exactly 3; matching at most 3, 0.86 after any 3 or more)
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
#: a corpus n-gram token of share s is accepted with probability about s ** CORPUS_ACCEPT_POWER (the same
#: held-out answers against a table of the rest: share 0.55 -> 0.33-0.44 accepted, 0.95 -> 0.85-0.95)
CORPUS_ACCEPT_POWER = 1.5


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


def chances_of(corpus: CorpusNgrams | None) -> Chances:
    """Lookup's chances with `corpus`: those measured on its answers where it has them (the verifier's own
    habits), else `LOOKUP_ACCEPT`."""
    return (corpus.lookup_chances if corpus is not None else None) or LOOKUP_ACCEPT


def sample_answers(sequences: Sequence, *, n: int = 400, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """`n` (prompt, answer) pairs of a corpus' sequences (`specdec.corpus.TrainSequence`s), drawn
    without replacement (seeded): what `lookup_chances` measures on."""
    out = []
    for i in np.random.default_rng(seed).permutation(len(sequences))[:n]:
        ids, p = [int(t) for t in sequences[i].ids], sequences[i].prompt_len
        out.append((ids[:p], ids[p:]))
    return out


#: weight, in verified draft tokens, of the figures above against what a request's own drafts show
#: (`Calibration`); chosen by replaying 300 held-out answers of the bundled SmolLM2 corpus, the n-gram
#: table built from the rest (weights 10-50 were within 0.3% of each other there)
CALIBRATION_PRIOR = 20.0


class Calibration:
    """Per request, each draft source's chances of acceptance scaled by how its drafts have fared so far.

    A source's factor is (w + sum of accepted / predicted) / (w + n) over the n draft tokens of it the
    verifier has checked (each token up to and including the first rejected one), w =
    `CALIBRATION_PRIOR`: 1 before any evidence, above 1 where the request repeats itself more than the
    corpus figures expect, below where it does less. Replayed on those held-out answers with a verify
    cost table of this CPU, cutting by the calibrated chances gained 4.7% estimated speed over the fixed
    figures (HumanEval 20 and MT-Bench 10 x 2 traces: 5.3%, 5.4%)."""

    def __init__(self, prior: float = CALIBRATION_PRIOR) -> None:
        self.prior = prior
        self.reset()

    def reset(self) -> None:
        self._seen: dict[str, tuple[int, float]] = {}  # source -> (tokens checked, sum accepted / predicted)

    def factor(self, source: str) -> float:
        n, ratio = self._seen.get(source, (0, 0.0))
        return (self.prior + ratio) / (self.prior + n)

    def scale(self, source: str, probs: Sequence[float]) -> list[float]:
        f = self.factor(source)
        return [min(1.0, p * f) for p in probs]

    def learn(self, source: str, probs: Sequence[float], accepted: int) -> None:
        """A draft of `source` whose tokens had (uncalibrated) chances `probs`: `accepted` were accepted."""
        n, ratio = self._seen.get(source, (0, 0.0))
        checked = min(len(probs), accepted + 1)
        self._seen[source] = (n + checked, ratio + sum(1.0 / max(p, 1e-6) for p in probs[:accepted]))


def cut_by_cost(
    costs: VerifyCosts,
    lookup: Sequence[int],
    ngram: int,
    chain: Sequence[int],
    shares: Sequence[float],
    calibration: Calibration,
    *,
    chances: Chances = LOOKUP_ACCEPT,
) -> tuple[list[int], str | None, list[float]]:
    """(draft, its source "lookup" / "corpus", its tokens' predicted chances before calibration): lookup's
    proposal (matched on an `ngram`-token n-gram) and the corpus chain with its shares, each cut where it
    commits the most tokens per verify cost by its chances (scaled by `calibration`), the better of the
    two kept; ([], None, []) where no cut beats a one-token step. Lookup's chances come from `chances`."""
    prior = {
        "lookup": lookup_accept(ngram, len(lookup), chances),
        "corpus": [s**CORPUS_ACCEPT_POWER for s in shares],
    }
    looked = costs.rate(calibration.scale("lookup", prior["lookup"]))
    mined = costs.rate(calibration.scale("corpus", prior["corpus"]))
    if looked[0] and looked[1] >= mined[1]:
        return list(lookup[: looked[0]]), "lookup", prior["lookup"][: looked[0]]
    if mined[0]:
        return list(chain[: mined[0]]), "corpus", prior["corpus"][: mined[0]]
    return [], None, []


class LookupFirstDrafter:
    """Prompt lookup where the context repeats itself, the wrapped drafter everywhere else.

    When the last 2-8 tokens (`LOOKUP_NGRAMS`) occurred before, what followed the latest occurrence of the
    longest of them is proposed (up to `block_size` - 1 tokens, free to draft, and in code or a looping
    answer often long runs); otherwise, with `corpus`, what the verifier's own answers in a corpus put
    after the last few tokens (cut where the running share falls below `corpus_cut`); otherwise the
    wrapped drafter (DFlash) proposes its block. With `costs` (`specdec.costs.VerifyCosts`), lookup's and
    the corpus's drafts are each cut where they commit the most tokens per verify cost (their chances of
    acceptance from `chances_of(corpus)` and the corpus shares, calibrated per request by `Calibration`,
    which learns from the commits `extend` gets; `corpus_cut` is unused) and the better of the two is
    proposed; the wrapped drafter runs where neither has a draft worth verifying. The wrapped drafter
    sees every commit either way, so its context stays exact. Proposals are deterministic (no
    `propose_logits`): at T > 0 they are verified as point-mass drafts, which keeps the output
    distribution exact.
    """

    def __init__(
        self,
        drafter: Drafter,
        *,
        block_size: int = 16,
        corpus: CorpusNgrams | None = None,
        corpus_cut: float = 0.4,
        costs: VerifyCosts | None = None,
    ) -> None:
        _check_cut(corpus_cut)
        self.drafter, self.costs = drafter, costs
        lo, hi = LOOKUP_NGRAMS  # fixed: `LOOKUP_ACCEPT` was measured with them
        self.lookup = PromptLookupDrafter(block_size=block_size, min_ngram=lo, max_ngram=hi)
        self.corpus, self.corpus_cut = corpus, corpus_cut
        self.lookup_chances = chances_of(corpus)
        self.name = f"{drafter.name}+lookup" + ("+corpus" if corpus is not None else "")
        self.block_size = max(block_size, drafter.block_size)
        self.target_layer_ids = drafter.target_layer_ids
        self.feature_dim = drafter.feature_dim
        self.vocab_size = drafter.vocab_size
        self.device, self.dtype = drafter.device, drafter.dtype
        self.runtime = getattr(drafter, "runtime", "torch")  # features come in the wrapped drafter's runtime
        self.counts = {"lookup": 0, "corpus": 0, "drafter": 0}  # proposals by source since construction
        self.calibration = Calibration()
        self._pending: tuple[str, list[float]] | None = None  # the last cost-cut draft's source and chances

    @property
    def context_len(self) -> int:
        return self.drafter.context_len

    def bind(self, verifier: Verifier) -> None:
        self.drafter.bind(verifier)

    def reset(self) -> None:
        self.drafter.reset()
        self.lookup.reset()
        self.calibration.reset()
        self._pending = None

    def extend(self, features: torch.Tensor, tokens: Sequence[int]) -> None:
        if self._pending is not None:  # tokens: the last token and the drafts the verifier accepted
            self.calibration.learn(*self._pending, accepted=len(tokens) - 1)
            self._pending = None
        self.drafter.extend(features, tokens)
        self.lookup.extend(features, tokens)  # lookup ignores the features

    def propose(self, last_token: int, n: int) -> list[int]:
        draft, g = self.lookup.match(last_token, n)
        chain, shares = [], []  # the corpus's greedy chain and the share of each of its tokens
        if self.corpus is not None and (self.costs is not None or not draft):
            seq = self.lookup._tokens  # the committed tokens; the chain reads the last max_order
            context = [*seq[max(0, len(seq) - self.corpus.max_order + 1) :], last_token]
            mined = self.corpus.chain(context, n, cut=0.0 if self.costs is not None else self.corpus_cut)
            chain, shares = [t for t, _ in mined], [s for _, s in mined]
        if self.costs is not None:
            cut, source, prior = cut_by_cost(
                self.costs, draft, g, chain, shares, self.calibration, chances=self.lookup_chances
            )
            draft, chain = (cut, []) if source == "lookup" else ([], cut)
            self._pending = (source, prior) if source else None
        if draft:
            self.counts["lookup"] += 1
            return draft
        if chain:
            self.counts["corpus"] += 1
            return chain
        self.counts["drafter"] += 1
        return self.drafter.propose(last_token, min(n, self.drafter.block_size - 1))

    def rollback(self, n: int) -> None:
        self._pending = None
        self.drafter.rollback(n)
        self.lookup.rollback(n)

    def memory_probe(self) -> MemoryProbe:
        return self.drafter.memory_probe()


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


def _check_cut(cut: float) -> None:
    if not 0.0 <= cut <= 1.0:
        raise ValueError(f"corpus_cut must be in [0, 1], got {cut}")


def check_corpus(
    path: str | os.PathLike[str], *, drafter: str | None = None, cut: float | None = None
) -> dict:
    """The verifier record of the corpus folder at `path` (cheap: before any model loads); an error where
    it is not one, where `drafter` (a spec) is not a '+lookup' one, which the corpus drafts for, or where
    `cut` is not a share."""
    from specdec.bundled import corpus_path
    from specdec.corpus import Corpus

    if drafter is not None and not drafter.endswith("+lookup"):
        raise ValueError(
            f"a corpus drafts where lookup has nothing: give a '+lookup' drafter, not {drafter!r}"
        )
    if cut is not None:
        _check_cut(cut)
    return Corpus(corpus_path(path)).meta["verifier"]


def load_corpus_ngrams(path: str | os.PathLike[str], verifier: Verifier) -> CorpusNgrams:
    """`CorpusNgrams` of the answers in the corpus folder at `path` (written by `specdec train`, or
    "bundled:<model>" for a bundled one), which `verifier`'s model must have written: another
    vocabulary is an error. Lookup's chances are measured on 400 of its answers (`lookup_chances`). About
    2 s per million answer tokens plus ~3 s on a small CPU."""
    from specdec.bundled import corpus_path
    from specdec.corpus import Corpus

    path = corpus_path(path)
    meta = check_corpus(path)
    if meta.get("vocab_size") != verifier.vocab_size:
        raise ValueError(
            f"corpus {str(path)!r} was written by {meta.get('model')!r} (vocab {meta.get('vocab_size')}), "
            f"not by this verifier (vocab {verifier.vocab_size})"
        )
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
