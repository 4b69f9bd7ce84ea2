"""Prompt-lookup drafting: propose what followed the most recent earlier occurrence of the last n-gram.

No weights and no features, so it runs against any verifier; a useful baseline next to DFlash and the
drafter of the stub demo. An index from n-gram to its latest position makes each proposal O(block).
`LookupFirstDrafter` pairs it with a model drafter: lookup where the text repeats, the model elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

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
