"""Measure `specdec.ngram.LOOKUP_ACCEPT`: how often prompt lookup's drafted tokens are accepted, by the
length of the n-gram it matched, on a seeded sample of a corpus' answers (the verifier's own greedy
answers, so an accepted token is one the verifier would have written). Lookup runs over prompt + answer
as in decoding, with `LookupFirstDrafter`'s n-gram lengths; the row of the longest length counts every
match of that length or more.

    python -m specdec.evals.chances --corpus evals/traindata/smollm2-135m
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from specdec.args import Parser, at_least, run_main
from specdec.engine import common_prefix_len
from specdec.ngram import LOOKUP_NGRAMS, PromptLookupDrafter

__all__ = ["lookup_chances", "sample_answers"]


def lookup_chances(
    answers: Iterable[tuple[Sequence[int], Sequence[int]]],
    *,
    draft: int = 15,
    positions: int = 6,
    min_tries: int = 100,
) -> dict[int, tuple[float, ...]]:
    """{matched n-gram length: the chance that drafted token j is accepted given the ones before it, for
    the first `positions` j that at least `min_tries` checks reached}, rounded to 2 places, from (prompt,
    answer) pairs; lookup drafts up to `draft` tokens as the engine's does with blocks of draft + 1 (the
    chances level off after a few tokens: `lookup_accept` repeats a row's last one)."""
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


def sample_answers(corpus: str, *, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`n` (prompt, answer) pairs of the corpus folder `corpus`, drawn without replacement (seeded)."""
    from specdec.train.data import TrainData

    seqs = TrainData(corpus).sequences
    out = []
    for i in np.random.default_rng(seed).permutation(len(seqs))[:n]:
        ids, p = [int(t) for t in seqs[i].ids], seqs[i].prompt_len
        out.append((ids[:p], ids[p:]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="python -m specdec.evals.chances", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, metavar="DIR", help="a `specdec.train.corpus` folder")
    p.add_argument("--answers", type=at_least(1), default=400, help="how many answers to sample")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=_run)
    return run_main(p, argv)


def _run(args: argparse.Namespace) -> int:
    chances = lookup_chances(sample_answers(args.corpus, n=args.answers, seed=args.seed))
    for g, row in chances.items():
        print(f"{g}: ({', '.join(f'{c:.2f}' for c in row)}),")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
