"""The MLX chain drafters' proposals (EAGLE-3 in `eagle3_mlx`, MTP layers in `mtp_mlx`): greedy chains cut
by the draft policy, sampled walks with q at T > 0, trees from the greedy chain's distributions, all over a
subclass's lazy `_chain(last_token, n, pick)` and its one sync `_sync(*arrays)` (which evaluates the
drafter's state with the proposal, so any thread may run the next turn). The rows and their rollback are
`chain.ChainRows`'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from specdec.drafting.chain import ChainRows
from specdec.drafting.dflash_mlx import sample_rows
from specdec.memory import mlx_probe
from specdec.protocols import MemoryProbe
from specdec.tree import TREE_TOPK, Tree, TreeBudget, best_first_of

__all__ = ["MLXChainProposals"]


class MLXChainProposals(ChainRows):
    """`propose`, `propose_walk`, `propose_tree` of an MLX chain drafter (module docstring). A subclass sets
    `rows` (mx.array [K] of target ids, or None), `vocab_size`, `draft_vocab_size`, `block_size`, `policy`."""

    runtime = "mlx"
    walks = True  # each draft depends on the one drawn before it
    rows: mx.array | None = None
    policy: Any
    block_size: int
    vocab_size: int
    draft_vocab_size: int

    def _chain(self, last_token: int, n: int, pick: Callable[[mx.array, int], mx.array]) -> mx.array:
        raise NotImplementedError

    def _sync(self, *arrays: mx.array) -> None:
        raise NotImplementedError

    @property
    def context_len(self) -> int:
        return len(self._tokens)

    def _ids(self, cols: mx.array) -> mx.array:
        return cols if self.rows is None else self.rows[cols]

    def propose(self, last_token: int, n: int) -> list[int]:
        """Up to n greedy drafts after `last_token`, cut by the draft policy (`DraftPolicy.block_cut`)."""
        if not 0 <= n < self.block_size:
            raise ValueError(f"can propose 0..{self.block_size - 1} tokens per step, asked for {n}")
        cut, tops = self.policy.needs_confidence("dflash"), []

        def greedy(logits: mx.array, i: int) -> mx.array:
            if cut:
                tops.append(mx.max(mx.softmax(logits, axis=-1), axis=-1))
            return mx.argmax(logits, axis=-1)

        ids = self._ids(self._chain(last_token, n, greedy))
        top = mx.concatenate(tops) if tops else None
        self._sync(ids, *(() if top is None else (top,)))
        return self.policy.block_cut(ids.tolist(), None if top is None else top.tolist())

    def propose_walk(
        self, last_token: int, n: int, *, temperature: float, u: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """n drafts sampled at `temperature` with uniforms u [n] -> (tokens, q [n, V]) (`SampledWalk`)."""
        us, qs = u.tolist(), []

        def sample(logits: mx.array, i: int) -> mx.array:
            qs.append(mx.softmax(logits / temperature, axis=-1))  # [1, K]
            return sample_rows(qs[-1], us[i])  # [1]

        ids = self._ids(self._chain(last_token, n, sample))
        q = mx.concatenate(qs) if qs else mx.zeros((0, self.draft_vocab_size))
        self._sync(ids, q)
        return ids.tolist(), self._dense(torch.tensor(np.array(q)))

    def _dense(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        if self.rows is None:
            return x
        rows = torch.tensor(np.array(self.rows), dtype=torch.long)
        return x.new_full((x.shape[0], self.vocab_size), fill).index_copy_(1, rows, x)

    def propose_tree(self, last_token: int, depth: int, budget: TreeBudget) -> Tree:
        """A tree of the greedy chain's candidates, best first by path probability (as the torch drafter)."""
        if depth == 0 or budget.nodes == 1:
            return Tree.chain(last_token, [])
        rows: list[mx.array] = []

        def greedy(logits: mx.array, i: int) -> mx.array:
            rows.append(logits)
            return mx.argmax(logits, axis=-1)

        self._chain(last_token, depth, greedy)
        logits = mx.concatenate(rows)  # [depth, K]
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        k = min(TREE_TOPK, budget.nodes - 1, logp.shape[-1])
        cols = mx.argsort(-logp, axis=-1)[:, :k]  # [depth, k], best first
        top = mx.take_along_axis(logp, cols, axis=-1)
        ids = self._ids(cols)
        self._sync(top, ids)
        return best_first_of(last_token, top.tolist(), ids.tolist(), budget)

    def memory_probe(self) -> MemoryProbe:
        return mlx_probe()
