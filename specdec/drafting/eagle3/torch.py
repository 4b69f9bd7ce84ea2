"""The EAGLE-3 drafter in PyTorch (arXiv 2503.01840): one (or a few) decoder layers that draft a chain.

Row r of the draft model pairs the token at position r + 1 with the verifier's hidden states at position
r: three auxiliary hidden states (`eagle3.config`: which ones) fused by `fc` into one [H] vector. Layer 0
attends over concat(input_layernorm(embedding), hidden_norm(fused)) with the fused vector as its residual
(or its normed form, `norm_before_residual`); later layers are plain pre-norm layers. The final `norm` and
the drafter's own `lm_head` over its draft vocabulary give the token at position r + 2, mapped to target
ids by `d2t`. Drafting a chain feeds each row's output (before `norm`, or after it with `norm_output`)
back as the next row's hidden state, with the token just drafted. RoPE positions are r + 1, as
speculators trains and mlx-vlm drafts (vLLM uses r: attention sees only differences).

`Eagle3Drafter` is a `chain.ChainDrafter` over the network and its K/V cache (`Eagle3Cache`): the rows
whose pair is committed are kept, a proposal computes those it lacks in one forward, drafts the chain a row
at a time and drops the chain's rows again, so a rollback only moves pointers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafting.chain import ChainDrafter
from specdec.drafting.eagle3.config import Eagle3Config, check_eagle3, draft_vocab, load_eagle3_weights
from specdec.drafting.layers import RMSNorm, apply_rope, attend, rope_cos_sin
from specdec.drafting.policy import DraftPolicy
from specdec.drafting.rope import rope_frequencies
from specdec.kernels import use_cpu_linears
from specdec.protocols import EmbedFn
from specdec.tree import Tree, TreeBudget, best_first

if TYPE_CHECKING:
    from specdec.protocols import Verifier

__all__ = ["Eagle3Cache", "Eagle3Drafter", "Eagle3Model", "PEagleDrafter"]


class _Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, in_dim: int) -> None:
        super().__init__()
        D, bias = cfg.head_dim, cfg.attention_bias
        self.nh, self.nkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(in_dim, self.nh * D, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.nkv * D, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.nkv * D, bias=bias)
        self.o_proj = nn.Linear(self.nh * D, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: Any) -> torch.Tensor:
        """x [1, T, in] -> [1, T, H]; `kv(k, v)` stores the new rows' keys / values and returns all keys,
        values and the mask the queries attend with."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.D)
        k = self.k_proj(x).view(B, T, self.nkv, self.D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), *rope), apply_rope(k.transpose(1, 2), *rope)  # [1, n, T, D]
        v = self.v_proj(x).view(B, T, self.nkv, self.D).transpose(1, 2)
        keys, values, mask = kv(k, v)
        out = attend(q, keys, values, mask)  # [1, nh, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, index: int) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.first = index == 0
        self.self_attn = _Attention(cfg, 2 * H if self.first else H)
        self.mlp = _MLP(cfg)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps) if self.first else None
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, h: torch.Tensor, emb: torch.Tensor | None, rope: Any, kv: Any) -> torch.Tensor:
        if self.first:  # attends over concat(normed embedding, normed hidden); the hidden is the residual
            normed = self.hidden_norm(h)
            x = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # [1, T, 2H]
            h = (normed if self.norm_before_residual else h) + self.self_attn(x, rope, kv)
        else:
            h = h + self.self_attn(self.input_layernorm(h), rope, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Cache:
    """Each draft layer's keys / values [1, nkv, cap, D] and the rows held (`length`), gpt-fast style."""

    def __init__(self, cfg: Eagle3Config, *, device: torch.device, dtype: torch.dtype, capacity: int) -> None:
        self.cfg, self.length = cfg, 0
        shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]

    def reserve(self, n: int) -> None:
        cap = self.k[0].shape[2]
        if n > cap:
            grow = lambda b: torch.cat([b, torch.zeros_like(b[:, :, : max(n, 2 * cap) - cap])], 2)  # noqa: E731
            self.k, self.v = [grow(b) for b in self.k], [grow(b) for b in self.v]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Write the new rows' k, v [1, nkv, T, D] after `length`: the keys / values they attend over and
        their mask [1, T, S] (None: all visible)."""
        S0, T = self.length, k.shape[2]
        self.k[layer][:, :, S0 : S0 + T] = k
        self.v[layer][:, :, S0 : S0 + T] = v
        S = S0 + T
        window = self.cfg.sliding_window if layer in self.cfg.sliding_layers else None
        mask = None
        if T > 1 or (window is not None and window < S):
            q = torch.arange(S0, S, device=k.device)[:, None]
            key = torch.arange(S, device=k.device)[None]
            vis = key <= q
            mask = (vis & (q - key < window) if window is not None else vis)[None]  # [1, T, S]
        return self.k[layer][:, :, :S], self.v[layer][:, :, :S], mask


class Eagle3Model(nn.Module):
    """The EAGLE-3 draft network (speculators parameter names). `rows` runs new rows against a cache."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.feature_dim, H, bias=False)
        self.input_norm = RMSNorm(cfg.feature_dim, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        n = cfg.num_aux if cfg.fc_norm else 0
        self.fc_norm = nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(n)])
        self.layers = nn.ModuleList([_Layer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if cfg.has_embed else None
        if cfg.parallel_mask_token_id is not None:  # P-EAGLE: what its parallel rows take as features
            self.mask_hidden = nn.Parameter(torch.zeros(1, 1, cfg.feature_dim))
        self._inv, self.rope_scale = rope_frequencies(cfg)
        self._inv_freq: torch.Tensor | None = None  # [D/2] fp32 on the rows' device (kept out of .to())

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [n, A*Ht] (the aux hidden states, concatenated) -> the fused hidden [n, H]."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if len(self.fc_norm):
            parts = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts, strict=True)], dim=-1)
        return self.fc(features)

    def rows(self, cache: Eagle3Cache, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """New rows after the cache's: embeddings and hidden states [T, H] -> outputs [T, H] (before
        `norm`); the cache then holds them."""
        T = emb.shape[0]
        cache.reserve(cache.length + T)
        if self._inv_freq is None or self._inv_freq.device != emb.device:
            self._inv_freq = torch.tensor(self._inv, dtype=torch.float32, device=emb.device)
        pos = torch.arange(cache.length + 1, cache.length + 1 + T, device=emb.device)
        rope = rope_cos_sin(pos[None], self._inv_freq, emb.dtype, self.rope_scale)
        h, e = hidden[None], emb[None]
        for i, layer in enumerate(self.layers):
            h = layer(h, e, rope, lambda k, v, i=i: cache.store(i, k, v))
        cache.length += T
        return h[0]

    def readout(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's output [T, H] -> (logits [T, K] over the draft vocabulary, the hidden the next row of a
        chain takes)."""
        normed = self.norm(out)
        return self.lm_head(normed), normed if self.cfg.norm_output else out


class Eagle3Drafter(ChainDrafter):
    """The `Drafter` protocol over an `Eagle3Model` (`chain.ChainDrafter`): greedy chains cut by the draft
    policy, sampled walks with q at T > 0, trees from the greedy chain's distributions."""

    def __init__(
        self,
        model: Eagle3Model,
        *,
        name: str = "eagle3",
        policy: DraftPolicy | None = None,
        block_size: int | None = None,
        capacity: int = 256,
    ) -> None:
        """`block_size`: drafts per step + 1 (default the checkpoint's); `capacity`: rows the cache holds
        before it first grows."""
        model = model.eval().requires_grad_(False)
        use_cpu_linears(model)
        self.cfg = cfg = model.cfg
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        super().__init__(
            model,
            Eagle3Cache(cfg, device=device, dtype=dtype, capacity=capacity),
            name=name,
            policy=policy,
            block_size=block_size or cfg.block_size,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=cfg.draft_vocab_size,
            feature_dim=cfg.feature_dim,
            target_layer_ids=cfg.target_layer_ids if cfg.aux_layer_ids else (),
            device=device,
            dtype=dtype,
            capacity=capacity,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        cfg: Eagle3Config,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        policy: DraftPolicy | None = None,
        block_size: int | None = None,
    ) -> Eagle3Drafter:
        """Load a checkpoint folder read by `eagle3.config.read_eagle3` (config `cfg`)."""
        state = load_eagle3_weights(path, cfg)
        d2t = state.pop("d2t", None)
        with torch.device("meta"):
            model = Eagle3Model(cfg)
        model.load_state_dict(state, strict=True, assign=True)  # names / shapes checked when read
        drafter = cls(
            model.to(device=device, dtype=dtype), name=Path(path).name, policy=policy, block_size=block_size
        )
        if d2t is not None:
            drafter.rows = draft_vocab(cfg, d2t, where=str(path)).to(drafter.device)
        drafter.path = str(path)
        return drafter

    def describe(self) -> dict[str, Any]:
        """For the result JSON: where it was loaded from, its dialect, the aux layers it reads, its cut."""
        cfg = self.cfg
        return {
            "path": self.path,
            "architecture": "eagle3",
            "dialect": cfg.dialect,
            "aux_layer_ids": list(cfg.aux_layer_ids or ()),
            "draft_vocab_size": cfg.draft_vocab_size,
            "own_embeddings": cfg.has_embed,
            **self.policy.describe(),
        }

    # ---- binding and the context --------------------------------------------------------------------------

    def bind(self, verifier: Verifier) -> None:
        self.fix_target(verifier)
        embed = None if self.cfg.has_embed else verifier.embed_fn(device=self.device, dtype=self.dtype)
        self.bind_fns(embed)

    def fix_target(self, target: Any) -> None:
        """Check against `target` and fix the default aux layers for its depth."""
        self.cfg = cfg = check_eagle3(self.cfg, target, name=self.name)
        self.model.cfg = cfg
        self.target_layer_ids, self.feature_dim = cfg.target_layer_ids, cfg.feature_dim

    def bind_fns(self, embed_fn: EmbedFn | None) -> None:
        """The verifier's embedding (None: the checkpoint's own)."""
        own = self.model.embed_tokens
        self.embed_fn = embed_fn if embed_fn is not None else own
        if self.embed_fn is None:
            raise ValueError(f"drafter {self.name!r} ships no embeddings: bind it to a verifier")
        self.reset()


class PEagleDrafter(Eagle3Drafter):
    """P-EAGLE (speculators' `peagle`): a block's n drafts in one forward. After the rows the cache lacks
    (the last pairing the token after the context, as EAGLE-3's) come n - 1 rows of the mask token with
    the fused `mask_hidden` as their hidden state; each attends to the context and the rows before it,
    which is speculators' P-EAGLE mask, and reads out the token one further. The drafts do not depend on
    each other: at T > 0 they are sampled as rows (`SampledProposals`), trees take them as levels."""

    walks = False

    @torch.inference_mode()
    def parallel_logits(self, last_token: int, n: int) -> torch.Tensor:
        """Logits [n, K] over the draft vocabulary of the n drafts after `last_token` (no host sync)."""
        if n <= 0 or not self._tokens:
            return torch.zeros(0, self.draft_vocab_size, device=self.device)
        self._fuse()
        L = len(self._tokens)
        R = self.cache.length = min(self.cache.length, L - 1)
        masks = [self.cfg.parallel_mask_token_id] * (n - 1)
        ids = torch.tensor([*self._tokens[R + 1 :], last_token, *masks], device=self.device)
        fused_mask = self.model.fuse(self.model.mask_hidden[0])  # [1, H]
        hidden = torch.cat([self._fused[R:L], fused_mask.expand(n - 1, -1)])  # [L - R + n - 1, H]
        out = self.model.rows(self.cache, self.embed_fn(ids), hidden)[-n:]  # [n, H]
        self.cache.length, self._tail = L, last_token  # the mask rows are not context
        return self.model.readout(out)[0]

    def propose(self, last_token: int, n: int) -> list[int]:
        """Up to n drafts in one forward, cut by the draft policy with each draft's top-1 chance."""
        if not 0 <= n < self.block_size:
            raise ValueError(f"can propose 0..{self.block_size - 1} tokens per step, asked for {n}")
        if n == 0:
            return []
        top, cols = self.parallel_logits(last_token, n).float().softmax(-1).max(-1)  # [n] each
        cut = self.policy.needs_confidence("dflash")
        tokens = self._ids(cols)  # the one sync of a proposal
        return self.policy.block_cut(tokens, top.tolist() if cut else None)

    def propose_logits(self, last_token: int, n: int) -> torch.Tensor:
        """Logits [n, V] of the n drafts (ids outside the draft vocabulary at -inf), for T > 0."""
        return self._dense(self.parallel_logits(last_token, n), float("-inf"))

    def propose_tree(self, last_token: int, depth: int, budget: TreeBudget) -> Tree:
        """A tree of the parallel drafts' candidates, best first by path probability."""
        return best_first(last_token, self.propose_logits(last_token, depth), budget)
