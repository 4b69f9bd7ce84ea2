"""The MLX chain drafters' proposals (EAGLE-3 in `eagle3.mlx`, MTP layers in `mtp.mlx`): greedy chains cut
by the draft policy, sampled walks with q at T > 0, trees from the greedy chain's distributions, all over a
subclass's lazy `_chain(last_token, n, pick)` and its one sync `_sync(*arrays)` (which evaluates the
drafter's state with the proposal, so any thread may run the next turn). The rows and their rollback are
`chain.ChainRows`'; the fused states sit in a buffer that doubles as it fills.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from specdec.drafting.chain import ChainRows
from specdec.drafting.layers_mlx import sample_rows
from specdec.memory import mlx_probe
from specdec.protocols import MemoryProbe
from specdec.tree import TREE_TOPK, Tree, TreeBudget, best_first_of

__all__ = ["MLXChainProposals"]


class MLXChainProposals(ChainRows):
    """An MLX chain drafter over its network `model` (`fuse(features [n, F]) -> [n, H]`, `rows(cache, emb
    [T, H], hidden [T, H]) -> [T, H]`, `readout(out) -> (logits, next hidden)`), its `_cache` (a settable
    `length`, `arrays()` to evaluate) and a fused-state buffer `_fused` [capacity, H] (module docstring). A
    subclass sets those, `_embed`, `rows` (mx.array [K] of target ids, or None), `feature_dim`,
    `vocab_size`, `draft_vocab_size`, `block_size` and `policy`, then calls `reset`."""

    runtime = "mlx"
    walks = True  # each draft depends on the one drawn before it
    rows: mx.array | None = None
    model: Any
    _cache: Any
    _fused: mx.array
    _embed: Callable[[mx.array], mx.array]
    feature_dim: int
    policy: Any
    block_size: int
    vocab_size: int
    draft_vocab_size: int

    def reset(self) -> None:
        self._cache.length = 0
        self._tokens: list[int] = []
        self._pending: list[mx.array] = []
        self._n_fused = 0
        self._tail: int | None = None

    def extend(self, features: mx.array, tokens: Sequence[int]) -> None:
        """Append committed positions: features [n, A*Ht] (an mx.array from the MLX verifier)."""
        if features.ndim != 2 or tuple(features.shape) != (len(tokens), self.feature_dim):
            raise ValueError(
                f"features must be [{len(tokens)}, {self.feature_dim}], got {list(features.shape)}"
            )
        if tokens:
            self._commit(tokens, self._cache)
            mx.eval(features)  # a lazy slice of this thread's arrays: another thread may fuse it
            self._pending.append(features)

    def rollback(self, n: int) -> None:
        if self._check_rollback(n):
            self._fuse()
            mx.eval(self._fused)
            self._uncommit(n, self._cache)

    def _fuse(self) -> None:
        if not self._pending:
            return
        feats = mx.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        n, start = feats.shape[0], self._n_fused
        while start + n > self._fused.shape[0]:
            self._fused = mx.concatenate([self._fused, mx.zeros_like(self._fused)])
        self._fused[start : start + n] = self.model.fuse(feats)
        self._n_fused += n

    def _chain(self, last_token: int, n: int, pick: Callable[[mx.array, int], mx.array]) -> mx.array:
        """n draft columns after `last_token`, lazy [n]; `pick(logits [1, K], i)` chooses column i. The
        chain's rows are dropped after; the cache is evaluated with the columns by the caller's sync."""
        if n <= 0 or not self._tokens:
            return mx.zeros((0,), dtype=mx.int32)
        self._fuse()
        L, cache = len(self._tokens), self._cache
        R = cache.length = min(cache.length, L - 1)
        ids = mx.array([*self._tokens[R + 1 :], last_token], dtype=mx.int32)
        out = self.model.rows(cache, self._embed(ids), self._fused[R:L])[-1:]
        self._tail = last_token
        cols = []
        for i in range(n):
            logits, hidden = self.model.readout(out)
            cols.append(pick(logits.astype(mx.float32), i))  # [1]
            if i + 1 < n:
                tok = cols[-1] if self.rows is None else self.rows[cols[-1]]
                out = self.model.rows(cache, self._embed(tok), hidden)
        cache.length = L
        return mx.concatenate(cols)

    def _sync(self, *arrays: mx.array) -> None:
        mx.eval(*arrays, self._cache.arrays(), self._fused)  # the one sync of a proposal

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
