"""Drafters for tests: accept all (oracle), accept none (random), accept a scripted part.

They serve the real Drafter protocol, ask for real target features, and keep what they are handed, so
tests can check that the engine passes exactly the committed positions' features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.memory import probe_for_device
from specdec.protocols import MemoryProbe, Verifier


def greedy_reference(
    verifier: Verifier, prompt: Sequence[int], n: int, stops: Sequence[int] = ()
) -> list[int]:
    """The slow reference: recompute the whole sequence from an empty cache for every token."""
    out: list[int] = []
    verifier.set_target_layers(())
    while len(out) < n:
        verifier.reset()
        out.append(verifier.prefill([*prompt, *out]))
        if out[-1] in stops:
            break
    verifier.reset()
    return out


class ScriptedDrafter:
    """Proposes `reference` (prompt + continuation) except at positions in `wrong_at`, where it proposes
    a different token. With `wrong_at=()` it is an oracle (everything accepted)."""

    name = "scripted"
    runtime = "torch"
    vocab_size = None

    def __init__(
        self,
        reference: Sequence[int],
        *,
        vocab: int,
        wrong_at: Sequence[int] = (),
        block_size: int = 16,
        target_layer_ids: tuple[int, ...] = (),
        hidden_size: int = 0,
    ) -> None:
        self.reference, self.vocab, self.wrong_at = list(reference), vocab, set(wrong_at)
        self.block_size, self.target_layer_ids = block_size, tuple(target_layer_ids)
        self.feature_dim = len(self.target_layer_ids) * hidden_size
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.reset()

    @property
    def context_len(self) -> int:
        return len(self.tokens)

    def bind(self, verifier: Verifier) -> None:
        pass

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.features: list[torch.Tensor] = []  # one [n, K*H] chunk per extend

    def extend(self, features: torch.Tensor, tokens: Sequence[int]) -> None:
        assert features.shape == (len(tokens), self.feature_dim), (features.shape, len(tokens))
        self.tokens += tokens
        self.features.append(features)

    def _token_at(self, pos: int) -> int:
        t = self.reference[pos] if pos < len(self.reference) else 0
        return (t + 1) % self.vocab if pos in self.wrong_at else t

    def propose(self, last_token: int, n: int) -> list[int]:
        start = self.context_len + 1  # last_token sits at context_len
        return [self._token_at(p) for p in range(start, start + n)]

    def rollback(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n :]

    def memory_probe(self) -> MemoryProbe:
        return probe_for_device("cpu")


class RandomDrafter(ScriptedDrafter):
    """Uniform random tokens: with a real verifier practically nothing is accepted."""

    name = "random"

    def __init__(self, *, vocab: int, seed: int = 0, **kw: object) -> None:
        super().__init__([], vocab=vocab, **kw)  # type: ignore[arg-type]
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, last_token: int, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()


def check_acceptance(steps: Sequence, kind: str) -> None:
    """What each test drafter's decode steps must show: an oracle ("all") accepted every draft; a scripted
    part ("part", "gappy") some but not all; "gappy" had steps without drafts between drafted ones."""
    if kind == "all":
        assert all(s.accepted == s.drafted for s in steps)
    if kind in ("part", "gappy"):
        assert 0 < sum(s.accepted for s in steps) < sum(s.drafted for s in steps)
    if kind == "gappy":
        assert any(s.drafted == 0 for s in steps[1:-1])
