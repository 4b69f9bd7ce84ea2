"""Measure `LOOKUP_ACCEPT` (`specdec.drafting.lookup.prompt`) on a corpus: how often prompt lookup's
drafted tokens are accepted, by the length of the n-gram it matched, on a seeded sample of the corpus'
answers (the verifier's own greedy answers, so an accepted token is one the verifier would have
written). `--corpus DIR` in the engine measures the same at load
(`specdec.drafting.lookup.ngrams.load_corpus_ngrams`); the committed table is this on the bundled
SmolLM2 corpus.

    python -m specdec.evals.chances --corpus bundled:smollm2-135m
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from specdec.args import Parser, at_least, run_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="python -m specdec.evals.chances", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, metavar="DIR", help="a corpus folder, or bundled:<model>")
    p.add_argument("--answers", type=at_least(1), default=400, help="how many answers to sample")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=_run)
    return run_main(p, argv)


def _run(args: argparse.Namespace) -> int:
    from specdec.bundled import corpus_path
    from specdec.corpus import Corpus
    from specdec.drafting.lookup.ngrams import check_corpus
    from specdec.drafting.lookup.prompt import lookup_chances, sample_answers

    check_corpus(args.corpus)
    sequences = Corpus(corpus_path(args.corpus)).all_sequences()
    answers = sample_answers(sequences, n=args.answers, seed=args.seed)
    for g, row in lookup_chances(answers).items():
        print(f"{g}: ({', '.join(f'{c:.2f}' for c in row)}),")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
