"""Drafters for tests: accept all (oracle), accept none (random), accept a scripted part.

They serve the real Drafter protocol, ask for real target features, and keep what they are handed, so
tests can check that the engine passes exactly the committed positions' features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.memory import probe_for_device
from specdec.protocols import MemoryProbe, Verifier
from specdec.tree import Tree, TreeBudget


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


def assert_turns_equal_fresh_runs(v: Verifier, drafter, prompt: Sequence[int], fresh) -> None:
    """A streaming engine's turns (the first, a continued history, then an edited one the drafter and the
    verifier roll back over) each equal `fresh(ids)`: a run of 12 tokens from nothing."""
    from specdec.stream import StreamingEngine

    engine = StreamingEngine(v, drafter)
    r1 = engine.complete(list(prompt), max_tokens=12, stop_token_ids=frozenset())
    continued = [*prompt, *r1.output_tokens, 7, 8]
    assert engine.complete(continued, max_tokens=12, stop_token_ids=frozenset()).output_tokens == fresh(
        continued
    )
    edited = [*prompt[:12], 9, 9, 9]
    assert engine.complete(edited, max_tokens=12, stop_token_ids=frozenset()).output_tokens == fresh(edited)


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


class TreeDrafter(ScriptedDrafter):
    """Trees for tests (`specdec.protocols.TreeProposals`): the scripted chain (wrong at `wrong_at`), the
    reference continuation as a second branch from where the chain first goes wrong (a branch that wins
    in the middle), then random nodes under random parents up to the budget. `random_only`: the random
    nodes alone (practically nothing accepted)."""

    name = "tree"

    def __init__(self, reference: Sequence[int], *, vocab: int, seed: int = 0, random_only: bool = False,
                 **kw: object) -> None:  # fmt: skip
        super().__init__(reference, vocab=vocab, **kw)  # type: ignore[arg-type]
        self.gen = torch.Generator().manual_seed(seed)
        self.random_only = random_only

    def propose_tree(self, last_token: int, depth: int, budget: TreeBudget) -> Tree:
        start = self.context_len + 1
        tokens, parents, ranks = [last_token], [-1], [0]

        def add(parent: int, token: int, rank: int) -> int:
            if len(tokens) >= budget.nodes:
                return -1
            tokens.append(token)
            parents.append(parent)
            ranks.append(rank)
            return len(tokens) - 1

        if not self.random_only:
            span = range(start, start + depth)
            node, right = 0, [self.reference[p] if p < len(self.reference) else 0 for p in span]
            chain = [self._token_at(p) for p in range(start, start + depth)]
            for t in chain:
                node = add(node, t, 0) if node >= 0 else -1
            w = next((i for i, (a, b) in enumerate(zip(chain, right)) if a != b), None)
            node = w  # the chain's node before its first wrong token (node index == depth on the chain)
            for t in right[w:] if w is not None else []:
                node = add(node, t, 1) if node is not None and node >= 0 else -1
        depths = Tree(tokens, parents).depths
        while len(tokens) < budget.nodes:
            parent = int(torch.randint(0, len(tokens), (1,), generator=self.gen))
            if depths[parent] < depth:
                add(parent, int(torch.randint(0, self.vocab, (1,), generator=self.gen)), 2)
                depths.append(depths[parent] + 1)
            elif all(d >= depth for d in depths):
                break
        return Tree(tokens, parents, ranks, [1.0] * len(tokens))
