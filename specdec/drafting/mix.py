"""Drafting from several sources: prompt lookup where the text repeats, corpus n-grams where lookup has
nothing, a model drafter (DFlash) everywhere else; `specdec.drafting.policy` decides which draft a step
verifies and where it is cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from specdec.drafting.lookup.ngrams import CorpusNgrams, chances_of
from specdec.drafting.lookup.prompt import (
    LOOKUP_BLOCK_SIZE,
    LOOKUP_NGRAMS,
    PromptLookupDrafter,
    lookup_accept,
)
from specdec.drafting.policy import Calibration, Draft, DraftPolicy
from specdec.protocols import Describes, Drafter, MemoryProbe, TreeProposals, Verifier
from specdec.tree import Tree, TreeBudget

__all__ = ["LookupFirstDrafter"]


class LookupFirstDrafter:
    """Prompt lookup where the context repeats itself, the wrapped drafter everywhere else.

    When the last 2-8 tokens (`LOOKUP_NGRAMS`) occurred before, what followed the latest occurrence of the
    longest of them is proposed (up to `block_size` - 1 tokens, free to draft, and in code or a looping
    answer often long runs); otherwise, with `corpus`, what the verifier's own answers in a corpus put
    after the last few tokens; otherwise the wrapped drafter (DFlash) proposes its block. Which draft a
    step verifies, and where it is cut, is `policy`'s rule (`DraftPolicy.choose`: without verify costs
    lookup's whole draft, else the corpus chain cut at its `corpus_cut`; with costs, the better of the
    two by tokens per verify cost, their chances from `chances_of(corpus)` and the corpus shares,
    calibrated per request by `Calibration`, which learns from the commits `extend` gets). The wrapped
    drafter runs where neither has a draft worth verifying, and sees every commit either way, so its
    context stays exact. Proposals are deterministic (no `propose_logits`): at T > 0 they are verified
    as point-mass drafts, which keeps the output distribution exact.
    """

    def __init__(
        self,
        drafter: Drafter,
        *,
        block_size: int | None = None,
        corpus: CorpusNgrams | None = None,
        policy: DraftPolicy | None = None,
    ) -> None:
        self.drafter, self.policy = drafter, policy or DraftPolicy()
        block_size = block_size or LOOKUP_BLOCK_SIZE
        lo, hi = LOOKUP_NGRAMS  # fixed: `LOOKUP_ACCEPT` was measured with them
        self.lookup = PromptLookupDrafter(block_size=block_size, min_ngram=lo, max_ngram=hi)
        self.corpus = corpus
        self.lookup_chances = chances_of(corpus)
        self.name = f"{drafter.name}+lookup" + ("+corpus" if corpus is not None else "")
        self.block_size = max(block_size, drafter.block_size)
        self.target_layer_ids = drafter.target_layer_ids
        self.feature_dim = drafter.feature_dim
        self.vocab_size = drafter.vocab_size
        self.device, self.dtype = drafter.device, drafter.dtype
        self.runtime = drafter.runtime  # features come in the wrapped drafter's runtime
        self.counts = {"lookup": 0, "corpus": 0, "drafter": 0}  # proposals by source since construction
        self.calibration = Calibration()
        self._pending: Draft | None = None  # the last draft chosen under costs, for `calibration`

    @property
    def context_len(self) -> int:
        return self.drafter.context_len

    def describe(self) -> dict[str, Any]:
        """For the result JSON: the wrapped drafter's fields, the corpus, proposals by source so far."""
        inner = self.drafter.describe() if isinstance(self.drafter, Describes) else {}
        corpus = None if self.corpus is None else {"path": self.corpus.source, "cut": self.policy.corpus_cut}
        return inner | {
            "costs": self.policy.describe()["costs"],
            "corpus": corpus,
            "proposals": dict(self.counts),
        }

    def bind(self, verifier: Verifier) -> None:
        self.drafter.bind(verifier)

    def reset(self) -> None:
        self.drafter.reset()
        self.lookup.reset()
        self.calibration.reset()
        self._pending = None

    def extend(self, features: torch.Tensor, tokens: Sequence[int]) -> None:
        if self._pending is not None:  # tokens: the last token and the drafts the verifier accepted
            d = self._pending
            # the drafts of it the step accepted (a tree step may have taken another branch)
            accepted = next((i for i, (x, y) in enumerate(zip(d.tokens, tokens[1:])) if x != y), None)
            accepted = min(len(tokens) - 1, len(d.tokens)) if accepted is None else accepted
            self.calibration.learn(d.source, self.policy.acceptance(d), accepted=accepted)
            self._pending = None
        self.drafter.extend(features, tokens)
        self.lookup.extend(features, tokens)  # lookup ignores the features

    def propose(self, last_token: int, n: int) -> list[int]:
        chosen = self._choose(last_token, n)
        if chosen is None:
            self.counts["drafter"] += 1
            return self.drafter.propose(last_token, min(n, self.drafter.block_size - 1))
        self.counts[chosen.source] += 1
        return chosen.tokens

    def propose_tree(self, last_token: int, depth: int, budget: TreeBudget) -> Tree:
        """Lookup's or the corpus's draft as a branch of its own, and the wrapped drafter's tree (a chain
        where it has none) in what the branch leaves of the budget. A branch that takes the whole budget is
        verified alone, as a chain, however long (what `propose` would verify), and the drafter skipped."""
        chosen = self._choose(last_token, depth)
        branch = chosen.tokens if chosen is not None else []
        if chosen is not None:
            self.counts[chosen.source] += 1  # a tree step with a branch counts for both sources
            if budget.nodes - len(branch) <= 1:
                return Tree.chain(last_token, branch)
        self.counts["drafter"] += 1
        rest = replace(budget, nodes=budget.nodes - len(branch))
        inner = min(depth, self.drafter.block_size - 1)
        if isinstance(self.drafter, TreeProposals):
            tree = self.drafter.propose_tree(last_token, inner, rest)
        else:
            tree = Tree.chain(last_token, self.drafter.propose(last_token, min(inner, rest.nodes - 1)))
        return tree.with_branch(branch)

    def _choose(self, last_token: int, n: int) -> Draft | None:
        """Lookup's or the corpus's draft of up to n tokens as the policy picks it (None: neither)."""
        tokens, g = self.lookup.match(last_token, n)
        chances = lookup_accept(g, len(tokens), self.lookup_chances) if self.policy.costs is not None else []
        looked = Draft(tokens, "lookup", chances)  # lookup's drafts are cut by their chances under costs only
        mined = Draft([], "corpus")
        if self.corpus is not None and (self.policy.costs is not None or not tokens):
            seq = self.lookup._tokens  # the committed tokens; the chain reads the last max_order
            context = [*seq[max(0, len(seq) - self.corpus.max_order + 1) :], last_token]
            chain = self.corpus.chain(context, n)  # [(token, share)], cut by the policy
            mined = Draft([t for t, _ in chain], "corpus", [s for _, s in chain])
        chosen = self.policy.choose(looked, mined, self.calibration)
        self._pending = chosen if chosen is not None and self.policy.costs is not None else None
        return chosen

    def rollback(self, n: int) -> None:
        self._pending = None
        self.drafter.rollback(n)
        self.lookup.rollback(n)

    def memory_probe(self) -> MemoryProbe:
        return self.drafter.memory_probe()
