"""The chain drafters' common machinery: EAGLE-3 (`eagle3`) and MTP layers (`mtp`) both draft a chain of
rows, row r pairing the token at position r + 1 with a hidden state of position r.

`ChainDrafter` keeps the fused hidden state of every committed position (the network's `fuse` of the
verifier's features, applied when a proposal needs it) and the network's cache of the rows whose pair is
committed; a proposal computes the rows the cache lacks in one forward, drafts the chain one row at a time
(each row's output, through `readout`, giving the next draft and the hidden state the next row takes),
and drops the chain's rows again, so a rejected draft or a rollback only moves the cache's length. The
network (`model`) offers `fuse(features [n, F]) -> [n, H]`, `rows(cache, emb [T, H], hidden [T, H]) ->
[T, H]` and `readout(out [T, H]) -> (logits [T, K], next hidden)`; its cache a settable `length`.
Greedy chains are cut by the draft policy, sampled walks report q at T > 0 (`SampledWalk`), trees come
from the greedy chain's distributions (`TreeProposals`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdec.drafting.policy import DraftPolicy
from specdec.kernels import MAX_VERIFY_TOKENS
from specdec.protocols import EmbedFn, MemoryProbe
from specdec.sampling import sample_from
from specdec.tree import Tree, TreeBudget, best_first

__all__ = ["ChainDrafter", "ChainRows"]


class ChainRows:
    """Which rows a chain drafter's cache holds, whatever its runtime: the committed tokens, how many of
    their positions are fused, and the token the cache's last row was computed with where it holds it
    (row r pairs the token at r + 1, so the last committed position's row waits for the next token)."""

    _tokens: list[int]
    _n_fused: int
    _tail: int | None

    def _commit(self, tokens: Sequence[int], cache: Any) -> None:
        if self._tail is not None and tokens[0] != self._tail:  # the last row paired another token
            cache.length -= 1
        self._tail = None
        self._tokens += tokens

    def _check_rollback(self, n: int) -> bool:
        """Whether rolling back n positions changes anything (ValueError where n is out of range)."""
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"cannot roll back {n} positions: the drafter holds {len(self._tokens)}")
        return n > 0

    def _uncommit(self, n: int, cache: Any) -> None:
        """Drop the last n committed positions (their fused states already computed)."""
        L = len(self._tokens)
        del self._tokens[L - n :]
        self._n_fused = L - n
        cache.length = min(cache.length, max(L - n - 1, 0))  # row r pairs token r + 1
        self._tail = None


class ChainDrafter(ChainRows):
    """The `Drafter` protocol over a chain network `model` and its `cache` (module docstring)."""

    runtime = "torch"
    walks = True  # each draft depends on the one drawn before it

    def __init__(
        self,
        model: Any,
        cache: Any,
        *,
        name: str,
        policy: DraftPolicy | None,
        block_size: int,
        hidden_size: int,
        vocab_size: int,
        draft_vocab_size: int,
        feature_dim: int,
        target_layer_ids: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        capacity: int = 256,
    ) -> None:
        self.model, self.cache = model, cache
        self.name, self.policy = name, policy or DraftPolicy()
        self.block_size = min(block_size, MAX_VERIFY_TOKENS)
        self.hidden_size, self.vocab_size, self.draft_vocab_size = hidden_size, vocab_size, draft_vocab_size
        self.feature_dim, self.target_layer_ids = feature_dim, target_layer_ids
        self.device, self.dtype = device, dtype
        self.path: str | None = None
        self.rows: torch.Tensor | None = None  # [K] target id of each draft token (None: identity)
        self._fused = torch.zeros(capacity, hidden_size, device=device, dtype=dtype)
        self.embed_fn: EmbedFn | None = None
        self.reset()

    @property
    def context_len(self) -> int:
        return len(self._tokens)

    def reset(self) -> None:
        self.cache.length = 0
        self._tokens: list[int] = []  # committed tokens
        self._pending: list[torch.Tensor] = []  # features [n_i, A*Ht] committed since the last fuse
        self._n_fused = 0  # positions whose fused hidden is in `_fused`
        self._tail: int | None = None  # the token row len-1 was computed with, where the cache holds it

    @torch.inference_mode()
    def extend(self, features: torch.Tensor, tokens: Sequence[int]) -> None:
        if features.dim() != 2 or features.shape != (len(tokens), self.feature_dim):
            raise ValueError(
                f"features must be [{len(tokens)}, {self.feature_dim}], got {list(features.shape)}"
            )
        if tokens:
            self._commit(tokens, self.cache)
            self._pending.append(features)

    def rollback(self, n: int) -> None:
        if self._check_rollback(n):
            self._fuse()
            self._uncommit(n, self.cache)

    def _fuse(self) -> None:
        if self._pending:
            feats = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
            self._pending = []
            n, start = feats.shape[0], self._n_fused
            if start + n > self._fused.shape[0]:
                grow = torch.zeros(
                    max(start + n, 2 * self._fused.shape[0]),
                    self.hidden_size,
                    device=self.device,
                    dtype=self.dtype,
                )
                grow[:start] = self._fused[:start]
                self._fused = grow
            self._fused[start : start + n] = self.model.fuse(feats.to(device=self.device, dtype=self.dtype))
            self._n_fused += n

    # ---- drafting -----------------------------------------------------------------------------------------

    def _catch_up(self, last_token: int) -> torch.Tensor:
        """Compute the rows the cache lacks, the last pairing `last_token`: that row's output [1, H]."""
        self._fuse()
        L = len(self._tokens)
        R = self.cache.length = min(self.cache.length, L - 1)  # a held last row is recomputed: its output
        ids = torch.tensor([*self._tokens[R + 1 :], last_token], device=self.device)  # [L - R]
        out = self.model.rows(self.cache, self.embed_fn(ids), self._fused[R:L])  # [L - R, H]
        self._tail = last_token
        return out[-1:]

    @torch.inference_mode()
    def _chain(
        self, last_token: int, n: int, pick: Callable[[torch.Tensor, int], torch.Tensor]
    ) -> torch.Tensor:
        """n draft columns after `last_token`: `pick(logits [1, K], i)` chooses column i; the chain's rows
        are dropped after. Returns the columns [n] (on the device: no sync)."""
        if n <= 0 or not self._tokens:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        L = len(self._tokens)
        out, cols = self._catch_up(last_token), []
        for i in range(n):
            logits, hidden = self.model.readout(out)
            cols.append(pick(logits, i))  # [1]
            if i + 1 < n:
                ids = cols[-1] if self.rows is None else self.rows[cols[-1]]
                out = self.model.rows(self.cache, self.embed_fn(ids), hidden)
        self.cache.length = L  # the chain's rows paired drafts: not kept
        return torch.cat(cols)

    def _ids(self, cols: torch.Tensor) -> list[int]:
        return (cols if self.rows is None else self.rows[cols]).tolist()  # the one sync of a proposal

    def propose(self, last_token: int, n: int) -> list[int]:
        """Up to n greedy drafts after `last_token`, cut by the draft policy with each draft's top-1 chance
        (`DraftPolicy.block_cut`)."""
        if not 0 <= n < self.block_size:
            raise ValueError(f"can propose 0..{self.block_size - 1} tokens per step, asked for {n}")
        cut, tops = self.policy.needs_confidence("dflash"), []

        def greedy(logits: torch.Tensor, i: int) -> torch.Tensor:
            if cut:
                tops.append(logits.float().softmax(-1).max(-1).values)
            return logits.argmax(-1)

        tokens = self._ids(self._chain(last_token, n, greedy))
        return self.policy.block_cut(tokens, torch.cat(tops).tolist() if cut and tops else None)

    def propose_walk(
        self, last_token: int, n: int, *, temperature: float, u: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """n drafts sampled at `temperature` with uniforms u [n] -> (tokens, q [n, V]: row i the distribution
        draft i was drawn from given drafts 0..i-1)."""
        qs: list[torch.Tensor] = []

        def sample(logits: torch.Tensor, i: int) -> torch.Tensor:
            qs.append((logits.float() / temperature).softmax(-1))  # [1, K]
            return sample_from(qs[-1], u[i : i + 1].to(qs[-1].device))

        tokens = self._ids(self._chain(last_token, n, sample))
        return tokens, self._dense(torch.cat(qs) if qs else torch.zeros(0, self.draft_vocab_size))

    def _dense(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[n, K] over the draft vocabulary -> [n, V] (`fill` elsewhere), on the CPU."""
        x = x.float().cpu()
        if self.rows is None:
            return x
        return x.new_full((x.shape[0], self.vocab_size), fill).index_copy_(1, self.rows.cpu(), x)

    def propose_tree(self, last_token: int, depth: int, budget: TreeBudget) -> Tree:
        """A tree of the greedy chain's candidates, best first by path probability: level j holds the
        likeliest tokens of the chain's distribution at depth j (the distribution given the greedy drafts
        before it, taken as that of every parent: `specdec.tree.best_first`)."""
        rows: list[torch.Tensor] = []

        def greedy(logits: torch.Tensor, i: int) -> torch.Tensor:
            rows.append(logits)
            return logits.argmax(-1)

        self._chain(last_token, depth, greedy)
        logits = torch.cat(rows) if rows else torch.zeros(0, self.draft_vocab_size)
        return best_first(last_token, self._dense(logits, float("-inf")), budget)

    def memory_probe(self) -> MemoryProbe:
        from specdec.memory import probe_for_module

        return probe_for_module(self.model)
