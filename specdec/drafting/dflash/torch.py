"""The PyTorch DFlash drafter: the `Drafter` the engine talks to, over `dflash.model.DFlashDraftModel`.

It keeps the context K/V of every layer in a `DFlashCache`: `extend` queues the new positions' features
and the next proposal projects them, `rollback` moves the length pointer back, and a proposal costs one
forward over the block against the cached K/V. The only host sync of a proposal is the final `.tolist()`
of the proposed ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdec.drafting.dflash.config import (
    DFlashConfig,
    check_target,
    load_config,
    load_state_dict,
    save_checkpoint,
)
from specdec.drafting.dflash.dflash2 import Walk
from specdec.drafting.dflash.model import DFlashCache, DFlashDraftModel
from specdec.drafting.policy import DraftPolicy
from specdec.kernels import use_cpu_linears
from specdec.protocols import EmbedFn, LMHeadFn, MemoryProbe
from specdec.tree import Tree, TreeBudget, best_first

if TYPE_CHECKING:
    from specdec.protocols import Verifier

__all__ = ["DFlashCache", "DFlashConfig", "DFlashDraftModel", "DFlashDrafter"]


class DFlashDrafter:
    """The `Drafter` protocol over a DFlash model: its context cache, the block it drafts and where the draft
    is cut. `bind(verifier)` (or `bind_fns`) before `extend` / `propose`.

    Committed features are projected into the context cache when a proposal needs them, all at once:
    behind `+lookup` most steps draft without DFlash, and projecting every commit cost ~1.7 ms of a ~50 ms
    step on a 2-core CPU. A proposal always runs the whole block (what the model was trained on) and keeps
    the first n tokens, cut by the draft policy."""

    runtime = "torch"

    def __init__(
        self,
        model: DFlashDraftModel,
        *,
        name: str = "dflash",
        policy: DraftPolicy | None = None,
        capacity: int = 256,
    ) -> None:
        """`policy`: where each greedy block is cut (`DraftPolicy`: by the running top-1 probability, or
        by verify cost); the default proposes whole blocks. `capacity`: context positions the cache holds
        before it first grows."""
        self.policy = policy or DraftPolicy()
        self.model = model.eval()
        use_cpu_linears(model)  # on a CPU: a block costs much less (see specdec.kernels)
        self.cfg = cfg = model.cfg
        self.name = name
        self.block_size = cfg.block_size
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.feature_dim = cfg.feature_dim
        self.vocab_size: int | None = cfg.vocab_size
        self.mask_token_id = cfg.mask_token_id
        self.device, self.dtype = model.device, model.dtype
        self.path: str | None = None  # the checkpoint folder it was loaded from
        self.rows = model.draft_vocab  # [K] or None
        self.d2 = cfg.dflash2  # DFlash2's read-out and selector, or None
        self.ds = cfg.dspark  # DSpark's Markov and confidence heads, or None
        # the block position of the first proposal: 1 (after the bonus), 0 for DSpark drafting from it
        self._off = 1 if self.ds is None else self.ds.offset
        # the mask token is never proposed (DFlash2 and DSpark keep their references' read-outs as they are)
        self._mask_col = cfg.mask_column if self.d2 is None and self.ds is None else None
        self.cache = DFlashCache(cfg, device=model.device, dtype=model.dtype, capacity=capacity)
        # [bs] the block ids [bonus, MASK...] (DSpark from the anchor: one fewer); slot 0 changes per proposal
        self._block_ids = torch.full(
            (cfg.block_size - 1 + self._off,), cfg.mask_token_id, dtype=torch.long, device=self.device
        )
        self._pending: list[torch.Tensor] = []  # features [n_i, K*H] committed since the last projection
        self.embed_fn: EmbedFn | None = None
        self.lm_head_fn: LMHeadFn | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        policy: DraftPolicy | None = None,
        config: DFlashConfig | None = None,
    ) -> DFlashDrafter:
        """Load a public-format checkpoint folder (config.json + model.safetensors); `config`: its config
        as read already (`registry.read_checkpoint`), so the folder's config is read once per run."""
        cfg = config or load_config(path)
        state = load_state_dict(path, cfg)
        with torch.device("meta"):
            model = DFlashDraftModel(cfg)
        model.load_state_dict(state, strict=True, assign=True)  # names/shapes already checked
        model = model.to(device=device, dtype=dtype)
        drafter = cls(model, name=Path(path).name, policy=policy)
        drafter.path = str(path)
        return drafter

    def describe(self) -> dict[str, Any]:
        """For the result JSON (`specdec.protocols.Describes`): where it was loaded from, DFlash or DFlash2,
        and its cut."""
        return {"path": self.path, "architecture": self.cfg.architecture, **self.policy.describe()}

    def save_pretrained(self, path: str | Path) -> Path:
        """Write this drafter's config + weights in the public format."""
        return save_checkpoint(path, self.cfg, self.model.state_dict())

    # ---- binding and the context ----------------------------------------------------------------------

    def bind(self, verifier: Verifier) -> None:
        check_target(self.cfg, verifier, name=self.name)
        embed = self.model.embed_tokens or verifier.embed_fn(device=self.device, dtype=self.dtype)
        if self.cfg.own_lm_head:  # a speculators checkpoint's own head: [..., K]
            head = self.model.lm_head
        else:
            head = verifier.lm_head_fn(
                device=self.device, dtype=self.dtype, rows=self.rows
            )  # [..., K] (or V)
        self.bind_fns(embed, head, over_draft_vocab=True)

    def bind_fns(self, embed_fn: EmbedFn, lm_head_fn: LMHeadFn, *, over_draft_vocab: bool = False) -> None:
        """Bind the embedding / LM head callbacks directly (no verifier checks). `lm_head_fn` maps to the
        full vocabulary unless `over_draft_vocab` (then to the model's draft vocabulary, as the verifiers'
        `lm_head_fn(rows=...)` build it, which skips the unused rows)."""
        rows = self.rows
        if rows is not None and not over_draft_vocab:
            full_head = lm_head_fn

            def lm_head_fn(h: torch.Tensor) -> torch.Tensor:
                return full_head(h).index_select(-1, rows)  # [..., K]

        self.embed_fn, self.lm_head_fn = embed_fn, lm_head_fn
        self.reset()

    def _bound(self) -> None:
        if self.embed_fn is None:
            raise RuntimeError(f"drafter {self.name!r} is not bound: call bind(verifier) first")

    @property
    def context_len(self) -> int:
        return self.cache.length + sum(f.shape[0] for f in self._pending)

    def reset(self) -> None:
        self.cache.crop(0)
        self._pending = []

    @torch.inference_mode()
    def extend(self, features: torch.Tensor, tokens: Sequence[int]) -> None:
        """Append committed positions: features [n, K*H] (projected by the next proposal); DFlash conditions
        on the features only, the tokens are not needed."""
        self._bound()
        if features.shape[0] != len(tokens):
            raise ValueError(
                f"extend got features for {features.shape[0]} positions but {len(tokens)} tokens"
            )
        if features.dim() != 2 or features.shape[1] != self.cfg.feature_dim:
            raise ValueError(
                f"features must be [n, {self.cfg.feature_dim}] (K={self.cfg.num_target_features} x "
                f"H={self.cfg.hidden_size}), got {list(features.shape)}"
            )
        if features.shape[0]:
            self._pending.append(features)

    def rollback(self, n: int) -> None:
        self._bound()
        if not 0 <= n <= self.context_len:
            raise ValueError(f"cannot roll back {n} positions: the drafter holds {self.context_len}")
        self._project()
        self.cache.crop(self.cache.length - n)

    @torch.inference_mode()
    def _project(self) -> None:
        if self._pending:
            feats = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending)  # [n, K*H]
            self._pending = []
            self.model.extend_cache(self.cache, feats.to(device=self.device))

    # ---- the block -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def block_hidden(self, last_token: int) -> torch.Tensor:
        """Hidden states [bs, H] of the block [last_token, MASK...] with `last_token` at context_len."""
        self._bound()
        self._project()
        self._block_ids[0] = last_token  # a device-side fill: no host sync
        emb = self.embed_fn(self._block_ids)[None]  # [1, bs, H]
        if self.d2 is not None and self.d2.input_embedding_scale != 1.0:
            emb = emb * self.d2.input_embedding_scale
        return self.model.forward_cached(self.cache, emb)[0]  # [bs, H]

    @torch.inference_mode()
    def block_logits(self, last_token: int, n: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, K] over the draft vocabulary (K = V without one) of block positions 1..n (DSpark
        from the anchor: 0..n-1), the mask token at -inf (DFlash2: times its output multiplier,
        soft-capped), with `last_token` at context_len; `hidden` [bs, H] when `block_hidden` was run."""
        hidden = self.block_hidden(last_token) if hidden is None else hidden
        logits = self.lm_head_fn(hidden[self._off : self._off + n])  # [n, K]
        if self.d2 is not None:
            logits = logits * self.d2.output_multiplier
            cap = self.d2.final_logit_softcapping
            return logits if cap is None else torch.tanh(logits / cap) * cap
        if self._mask_col is not None and self._mask_col < logits.shape[-1]:
            logits[:, self._mask_col] = float("-inf")
        return logits

    @torch.inference_mode()
    def walk(
        self, last_token: int, n: int, *, temperature: float = 0.0, u: torch.Tensor | None = None
    ) -> Walk:
        """DFlash2: the candidate selector's walk over block positions 1..n (greedy, or sampled at
        `temperature` with uniforms u [n])."""
        hidden = self.block_hidden(last_token)  # [bs, H]
        logits = self.block_logits(last_token, n, hidden)  # [n, V]
        return self.model.candidate_selector.walk(
            hidden[1 : n + 1], logits, last_token, temperature=temperature, u=u
        )

    def vocab_logits(self, last_token: int, n: int) -> torch.Tensor:
        """Logits [n, V] over the full vocabulary: ids outside the draft vocabulary at -inf."""
        logits = self.block_logits(last_token, n)  # [n, K]
        if self.rows is None:
            return logits
        full = logits.new_full((n, self.cfg.vocab_size), float("-inf"))  # [n, V]
        return full.index_copy_(1, self.rows, logits)

    # ---- proposals -------------------------------------------------------------------------------------

    def propose(self, last_token: int, n: int) -> list[int]:
        """Up to n greedy tokens after `last_token` (DFlash2: the selector's greedy walk), cut by the draft
        policy with the block's own chances (`DraftPolicy.block_cut`, as the MLX drafter cuts)."""
        if not 0 <= n < self.block_size:
            raise ValueError(f"can propose 0..{self.block_size - 1} tokens per block, asked for {n}")
        if n == 0:
            return []
        cut = self.policy.needs_confidence("dflash")
        if self.ds is not None:
            tokens, chances, _ = self.dspark_walk(last_token, n)
            return self.policy.block_cut(tokens.tolist(), chances.tolist() if cut else None)
        if self.d2 is not None:
            walk = self.walk(last_token, n)
            return self.policy.block_cut(walk.tokens.tolist(), walk.chances().tolist() if cut else None)
        logits = self.block_logits(last_token, n)  # [n, K]
        if cut:
            top, best = logits.float().softmax(dim=-1).max(dim=-1)  # [n], [n] columns
        else:
            best = logits.argmax(dim=-1)  # [n] columns
        if self.rows is not None:
            best = self.rows[best]  # [n] vocabulary ids
        tokens = best.tolist()  # the one sync of a proposal (the chances are computed by now)
        return self.policy.block_cut(tokens, top.tolist() if cut else None)

    def propose_logits(self, last_token: int, n: int) -> torch.Tensor:
        """Logits [n, V] of the next n positions, for sampled proposals at temperature > 0."""
        return self.vocab_logits(last_token, n)

    def propose_tree(self, last_token: int, depth: int, budget: TreeBudget) -> Tree:
        """A tree of the block's candidates, best first by path probability (`specdec.tree.best_first`)."""
        return best_first(last_token, self.vocab_logits(last_token, depth), budget)  # [depth, V]

    @torch.inference_mode()
    def dspark_walk(
        self, last_token: int, n: int, *, temperature: float = 0.0, u: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """DSpark: the Markov head's walk over the block's n proposals (`dspark.markov_walk`)."""
        from specdec.drafting.dflash.dspark import markov_walk

        hidden = self.block_hidden(last_token)  # [bs, H]
        logits = self.block_logits(last_token, n, hidden)  # [n, V]
        rows = hidden[self._off : self._off + n]
        return markov_walk(self.model, rows, logits, last_token, temperature=temperature, u=u)

    @property
    def walks(self) -> bool:
        """DFlash2 and DSpark: sampled proposals are a walk (`propose_walk`), not independent rows."""
        return self.d2 is not None or self.ds is not None

    def propose_walk(
        self, last_token: int, n: int, *, temperature: float, u: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """DFlash2 at temperature > 0: the selector's walk sampled with uniforms u [n] -> (tokens, q [n, V],
        each row the distribution its token was drawn from given the tokens before it)."""
        if self.ds is not None:
            tokens, _, q = self.dspark_walk(last_token, n, temperature=temperature, u=u)
            return tokens.tolist(), q.float().cpu()
        walk = self.walk(last_token, n, temperature=temperature, u=u)
        return walk.tokens.tolist(), walk.dense(self.cfg.vocab_size)

    def memory_probe(self) -> MemoryProbe:
        from specdec.memory import probe_for_module

        return probe_for_module(self.model)
