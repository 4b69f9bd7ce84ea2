"""One draft policy: where a draft is cut, and whose draft a step verifies.

Every proposer gives a `Draft`: tokens with a confidence for each given the ones before it (DFlash, a draft
model: its top-1 probabilities; prompt lookup: the acceptance rates measured for the n-gram length it matched,
`lookup.prompt.lookup_accept`; corpus n-grams: each token's share of what followed its context).
`DraftPolicy.cut` ends a draft either where its running confidence falls below a threshold
(`min_confidence` for DFlash, `corpus_cut` for corpus n-grams; lookup drafts are free to draft and kept
whole), or, with verify costs, where it commits the most tokens per unit of verify cost
(`VerifyCosts.rate`) by its chances of acceptance (`DraftPolicy.acceptance`: the confidences, a corpus
share s as s ** `CORPUS_ACCEPT_POWER`), lookup's and the corpus's first scaled by how the request's own
drafts have fared (`Calibration`).
`DraftPolicy.choose` picks the draft a step verifies among lookup's and the corpus's (None: ask the model
drafter). The drafters (`dflash.torch`, `dflash.mlx`, `mix`) and the replay tool all call
these, so a replay is the engine's rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.costs import VerifyCosts

__all__ = ["CALIBRATION_PRIOR", "CORPUS_ACCEPT_POWER", "Calibration", "Draft", "DraftPolicy", "running_cut"]

#: a corpus n-gram token of share s is accepted with probability about s ** CORPUS_ACCEPT_POWER (held-out
#: answers of the bundled SmolLM2 corpus against a table of the rest: share 0.55 -> 0.33-0.44 accepted,
#: 0.95 -> 0.85-0.95)
CORPUS_ACCEPT_POWER = 1.5


@dataclass(frozen=True)
class Draft:
    """A proposal: `tokens`, its `source` ("dflash", "model", "lookup" or "corpus") and each token's
    confidence given the ones before it (see the module docstring; empty where no cut reads them)."""

    tokens: list[int]
    source: str
    confidence: list[float] = field(default_factory=list)

    def __getitem__(self, s: slice) -> Draft:
        return Draft(self.tokens[s], self.source, self.confidence[s])


def running_cut(confidence: Sequence[float], threshold: float) -> int:
    """How many tokens to keep: all before the first whose running product of `confidence` is below
    `threshold` (0: all)."""
    run = 1.0
    for k, p in enumerate(confidence):
        run *= p
        if run < threshold:
            return k
    return len(confidence)


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


@dataclass(frozen=True)
class DraftPolicy:
    """Where drafts are cut: by running chance (`min_confidence` for a model drafter's blocks,
    `corpus_cut` for corpus n-gram chains), or, with `costs`, where each commits the most tokens per
    verify cost (the thresholds are then unused). See the module docstring."""

    min_confidence: float = 0.0
    corpus_cut: float = 0.4
    costs: VerifyCosts | None = None

    def __post_init__(self) -> None:
        for name in ("min_confidence", "corpus_cut"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.min_confidence and self.costs is not None:
            raise ValueError("give min_confidence or verify costs, not both: each sets where drafts are cut")

    def describe(self) -> dict[str, Any]:
        """For the result JSON: the confidence cut and the verify costs (None: not cut by cost)."""
        costs = None if self.costs is None else self.costs.to_json()
        return {"min_confidence": self.min_confidence, "costs": costs}

    def needs_confidence(self, source: str) -> bool:
        """Whether `cut` reads the confidence of a draft of `source` (a proposer may skip computing it)."""
        return self.costs is not None or self.threshold(source) > 0

    def threshold(self, source: str) -> float:
        """The running chance below which a draft of `source` is cut (0: not cut by chance)."""
        model = self.min_confidence  # a model drafter's: DFlash's blocks, a draft model's chains
        return {"dflash": model, "model": model, "corpus": self.corpus_cut}.get(source, 0.0)

    @staticmethod
    def acceptance(draft: Draft) -> list[float]:
        """Each token's chance of acceptance given the ones before it, as the cost cut prices it."""
        if draft.source == "corpus":
            return [c**CORPUS_ACCEPT_POWER for c in draft.confidence]
        return list(draft.confidence)

    def block_cut(self, tokens: list[int], chances: list[float] | None) -> list[int]:
        """A block drafter's greedy tokens, cut by this policy with the block's running top-1 chances
        (`chances`, computed only where `needs_confidence("dflash")`; None: the whole block). Both DFlash
        runtimes (torch, MLX) decide here."""
        return tokens if chances is None else self.cut(Draft(tokens, "dflash", chances)).tokens

    def cut(self, draft: Draft, calibration: Calibration | None = None) -> Draft:
        """`draft` cut where this policy ends it (chances scaled by `calibration` under costs)."""
        if self.costs is not None:
            probs = self.acceptance(draft)
            probs = calibration.scale(draft.source, probs) if calibration else probs
            return draft[: self.costs.best_length(probs)]
        threshold = self.threshold(draft.source)
        return draft[: running_cut(draft.confidence, threshold)] if threshold > 0 else draft

    def choose(self, lookup: Draft, corpus: Draft, calibration: Calibration) -> Draft | None:
        """The draft a step verifies, of lookup's and the corpus's, cut; None where neither is worth it
        (then the model drafter proposes). Without costs, lookup's where it has one, else the corpus's;
        with costs, the one that commits the more tokens per verify cost (lookup on a tie)."""
        if self.costs is None:
            corpus = self.cut(corpus)
            return lookup if lookup.tokens else corpus if corpus.tokens else None
        looked = self.costs.rate(calibration.scale("lookup", self.acceptance(lookup)))
        mined = self.costs.rate(calibration.scale("corpus", self.acceptance(corpus)))
        if looked[0] and looked[1] >= mined[1]:
            return lookup[: looked[0]]
        return corpus[: mined[0]] if mined[0] else None
