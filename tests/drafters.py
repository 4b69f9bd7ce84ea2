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


CPU = torch.device("cpu")


def scripted_steps(
    drafter, v, ref, *, prompt: Sequence[int], steps: int = 9, k: int = 4, logits=None, atol: float = 1e-4
) -> list:
    """Drive `drafter` through accept-all, accept-none and partial steps and rollbacks, the verifier
    giving the features of what is committed; at each step `ref(tokens, feats, last, k)` (the committed
    history) gives the reference (drafts, logits [k, K]) the drafter's must equal. Returns the drafts."""
    pattern = [k, 0, 2, k, 1, "rollback", 3, 0, k]
    v.reset()
    v.set_target_layers(drafter.target_layer_ids)
    last = v.prefill(prompt)
    feats = v.features(len(prompt), device=CPU, dtype=torch.float32)
    native = v.native_features(len(prompt)) if drafter.runtime == "mlx" else feats
    tokens, history = list(prompt), [feats]
    drafter.reset()
    drafter.extend(native, prompt)
    out = []
    for step in pattern[:steps]:
        want, want_logits = ref(tokens, torch.cat(history), last, k)
        got = drafter.propose(last, k)
        assert got == want, (step, got, want)
        got_logits = (logits or drafter_logits)(drafter, last, k)
        torch.testing.assert_close(got_logits, want_logits, atol=atol, rtol=1e-4)
        out.append((got, got_logits))
        if step == "rollback":  # a stop-string cut or an edited history: 3 committed positions dropped
            v.rollback(3)
            drafter.rollback(3)
            history = [torch.cat(history)[:-3]]
            last, tokens = tokens[-3], tokens[:-3]
            continue
        a = step
        commit = [last, *got[:a]]  # the bonus token and the drafts the step accepts
        target = v.verify(commit)
        feats = v.features(len(commit), device=CPU, dtype=torch.float32)
        native = v.native_features(len(commit)) if drafter.runtime == "mlx" else feats
        drafter.extend(native, commit)
        tokens += commit
        history.append(feats)
        # the next bonus: the verifier's own token unless a partial step must reject the next draft
        last = target[-1] if a == k or target[-1] != got[a] else (got[a] + 1) % 300
    return out


def drafter_logits(drafter, last: int, k: int) -> torch.Tensor:
    """The greedy chain's logits [k, K] over the draft vocabulary (what the tree proposals read)."""
    import numpy as np

    rows = []
    if drafter.runtime == "mlx":
        import mlx.core as mx

        def pick(logits, i):
            rows.append(logits)
            return mx.argmax(logits, axis=-1)

        cols = drafter._chain(last, k, pick)
        drafter._sync(cols, *rows)
        return torch.tensor(np.array(mx.concatenate(rows)))

    def pick_t(logits, i):
        rows.append(logits.float())
        return logits.argmax(-1)

    drafter._chain(last, k, pick_t)
    return torch.cat(rows)


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
