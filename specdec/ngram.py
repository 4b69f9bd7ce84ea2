"""Prompt-lookup drafting: propose what followed the most recent earlier occurrence of the last n-gram.

No weights and no features, so it runs against any verifier; a useful baseline next to DFlash and the
drafter of the stub demo. An index from n-gram to its latest position makes each proposal O(block).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.memory import probe_for_device
from specdec.protocols import MemoryProbe, Verifier


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
