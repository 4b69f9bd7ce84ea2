"""Tree proposals: several candidate continuations verified in one call (DDTree, Ringel & Romano 2026).

A `Tree` is the last committed token (node 0, the root) and draft nodes in an order where every parent
comes before its children. A verifier that has `specdec.protocols.TreeVerify` runs all nodes in one
forward, node i at position `root + depth[i]`, attending over the cached context and its own ancestors
only (`specdec.kernels.TreeAttention`), and returns its own token after each node. The step accepts the
longest root path whose every node's token is the verifier's token after its parent (`Tree.accept`),
keeps exactly that path in the cache (`TreeVerify.keep_path`) and commits it plus the verifier's token
after its last node. At
T > 0 the verifier's token at a node is sampled with the uniform of the node's position, as the chain's
`match` rule does, so the committed text is the one plain sampling gives with the same seed.

`best_first` builds the tree from a block drafter's per-position distributions: nodes in order of the
probability of their path (the product of their tokens' probabilities at their depths), as DDTree does,
up to a node budget, or, with verify costs, up to the size where the expected committed tokens per unit
of verify cost is highest.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["TREE_AUTO_NODES", "TREE_TOPK", "Tree", "TreeBudget", "best_first", "best_first_of"]

#: the most nodes `--tree auto` considers (a 2-core CPU's verify costs rule out far fewer)
TREE_AUTO_NODES = 32

#: candidates per block position a tree may branch into (DDTree's trees of <= 64 nodes rarely use more)
TREE_TOPK = 8


@dataclass(frozen=True)
class Tree:
    """tokens[0] is the root (the last committed token), parents[0] == -1 and parents[i] < i; ranks[i]:
    the candidate rank of node i's token at its depth (0: the drafter's top-1); probs[i]: the drafter's
    probability of the path to node i (1 for the root)."""

    tokens: list[int]
    parents: list[int]
    ranks: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tokens or len(self.parents) != len(self.tokens) or self.parents[0] != -1:
            raise ValueError("a tree needs a root (parents[0] == -1) and one parent per node")
        if any(not 0 <= p < i for i, p in enumerate(self.parents[1:], 1)):
            raise ValueError(f"every parent must come before its child, got parents {self.parents}")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        d = [0] * len(self.parents)
        for i, p in enumerate(self.parents[1:], 1):
            d[i] = d[p] + 1
        return d

    @classmethod
    def chain(cls, root: int, draft: Sequence[int]) -> Tree:
        """A chain: the root and `draft`, each node the child of the one before."""
        n = len(draft)
        return cls([root, *draft], list(range(-1, n)), [0] * (n + 1), [1.0] * (n + 1))

    def path(self, node: int) -> list[int]:
        """The nodes from the root down to `node` (both included)."""
        path = [node]
        while (p := self.parents[path[-1]]) >= 0:
            path.append(p)
        return path[::-1]

    def _children(self) -> dict[tuple[int, int], int]:
        """(parent, token) -> node; the first-listed child wins a (never useful) tie."""
        return {(p, t): i for i, (p, t) in reversed(list(enumerate(zip(self.parents, self.tokens))))}

    def accept(self, target: Sequence[int]) -> list[int]:
        """The accepted path (node indices, root first): from the root, descend to the child whose token is
        the verifier's token after the current node (`target[node]`) while there is one."""
        children, path = self._children(), [0]
        while (nxt := children.get((path[-1], target[path[-1]]))) is not None:
            path.append(nxt)
        return path

    def accept_along(self, tokens: Sequence[int]) -> list[int]:
        """The path accepted where the verifier's tokens after the root are `tokens` (greedy replay): the
        verifier's token after a node at depth d is tokens[d], none past their end."""
        return self.accept([tokens[d] if d < len(tokens) else -1 for d in self.depths])

    def with_branch(self, draft: Sequence[int]) -> Tree:
        """This tree plus the chain `draft` below the root (nodes it shares with the tree are reused)."""
        tokens, parents = list(self.tokens), list(self.parents)
        ranks = self.ranks or [0] * len(tokens)
        probs = self.probs or [1.0] * len(tokens)
        ranks, probs = list(ranks), list(probs)
        index = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}
        node = 0
        for t in draft:
            if (node, t) not in index:
                index[node, t] = len(tokens)
                tokens.append(t)
                parents.append(node)
                ranks.append(-1)  # not one of the block drafter's candidates
                probs.append(probs[node])
            node = index[node, t]
        return Tree(tokens, parents, ranks, probs)


class Costs(Protocol):
    """A verify cost table (`specdec.costs.VerifyCosts`)."""

    def cost(self, b: int) -> float:
        """A verify of b rows, in one-row verifies."""
        ...


@dataclass(frozen=True)
class TreeBudget:
    """At most `nodes` verify rows (the root included); with `costs`, fewer where the expected committed
    tokens per unit of verify cost peak earlier (`--tree auto`)."""

    nodes: int
    costs: Costs | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"a tree needs at least 1 node (the root), got {self.nodes}")


def best_first(root: int, logits: torch.Tensor, budget: TreeBudget) -> Tree:
    """The tree of up to `budget.nodes` nodes from a block drafter's logits [D, V] (row j: its
    distribution of the token at depth j + 1, the same under every parent), nodes taken in order of path
    probability. Every prefix of that order is a tree; with costs the prefix kept is the one with the most
    expected committed tokens (1 + the sum of its path probabilities) per unit of verify cost."""
    if logits.shape[0] == 0 or budget.nodes == 1:
        return Tree.chain(root, [])
    k = min(TREE_TOPK, budget.nodes - 1, logits.shape[-1])
    top = logits.float().log_softmax(-1).topk(k, dim=-1)  # [D, k] each
    return best_first_of(root, top.values.tolist(), top.indices.tolist(), budget)  # the one sync


def best_first_of(
    root: int, logp: Sequence[Sequence[float]], ids: Sequence[Sequence[int]], budget: TreeBudget
) -> Tree:
    """`best_first` from each depth's candidates: log-probabilities and ids, best first ([D][k] each)."""
    D, k = len(logp), min(len(logp[0]) if logp else 0, max(budget.nodes - 1, 0))
    if D == 0 or k == 0:
        return Tree.chain(root, [])
    tokens, parents, ranks, scores = [root], [-1], [0], [0.0]
    heap = [(-logp[0][0], 0, 1, 0)]  # (-path log-prob, parent, depth, rank)
    while heap and len(tokens) < budget.nodes:
        neg, parent, depth, rank = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        ranks.append(rank)
        scores.append(-neg)
        if depth < D:  # its best child
            heapq.heappush(heap, (neg - logp[depth][0], node, depth + 1, 0))
        if rank + 1 < k:  # its next sibling
            heapq.heappush(heap, (-scores[parent] - logp[depth - 1][rank + 1], parent, depth, rank + 1))
    probs = [math.exp(s) for s in scores]
    n = len(tokens)
    if budget.costs is not None:  # the prefix with the most expected committed tokens per verify cost
        cost = budget.costs.cost
        keep, best, expected = 0, 1.0 / cost(1), 1.0
        for m in range(1, n):
            expected += probs[m]
            if expected / cost(m + 1) > best:
                keep, best = m, expected / cost(m + 1)
        n = keep + 1
    return Tree(tokens[:n], parents[:n], ranks[:n], probs[:n])
