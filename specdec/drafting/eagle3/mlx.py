"""The EAGLE-3 drafter in MLX: the checkpoint `eagle3.torch` reads, run beside an MLX verifier
with nothing crossing to torch (see that module for the model and the rows it keeps).

The verifier's aux hidden states arrive as `mx.array` (`MLXVerifier.native_features`); tokens are
embedded with the checkpoint's own embeddings or the MLX verifier's embedding module (Gemma's scale as the
bridge computes it); a proposal builds the whole chain lazily and evaluates it once, with the cache, at its
one sync (the `.tolist()` of the drafts): the cache is evaluated whenever a call changes it, so any thread
may run the next turn (MLX keeps a stream per thread). mlx is imported by this module only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch

from specdec.bridges.mlx import MLX_DTYPES, embed_scale, materialize, text_model
from specdec.drafting.chain_mlx import MLXChainProposals
from specdec.drafting.eagle3.config import Eagle3Config, check_eagle3, draft_vocab, load_eagle3_weights
from specdec.drafting.policy import DraftPolicy
from specdec.drafting.rope import rope_frequencies
from specdec.kernels import MAX_VERIFY_TOKENS
from specdec.tree import Tree, TreeBudget, best_first

__all__ = ["MLXEagle3Drafter", "MLXEagle3Model", "MLXPEagleDrafter"]

_TORCH = {mx.float32: torch.float32, mx.bfloat16: torch.bfloat16, mx.float16: torch.float16}


class _Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, in_dim: int) -> None:
        super().__init__()
        D, bias = cfg.head_dim, cfg.attention_bias
        self.nh, self.nkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(in_dim, self.nh * D, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.nkv * D, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.nkv * D, bias=bias)
        self.o_proj = nn.Linear(self.nh * D, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
            self.k_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)


class _MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, index: int) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = _Attention(cfg, 2 * H if index == 0 else H)
        self.mlp = _MLP(cfg)
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        if index == 0:
            self.hidden_norm = nn.RMSNorm(H, eps=eps)


class _Cache:
    """Per-layer keys / values [1, nkv, capacity, D] and the rows held (`length`); buffers double to grow."""

    def __init__(self, cfg: Eagle3Config, dtype: mx.Dtype, capacity: int = 256) -> None:
        self.shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k = [mx.zeros(self.shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [mx.zeros(self.shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.length = 0

    def reserve(self, n: int) -> None:
        while n > self.k[0].shape[2]:
            pad = mx.zeros(self.k[0].shape, dtype=self.k[0].dtype)
            self.k = [mx.concatenate([b, pad], axis=2) for b in self.k]
            self.v = [mx.concatenate([b, pad], axis=2) for b in self.v]

    def arrays(self) -> list[mx.array]:
        return [*self.k, *self.v]


class MLXEagle3Model(nn.Module):
    """The EAGLE-3 draft network in MLX (speculators parameter names), as `eagle3.Eagle3Model`."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(cfg.feature_dim, H, bias=False)
        if cfg.norm_before_fc:
            self.input_norm = nn.RMSNorm(cfg.feature_dim, eps=eps)
        if cfg.fc_norm:
            self.fc_norm = [nn.RMSNorm(cfg.target_hidden_size, eps=eps) for _ in range(cfg.num_aux)]
        self.layers = [_Layer(cfg, i) for i in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(H, eps=eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        if cfg.has_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        if cfg.parallel_mask_token_id is not None:  # P-EAGLE: what its parallel rows take as features
            self.mask_hidden = mx.zeros((1, 1, cfg.feature_dim))
        inv, self._rope_scale = rope_frequencies(cfg)
        self._wavelengths = 1.0 / mx.array(inv, dtype=mx.float32)  # [D/2], mx.fast.rope's `freqs`

    def fuse(self, features: mx.array) -> mx.array:
        """features [n, A*Ht] -> the fused hidden [n, H]."""
        x = features.astype(self.fc.weight.dtype)
        if "input_norm" in self:
            x = self.input_norm(x)
        if "fc_norm" in self:
            parts = mx.split(x, len(self.fc_norm), axis=-1)
            x = mx.concatenate([norm(p) for norm, p in zip(self.fc_norm, parts, strict=True)], axis=-1)
        return self.fc(x)

    def _rope(self, x: mx.array, offset: int) -> mx.array:
        if self._rope_scale != 1.0:
            x = x * self._rope_scale
        D = self.cfg.head_dim
        return mx.fast.rope(
            x, D, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._wavelengths
        )

    def _attend(self, i: int, a: _Attention, x: mx.array, cache: _Cache) -> mx.array:
        """Layer i's attention of the new rows x [1, T, in] over the cache and themselves -> [1, T, H]."""
        T, S0 = x.shape[1], cache.length
        q = a.q_proj(x).reshape(1, T, a.nh, a.D)
        k = a.k_proj(x).reshape(1, T, a.nkv, a.D)
        if "q_norm" in a:
            q, k = a.q_norm(q), a.k_norm(k)
        q = self._rope(q.transpose(0, 2, 1, 3), S0 + 1)  # RoPE positions r + 1
        k = self._rope(k.transpose(0, 2, 1, 3), S0 + 1)
        v = a.v_proj(x).reshape(1, T, a.nkv, a.D).transpose(0, 2, 1, 3)
        S = S0 + T
        cache.k[i][:, :, S0:S] = k
        cache.v[i][:, :, S0:S] = v
        window = self.cfg.sliding_window if i in self.cfg.sliding_layers else None
        mask = None
        if T > 1 or (window is not None and window < S):
            rel = mx.arange(S0, S)[:, None] - mx.arange(S)[None, :]
            mask = (rel >= 0) if window is None else (rel >= 0) & (rel < window)
        o = mx.fast.scaled_dot_product_attention(
            q, cache.k[i][:, :, :S], cache.v[i][:, :, :S], scale=a.D**-0.5, mask=mask
        )
        return a.o_proj(o.transpose(0, 2, 1, 3).reshape(1, T, -1))

    def rows(self, cache: _Cache, emb: mx.array, hidden: mx.array) -> mx.array:
        """New rows after the cache's: embeddings, hidden states [T, H] -> outputs [T, H] (before `norm`)."""
        T = emb.shape[0]
        cache.reserve(cache.length + T)
        h = hidden.astype(self.fc.weight.dtype)[None]
        for i, layer in enumerate(self.layers):
            if i == 0:
                normed = layer.hidden_norm(h)
                x = mx.concatenate([layer.input_layernorm(emb.astype(h.dtype)[None]), normed], axis=-1)
                h = (normed if self.cfg.norm_before_residual else h) + self._attend(
                    i, layer.self_attn, x, cache
                )
            else:
                h = h + self._attend(i, layer.self_attn, layer.input_layernorm(h), cache)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        cache.length += T
        return h[0]

    def readout(self, out: mx.array) -> tuple[mx.array, mx.array]:
        """A row's output [T, H] -> (logits [T, K], the hidden the next row of a chain takes)."""
        normed = self.norm(out)
        return self.lm_head(normed), normed if self.cfg.norm_output else out


class MLXEagle3Drafter(MLXChainProposals):
    """The `Drafter` protocol over `MLXEagle3Model` for an `MLXVerifier`, as `eagle3.Eagle3Drafter`."""

    def __init__(
        self,
        model: MLXEagle3Model,
        *,
        name: str = "eagle3-mlx",
        policy: DraftPolicy | None = None,
        block_size: int | None = None,
    ) -> None:
        cfg = model.cfg
        self.model, self.cfg, self.name, self.policy = model, cfg, name, policy or DraftPolicy()
        self.block_size = min(block_size or cfg.block_size, MAX_VERIFY_TOKENS)
        self.target_layer_ids = cfg.target_layer_ids if cfg.aux_layer_ids else ()
        self.feature_dim, self.vocab_size = cfg.feature_dim, cfg.vocab_size
        self.draft_vocab_size = cfg.draft_vocab_size
        self.device = torch.device("cpu")  # the protocol's torch device: unused, nothing crosses to torch
        self.dtype = _TORCH[model.fc.weight.dtype]
        self.path: str | None = None
        self.rows: mx.array | None = None  # [K] target id of each draft token (None: identity)
        self._embed: Callable[[mx.array], mx.array] | None = None
        self._cache = _Cache(cfg, model.fc.weight.dtype)
        self._fused = mx.zeros((256, cfg.hidden_size), dtype=model.fc.weight.dtype)
        mx.eval(self._cache.arrays(), self._fused)
        self.reset()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        cfg: Eagle3Config,
        *,
        dtype: str = "float32",
        policy: DraftPolicy | None = None,
        block_size: int | None = None,
    ) -> MLXEagle3Drafter:
        """Load a checkpoint folder read by `eagle3.config.read_eagle3` (config `cfg`)."""
        if dtype not in MLX_DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported; choose one of {sorted(MLX_DTYPES)}")
        state = load_eagle3_weights(path, cfg)  # torch tensors (a pytorch_model.bin is read by torch only)
        d2t = state.pop("d2t", None)
        model = MLXEagle3Model(cfg)
        weights = [(k, mx.array(v.float().numpy()).astype(MLX_DTYPES[dtype])) for k, v in state.items()]
        model.load_weights(weights, strict=True)
        materialize(model)  # evaluated here: any thread may decode
        d = cls(model, name=Path(path).name, policy=policy, block_size=block_size)
        if d2t is not None:
            d.rows = mx.array(draft_vocab(cfg, d2t, where=str(path)).numpy().astype(np.int32))
        d.path = str(path)
        return d

    def describe(self) -> dict[str, Any]:
        """For the result JSON, as the torch drafter's."""
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

    def bind(self, verifier: Any) -> None:
        if getattr(verifier, "runtime", None) != "mlx":
            raise ValueError(
                f"the MLX drafter needs an MLX verifier (got {getattr(verifier, 'runtime', None)!r}); "
                "use the PyTorch drafter (--drafter-runtime torch) with other verifiers"
            )
        self.cfg = cfg = check_eagle3(self.cfg, verifier, name=self.name)
        self.model.cfg = cfg
        self.target_layer_ids, self.feature_dim = cfg.target_layer_ids, cfg.feature_dim
        if cfg.has_embed:
            self._embed = self.model.embed_tokens
        else:
            table, scale = text_model(verifier.model).model.embed_tokens, embed_scale(verifier.model)
            self._embed = table if scale is None else (lambda ids: table(ids) * scale)
        self.reset()


class MLXPEagleDrafter(MLXEagle3Drafter):
    """P-EAGLE in MLX, as `eagle3.PEagleDrafter`: the block's n drafts in one lazy forward, the mask rows
    dropped after; drafts independent of each other (sampled as rows at T > 0, levels of a tree)."""

    walks = False

    def parallel_logits(self, last_token: int, n: int) -> mx.array:
        """Logits [n, K] over the draft vocabulary of the n drafts after `last_token`, lazy."""
        self._fuse()
        L, cache = len(self._tokens), self._cache
        R = cache.length = min(cache.length, L - 1)
        masks = [self.cfg.parallel_mask_token_id] * (n - 1)
        ids = mx.array([*self._tokens[R + 1 :], last_token, *masks], dtype=mx.int32)
        fused_mask = self.model.fuse(self.model.mask_hidden[0])  # [1, H]
        hidden = mx.concatenate(
            [self._fused[R:L], mx.broadcast_to(fused_mask, (n - 1, fused_mask.shape[-1]))]
        )
        out = self.model.rows(cache, self._embed(ids), hidden)[-n:]
        cache.length, self._tail = L, last_token  # the mask rows are not context
        return self.model.readout(out)[0].astype(mx.float32)

    def propose(self, last_token: int, n: int) -> list[int]:
        if not 0 <= n < self.block_size:
            raise ValueError(f"can propose 0..{self.block_size - 1} tokens per step, asked for {n}")
        if n == 0 or not self._tokens:
            return []
        logits = self.parallel_logits(last_token, n)
        ids, top = self._ids(mx.argmax(logits, axis=-1)), mx.max(mx.softmax(logits, axis=-1), axis=-1)
        self._sync(ids, top)
        cut = self.policy.needs_confidence("dflash")
        return self.policy.block_cut(ids.tolist(), top.tolist() if cut else None)

    def propose_logits(self, last_token: int, n: int) -> torch.Tensor:
        """Logits [n, V] (ids outside the draft vocabulary at -inf), for sampled proposals at T > 0."""
        logits = self.parallel_logits(last_token, n)
        self._sync(logits)
        return self._dense(torch.tensor(np.array(logits)), float("-inf"))

    def propose_tree(self, last_token: int, depth: int, budget: TreeBudget) -> Tree:
        """A tree of the parallel drafts' candidates, best first by path probability."""
        return best_first(last_token, self.propose_logits(last_token, depth), budget)
