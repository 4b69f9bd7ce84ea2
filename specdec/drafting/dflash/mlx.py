"""The DFlash drafter in MLX: the same public checkpoint as `specdec.drafting.dflash.torch`, run beside an MLX
verifier with nothing crossing to torch.

Same model as the PyTorch drafter (`dflash.torch`): a few Qwen3-style layers whose queries are
the block `[bonus, MASK x (bs-1)]`, with the verifier's features of the committed context projected once
(`hidden_norm(fc(features))`) and injected into every layer as extra keys / values. Here:
- the weights load from the same folder (config.json with `dflash_config`, model.safetensors, the draft
  vocabulary) with `mx.load`, in the dtype asked for;
- features arrive as `mx.array` straight from the MLX verifier (`MLXVerifier.native_features`);
- the block is embedded and read out through the MLX verifier's own embedding and LM head modules
  (quantized where the verifier is; Gemma's embedding scale and soft-capping as the bridge computes them; a
  draft vocabulary takes the head's rows once, quantized rows included);
- the context K/V live in MLX buffers with a length pointer (rollback moves the pointer);
- a proposal stays lazy until its one sync, the `.tolist()` of the proposed ids.
mlx is imported by this module only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch

from specdec.bridges.mlx import MLX_DTYPES, embed_scale, materialize, text_model
from specdec.drafting.dflash.config import (
    SLIDING,
    WEIGHTS_NAME,
    DFlashConfig,
    check_state_dict,
    check_target,
    load_config,
    require_file,
    usable_weights,
)
from specdec.drafting.layers_mlx import head_fn, sample_rows
from specdec.drafting.policy import DraftPolicy
from specdec.drafting.rope import rope_frequencies
from specdec.memory import mlx_probe
from specdec.protocols import MemoryProbe
from specdec.tree import TREE_TOPK, Tree, TreeBudget, best_first_of

__all__ = ["MLXDFlashDrafter", "MLXDFlashModel"]

_TORCH = {mx.float32: torch.float32, mx.bfloat16: torch.bfloat16, mx.float16: torch.float16}


class _Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        H, D, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv, self.head_dim, self.eps = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            D,
            cfg.rms_norm_eps,
        )
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=bias)
        self.q_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)


class _MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class _DynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution over one block (`specdec.drafting.dflash.dflash2`)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        d2, H = cfg.dflash2, cfg.hidden_size
        self.taps, self.group = d2.conv_kernel_size, d2.conv_group_size
        self.base_kernel = mx.zeros((2, self.taps, H))  # [side, taps, H]
        self.kernel_projection = nn.Linear(H, 2 * self.taps * (H // self.group), bias=False)

    def dynamic(self, h: mx.array) -> mx.array:
        """Normed sublayer input h [1, L, H] -> dynamic taps [1, L, 2, taps, G]."""
        B, L, H = h.shape
        return self.kernel_projection(h).reshape(B, L, 2, self.taps, H // self.group)

    def __call__(self, x: mx.array, dyn: mx.array, side: int) -> mx.array:
        B, L, H = x.shape
        G = H // self.group
        xs = x.reshape(B, L, G, self.group)  # [1, bs, G, g]
        base = self.base_kernel[side].reshape(self.taps, G, self.group).astype(x.dtype)  # [taps, G, g]
        out = mx.zeros_like(xs)
        for j in range(min(self.taps, L)):
            src = xs if j == 0 else mx.concatenate([mx.zeros_like(xs[:, :j]), xs[:, :-j]], axis=1)
            out = out + base[j] * src
            out = out + dyn[:, :, side, j, :, None] * src
        return out.reshape(B, L, H)


class _Selector(nn.Module):
    """DFlash2's candidate selector (`specdec.drafting.dflash.dflash2.CandidateSelector`), in MLX."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        d2 = cfg.dflash2
        self.top_k = d2.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, d2.selector_rank, bias=False)
        self.predecessor_codebook = mx.zeros((cfg.vocab_size, d2.selector_rank))  # [V, R], bare
        self.successor_codebook = mx.zeros((cfg.vocab_size, d2.selector_rank))

    def walk(
        self, hidden: mx.array, logits: mx.array, first: int, temperature: float, u: list[float] | None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """As the torch selector's: (tokens [n], probs [n, k], candidates [n, k]), lazy."""
        n, k = logits.shape[0], self.top_k
        part = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]  # [n, k] the top k, any order
        top = mx.take_along_axis(logits, part, axis=-1)
        order = mx.argsort(-top, axis=-1)  # best first, as torch's topk: a sampled walk draws alike
        cand = mx.take_along_axis(part, order, axis=-1)  # [n, k]
        unary = mx.take_along_axis(top, order, axis=-1).astype(mx.float32)  # [n, k]
        proj = self.hidden_projection(hidden).astype(mx.float32)  # [n, R]
        succ = self.successor_codebook[cand].astype(mx.float32)  # [n, k, R]
        prev = mx.array([first])
        tokens, probs = [], []
        for p in range(n):
            pre = self.predecessor_codebook[prev].astype(mx.float32) * proj[p]  # [1, R]
            scores = unary[p] + succ[p] @ pre[0]  # [k]
            if temperature > 0:
                q = mx.softmax(scores / temperature, axis=-1)
                cdf = mx.cumsum(q)
                idx = mx.minimum(mx.sum(cdf <= u[p] * cdf[-1]), k - 1)  # inverse CDF, as `sample_from`
                idx = mx.where(q[idx] == 0, mx.argmax(q), idx)[None]
            else:
                q, idx = mx.softmax(scores, axis=-1), mx.argmax(scores)[None]
            prev = cand[p][idx]  # [1]
            tokens.append(prev)
            probs.append(q)
        return mx.concatenate(tokens), mx.stack(probs), cand


class _Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig, index: int) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.sliding_window = cfg.sliding_window if cfg.layer_types[index] == SLIDING else None
        if cfg.dflash2 is not None:
            self.attention_conv, self.mlp_conv = _DynamicConv(cfg), _DynamicConv(cfg)

    def mlp_block(self, x: mx.array) -> mx.array:
        """x plus its MLP sublayer (DFlash2: wrapped in its convolution)."""
        h = self.post_attention_layernorm(x)
        if "mlp_conv" not in self:
            return x + self.mlp(h)
        dyn = self.mlp_conv.dynamic(h)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(h, dyn, 0)), dyn, 1)


class MLXDFlashModel(nn.Module):
    """DFlash drafter weights (public parameter names) and the cached block forward, in MLX."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = [_Layer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.fc = nn.Linear(cfg.feature_dim, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.dflash2 is not None:
            self.candidate_selector = _Selector(cfg)
        if cfg.dspark is not None:  # DSpark's heads (`dflash.dspark`), public parameter names
            p = cfg.dspark
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = nn.Embedding(cfg.vocab_size, p.markov_rank)
            self.markov_head.markov_w2 = nn.Linear(p.markov_rank, cfg.vocab_size, bias=False)
            if p.confidence_head:
                self.confidence_head = nn.Module()
                width = cfg.hidden_size + (p.markov_rank if p.confidence_with_markov else 0)
                self.confidence_head.proj = nn.Linear(width, 1, bias=True)
            if p.own_embeddings:
                self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.own_lm_head:  # a speculators checkpoint's head over its draft vocabulary
            self.lm_head = nn.Linear(
                cfg.hidden_size, len(cfg.draft_vocab or ()) or cfg.vocab_size, bias=False
            )
        self._wavelengths: mx.array | None = None  # [D/2], for mx.fast.rope's `freqs`; None: plain RoPE
        self._rope_scale = 1.0
        if cfg.rope_scaling is not None:
            inv, self._rope_scale = rope_frequencies(cfg)
            self._wavelengths = 1.0 / mx.array(inv, dtype=mx.float32)

    def _rope(self, x: mx.array, offset: int) -> mx.array:
        """Rotate-half RoPE of x [1, heads, T, D] at positions offset..offset+T-1 (as HF Qwen3; with
        linear / YaRN scaling the frequencies and factor of `rope_frequencies`, as the torch drafter)."""
        D = self.cfg.head_dim
        if self._wavelengths is None:
            return mx.fast.rope(x, D, traditional=False, base=self.cfg.rope_theta, scale=1.0, offset=offset)
        if self._rope_scale != 1.0:
            x = x * self._rope_scale
        return mx.fast.rope(
            x, D, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._wavelengths
        )

    def context_kv(self, features: mx.array, start: int) -> list[tuple[mx.array, mx.array]]:
        """Per-layer (k, v) [1, nkv, n, D] of features [n, K*H] at positions start..start+n-1."""
        ctx = self.hidden_norm(self.fc(features.astype(self.fc.weight.dtype)[None]))  # [1, n, H]
        return [self._kv(layer.self_attn, ctx, start) for layer in self.layers]

    def _kv(self, a: _Attention, h: mx.array, start: int) -> tuple[mx.array, mx.array]:
        B, T, _ = h.shape
        k = a.k_norm(a.k_proj(h).reshape(B, T, a.n_kv, a.head_dim)).transpose(0, 2, 1, 3)
        v = a.v_proj(h).reshape(B, T, a.n_kv, a.head_dim).transpose(0, 2, 1, 3)
        return self._rope(k, start), v

    def block(self, cache: _Cache, embeds: mx.array) -> mx.array:
        """Hidden states [1, bs, H] after the final norm of the embedded block [1, bs, H] at positions
        cache.length.., attending to every cached context position (windowed layers: the last window)."""
        start, bs = cache.length, embeds.shape[1]
        x = embeds.astype(self.fc.weight.dtype)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            conv = "attention_conv" in layer  # DFlash2
            if conv:
                dyn = layer.attention_conv.dynamic(h)
                h = layer.attention_conv(h, dyn, 0)
            q = a.q_norm(a.q_proj(h).reshape(1, bs, a.n_heads, a.head_dim)).transpose(0, 2, 1, 3)
            q = self._rope(q, start)
            k, v = self._kv(a, h, start)
            w = layer.sliding_window
            lo = 0 if w is None else max(0, start - w + 1)
            keys = mx.concatenate([cache.k[i][:, :, lo:start], k], axis=2)  # [1, nkv, S, D]
            values = mx.concatenate([cache.v[i][:, :, lo:start], v], axis=2)
            mask = _mask(start, bs, lo, w, self.cfg.is_causal)
            o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=a.head_dim**-0.5, mask=mask)
            out = a.o_proj(o.transpose(0, 2, 1, 3).reshape(1, bs, -1))
            x = layer.mlp_block(x + (layer.attention_conv(out, dyn, 1) if conv else out))
        return self.norm(x)


def _mask(start: int, bs: int, lo: int, window: int | None, causal: bool) -> mx.array | None:
    """Bool [bs, S] of the window / causal rules for block positions start.. over keys lo..start+bs-1;
    None when every key is visible (the public non-causal drafters within their window)."""
    end = start + bs
    if not causal and (window is None or end - 1 - lo < window):
        return None
    rel = mx.arange(start, end)[:, None] - mx.arange(lo, end)[None, :]
    ok = mx.ones(rel.shape, dtype=mx.bool_)
    if window is not None:
        ok = ok & (mx.abs(rel) < window)
    if causal:
        ok = ok & (rel >= 0)
    return ok


class _Cache:
    """Per-layer context K/V [1, nkv, capacity, D] with a length pointer (buffers grow by doubling).

    Evaluated whenever it changes: MLX >= 0.32 keeps a stream per thread, and a lazy array built on one
    thread cannot be evaluated on another, so a cache left lazy by one turn would fail the next turn of an
    app that decodes each turn on a thread of its own (the work is the same; it is only done a call
    earlier)."""

    def __init__(self, cfg: DFlashConfig, dtype: mx.Dtype, capacity: int = 256) -> None:
        self.shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k = [mx.zeros(self.shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [mx.zeros(self.shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.length = 0
        mx.eval(self.k, self.v)

    def append(self, kv: list[tuple[mx.array, mx.array]]) -> None:
        n = kv[0][0].shape[2]
        end = self.length + n
        while end > self.k[0].shape[2]:
            pad = mx.zeros(self.k[0].shape, dtype=self.k[0].dtype)
            self.k = [mx.concatenate([b, pad], axis=2) for b in self.k]
            self.v = [mx.concatenate([b, pad], axis=2) for b in self.v]
        for i, (k, v) in enumerate(kv):
            self.k[i][:, :, self.length : end] = k.astype(self.k[i].dtype)
            self.v[i][:, :, self.length : end] = v.astype(self.v[i].dtype)
        self.length = end
        mx.eval(self.k, self.v)


class MLXDFlashDrafter:
    """The `Drafter` protocol over `MLXDFlashModel`, for an `MLXVerifier` (`runtime = "mlx"`: the engine
    hands it the verifier's features as mx.array). `bind(verifier)` before `extend` / `propose`."""

    runtime = "mlx"

    def __init__(
        self,
        model: MLXDFlashModel,
        *,
        name: str = "dflash-mlx",
        policy: DraftPolicy | None = None,
    ) -> None:
        """`policy`: where each greedy block is cut, as the PyTorch drafter's (`DraftPolicy`)."""
        cfg = model.cfg
        self.model, self.cfg, self.name, self.policy = model, cfg, name, policy or DraftPolicy()
        self.block_size, self.target_layer_ids = cfg.block_size, tuple(cfg.target_layer_ids)
        self.feature_dim, self.vocab_size = cfg.feature_dim, cfg.vocab_size
        self.mask_token_id = cfg.mask_token_id
        self.device = torch.device("cpu")  # the protocol's torch device: unused, nothing crosses to torch
        self.dtype = _TORCH[model.fc.weight.dtype]
        self.path: str | None = None
        self._cache: _Cache | None = None
        self._embed: Any = None
        self._head: Any = None
        self._rows = None if cfg.draft_vocab is None else mx.array(list(cfg.draft_vocab), dtype=mx.int32)
        self.d2 = cfg.dflash2  # DFlash2's read-out and selector, or None
        self.ds = cfg.dspark  # DSpark's heads, or None
        self._off = 1 if self.ds is None else self.ds.offset  # the first proposal's block position
        self._mask_col = cfg.mask_column if self.d2 is None and self.ds is None else None  # as the torch one
        self.walks = self.d2 is not None or self.ds is not None  # `specdec.protocols.SampledWalk`

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        policy: DraftPolicy | None = None,
        config: DFlashConfig | None = None,
    ) -> MLXDFlashDrafter:
        """Load a public-format checkpoint folder (the one the PyTorch drafter loads); `config`: its config
        as read already (`registry.read_checkpoint`)."""
        if dtype not in MLX_DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported; choose one of {sorted(MLX_DTYPES)}")
        cfg = config or load_config(path)
        file = require_file(Path(path), WEIGHTS_NAME)
        try:
            weights = mx.load(str(file))
        except (RuntimeError, ValueError) as e:  # a truncated file: "invalid data offsets", ...
            raise ValueError(f"cannot read {str(file)!r} (truncated or not safetensors): {e}") from None
        weights = usable_weights(cfg, weights)
        check_state_dict(cfg, weights, source=str(file))  # names and shapes, as the torch drafter checks
        model = MLXDFlashModel(cfg)
        model.load_weights([(k, v.astype(MLX_DTYPES[dtype])) for k, v in weights.items()], strict=True)
        materialize(model)  # evaluated here: any thread may decode
        d = cls(model, name=Path(path).name, policy=policy)
        d.path = str(path)
        return d

    def describe(self) -> dict[str, Any]:
        """For the result JSON (`specdec.protocols.Describes`): where it was loaded from, DFlash or DFlash2,
        and its cut."""
        return {"path": self.path, "architecture": self.cfg.architecture, **self.policy.describe()}

    # ---- protocol ----------------------------------------------------------------------------------------

    @property
    def context_len(self) -> int:
        return 0 if self._cache is None else self._cache.length

    def bind(self, verifier: Any) -> None:
        if getattr(verifier, "runtime", None) != "mlx":
            raise ValueError(
                f"the MLX drafter needs an MLX verifier (got {getattr(verifier, 'runtime', None)!r}); "
                "use the PyTorch drafter (--drafter-runtime torch) with other verifiers"
            )
        check_target(self.cfg, verifier, name=self.name)
        model = verifier.model
        inner = text_model(model).model
        scale = embed_scale(model)
        self._embed = (
            self.model.embed_tokens  # a DSpark checkpoint's own
            if "embed_tokens" in self.model
            else (lambda ids: inner.embed_tokens(ids))
            if scale is None
            else (lambda ids: inner.embed_tokens(ids) * scale)
        )
        self._head = self.model.lm_head if self.cfg.own_lm_head else head_fn(model, self._rows)
        self.reset()

    def _need(self) -> _Cache:
        if self._cache is None:
            raise RuntimeError(f"drafter {self.name!r} is not bound: call bind(verifier) first")
        return self._cache

    def reset(self) -> None:
        if self._head is not None:
            self._cache = _Cache(self.cfg, self.model.fc.weight.dtype)

    def extend(self, features: mx.array, tokens: Sequence[int]) -> None:
        """Append committed positions: features [n, K*H] (an mx.array from the MLX verifier)."""
        cache = self._need()
        if features.ndim != 2 or features.shape != (len(tokens), self.feature_dim):
            raise ValueError(
                f"features must be [{len(tokens)}, {self.feature_dim}], got {list(features.shape)}"
            )
        if features.shape[0]:
            cache.append(self.model.context_kv(features, cache.length))

    def block_hidden(self, last_token: int) -> mx.array:
        """Hidden states [bs, H] of the block [last_token, MASK...] (lazy)."""
        cache = self._need()
        masks = [self.mask_token_id] * (self.block_size - 2 + self._off)  # DSpark from the anchor: one fewer
        ids = mx.array([last_token, *masks], dtype=mx.int32)[None]
        emb = self._embed(ids)  # [1, bs, H]
        if self.d2 is not None and self.d2.input_embedding_scale != 1.0:
            emb = emb * self.d2.input_embedding_scale
        return self.model.block(cache, emb)[0]

    def block_logits(self, last_token: int, n: int, hidden: mx.array | None = None) -> mx.array:
        """Logits [n, K] (K = V without a draft vocabulary) of block positions 1..n, mask token at -inf
        (DFlash2: times its output multiplier, soft-capped), as the torch drafter's."""
        hidden = self.block_hidden(last_token) if hidden is None else hidden
        logits = self._head(hidden[self._off : self._off + n]).astype(mx.float32)  # [n, K]
        if self.d2 is not None:
            logits = logits * self.d2.output_multiplier
            cap = self.d2.final_logit_softcapping
            return logits if cap is None else mx.tanh(logits / cap) * cap
        if self._mask_col is not None and self._mask_col < logits.shape[-1]:
            col = mx.arange(logits.shape[-1]) == self._mask_col
            logits = mx.where(col[None], -math.inf, logits)
        return logits

    def walk(
        self, last_token: int, n: int, *, temperature: float = 0.0, u: Sequence[float] | None = None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """DFlash2: the selector's walk over block positions 1..n: (tokens [n], probs [n, k], candidates
        [n, k]), lazy; greedy, or sampled at `temperature` with uniforms u [n]."""
        hidden = self.block_hidden(last_token)
        logits = self.block_logits(last_token, n, hidden)
        return self.model.candidate_selector.walk(hidden[1 : n + 1], logits, last_token, temperature, u)

    def dspark_walk(
        self, last_token: int, n: int, *, temperature: float = 0.0, u: Sequence[float] | None = None
    ) -> tuple[mx.array, mx.array, mx.array | None]:
        """DSpark: the Markov head's walk over the block's n proposals, lazy: (tokens [n], chances [n]: the
        confidence head's, else each step's top-1 probability, q [n, V] at temperature > 0), as
        `dspark.markov_walk`; sampled by inverse CDF with uniforms u [n]."""
        hidden = self.block_hidden(last_token)
        base = self.block_logits(last_token, n, hidden)  # [n, V]
        rows, m, ch = (
            hidden[self._off : self._off + n],
            self.model.markov_head,
            self.model.get("confidence_head"),
        )
        prev, tokens, chances, qs = mx.array([last_token]), [], [], []
        for i in range(n):
            e = m.markov_w1(prev)  # [1, r]
            logits = (base[i : i + 1] + m.markov_w2(e)).astype(mx.float32)  # [1, V]
            if temperature > 0:
                qs.append(mx.softmax(logits / temperature, axis=-1))
                tok = sample_rows(qs[-1], u[i])
            else:
                tok = mx.argmax(logits, axis=-1)
            if ch is not None:
                x = (
                    mx.concatenate([rows[i : i + 1], e], -1)
                    if self.ds.confidence_with_markov
                    else rows[i : i + 1]
                )
                chances.append(mx.sigmoid(ch.proj(x).astype(mx.float32))[:, 0])
            else:
                chances.append(mx.max(mx.softmax(logits, axis=-1), axis=-1))
            tokens.append(tok)
            prev = tok
        q = mx.concatenate(qs) if qs else None
        return mx.concatenate(tokens), mx.concatenate(chances), q

    def propose_walk(
        self, last_token: int, n: int, *, temperature: float, u: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """DFlash2 and DSpark at temperature > 0 (`specdec.protocols.SampledWalk`): the sampled walk and
        q [n, V]."""
        if self.ds is not None:
            tokens, _, q = self.dspark_walk(last_token, n, temperature=temperature, u=u.tolist())
            mx.eval(tokens, q)
            return tokens.tolist(), torch.tensor(np.array(q))
        tokens, probs, cand = self.walk(last_token, n, temperature=temperature, u=u.tolist())
        mx.eval(tokens, probs, cand)
        q = torch.zeros(n, self.vocab_size)  # [n, V]
        q.scatter_(1, torch.tensor(np.array(cand), dtype=torch.long), torch.tensor(np.array(probs)))
        return tokens.tolist(), q

    def propose(self, last_token: int, n: int) -> list[int]:
        """Up to n greedy tokens after `last_token` (DFlash2: the selector's greedy walk), cut by the draft
        policy with the block's own chances (`DraftPolicy.block_cut`, as the torch drafter cuts)."""
        if not 0 <= n < self.block_size:
            raise ValueError(f"can propose 0..{self.block_size - 1} tokens per block, asked for {n}")
        if n == 0:
            return []
        cut = self.policy.needs_confidence("dflash")
        if self.ds is not None:
            best, top, _ = self.dspark_walk(last_token, n)
            top = top if cut else None
        elif self.d2 is not None:
            best, probs, _ = self.walk(last_token, n)
            top = mx.max(probs, axis=-1) if cut else None  # [n]: the walk's own chances
        else:
            logits = self.block_logits(last_token, n)  # [n, K]
            best = mx.argmax(logits, axis=-1)
            if self._rows is not None:
                best = self._rows[best]  # [n] vocabulary ids
            top = mx.max(mx.softmax(logits, axis=-1), axis=-1) if cut else None  # [n], as the torch drafter
        mx.eval(best, *(() if top is None else (top,)))  # the one sync of a proposal
        return self.policy.block_cut(best.tolist(), None if top is None else top.tolist())

    def propose_tree(self, last_token: int, depth: int, budget: TreeBudget) -> Tree:
        """A tree of the block's candidates, best first by path probability (`specdec.tree.best_first`)."""
        if depth == 0 or budget.nodes == 1:
            return Tree.chain(last_token, [])
        logits = self.block_logits(last_token, depth)  # [depth, K]
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        k = min(TREE_TOPK, budget.nodes - 1, logp.shape[-1])
        cols = mx.argsort(-logp, axis=-1)[:, :k]  # [depth, k], best first
        top = mx.take_along_axis(logp, cols, axis=-1)
        ids = self._rows[cols] if self._rows is not None else cols  # vocabulary ids
        mx.eval(top, ids)  # the one sync of a proposal
        return best_first_of(last_token, top.tolist(), ids.tolist(), budget)

    def rollback(self, n: int) -> None:
        cache = self._need()
        if not 0 <= n <= cache.length:
            raise ValueError(f"cannot roll back {n} positions: the drafter holds {cache.length}")
        cache.length -= n

    def memory_probe(self) -> MemoryProbe:
        return mlx_probe()
