"""The PyTorch DFlash drafter: model, block proposer, and the `Drafter` adapter the engine talks to.

DFlash (arXiv 2602.06036) drafts a whole block in one non-causal forward. The model is a few Qwen3-style
decoder layers with no embedding and no LM head of its own: the block `[bonus, MASK x (bs-1)]` is embedded
with the verifier's `embed_fn` and read out through its `lm_head_fn`. The verifier's features of the
committed context (K chosen decoder-layer outputs, concatenated) are projected once,
`hidden_norm(fc(features))`, and injected into every layer as extra keys/values (through that layer's
k_proj/v_proj, k_norm and RoPE at the context positions); only block tokens make queries. Block position k
predicts the token AT position k, so a block of 16 proposes 15 tokens.

Inference keeps the context K/V of every layer in preallocated buffers with a length pointer (gpt-fast
style): `extend` projects only the new positions, `rollback` moves the pointer back, and a proposal costs
one forward over the block against the cached K/V. The only host sync of a proposal is the final
`.tolist()` of the proposed ids. `DFlashDraftModel.anchor_blocks` is the training-time block forward over
many anchor blocks of a sequence with the block-sparse mask (a block sees the context strictly before its
anchor and its own block, never other blocks); `forward_train` runs it `attn_chunk` anchors at a time, and
so does the training loss (`specdec.train`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafting.checkpoint import (
    SLIDING,
    DFlashConfig,
    check_target,
    load_config,
    load_state_dict,
    rope_frequencies,
    save_checkpoint,
)
from specdec.drafting.dflash2 import CandidateSelector, DynamicConv, Walk
from specdec.drafting.policy import Draft, DraftPolicy
from specdec.kernels import use_cpu_linears
from specdec.protocols import EmbedFn, LMHeadFn, MemoryProbe, MemoryRecord
from specdec.tree import Tree, TreeBudget, best_first

if TYPE_CHECKING:
    from specdec.protocols import Verifier

__all__ = [
    "BlockProposal",
    "DFlashCache",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashDrafter",
    "DFlashProposer",
]


# ----------------------------------------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., T, D] for positions [..., T] (angles in fp32, as HF Qwen3; both times `scale`,
    YaRN's attention factor, before the cast)."""
    ang = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, D/2]
    ang = torch.cat([ang, ang], dim=-1)  # [..., T, D]
    if scale == 1.0:
        return ang.cos().to(dtype), ang.sin().to(dtype)
    return (ang.cos() * scale).to(dtype), (ang.sin() * scale).to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [B, nh, T, D]; cos/sin [B or 1, T, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """GQA attention without repeating K/V. q [B, Hq, Tq, D]; k, v [B, Hkv, S, D]; mask [B or 1, Tq, S]
    bool (True = visible) or None. Returns [B, Hq, Tq, D].

    Query heads h = j*g .. j*g+g-1 share kv head j, so they are folded into the query length of head j:
    SDPA then runs on every backend (CPU/CUDA/MPS) with no copy of the context K/V.
    """
    B, Hq, Tq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    q = q.reshape(B, Hkv, g * Tq, D)
    if mask is not None:
        mask = mask[:, None].expand(mask.shape[0], g, Tq, S).reshape(mask.shape[0], 1, g * Tq, S)
    if q.device.type not in ("cpu", "cuda"):  # MPS SDPA has given wrong values for strided inputs (the cache
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # views are): pytorch #181133, #163597
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, Hkv, g*Tq, D]
    return out.view(B, Hq, Tq, D)


class DFlashAttention(nn.Module):
    """Qwen3 GQA attention projections with per-head q_norm / k_norm (public parameter names)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        H, D, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> q [B, nh, T, D]."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        return _apply_rope(q, cos, sin)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k, v [B, nkv, T, D] (k normed and rotated)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return _apply_rope(k, cos, sin), v


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


#: (block k, block v) [B, nkv, Tq, D] -> (keys, values) [B, nkv, S, D] the block attends to
KVJoin = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class DFlashDecoderLayer(nn.Module):
    """Pre-norm decoder layer whose queries are block tokens and whose keys add the injected context."""

    def __init__(self, cfg: DFlashConfig, index: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sliding_window = cfg.sliding_window if cfg.layer_types[index] == SLIDING else None
        self.attention_conv = self.mlp_conv = None
        if cfg.dflash2 is not None:  # DFlash2: a dynamic convolution around each sublayer
            self.attention_conv, self.mlp_conv = DynamicConv(cfg), DynamicConv(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        join: KVJoin,
        mask: torch.Tensor | None,
        block: int,
    ) -> torch.Tensor:
        """x [B, Tq, H] block hidden states (blocks of `block` positions) -> [B, Tq, H]."""
        B, Tq, _ = x.shape
        conv = self.attention_conv is not None
        h = self.input_layernorm(x)
        if conv:
            dyn = self.attention_conv.dynamic(h)  # both sides' taps from the normed input
            h = self.attention_conv(h, dyn, 0, block)
        q = self.self_attn.query(h, cos, sin)  # [B, nh, Tq, D]
        keys, values = join(*self.self_attn.key_value(h, cos, sin))  # [B, nkv, S, D]
        o = _attend(q, keys, values, mask).transpose(1, 2).reshape(B, Tq, -1)  # [B, Tq, nh*D]
        a = self.self_attn.o_proj(o)
        x = x + (self.attention_conv(a, dyn, 1, block) if conv else a)
        h = self.post_attention_layernorm(x)
        if not conv:
            return x + self.mlp(h)
        dyn = self.mlp_conv.dynamic(h)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(h, dyn, 0, block)), dyn, 1, block)


def _visible(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor | None:
    """Bool [..., Tq, S] of the window/causal rules for query positions [..., Tq] and key positions
    [..., S]; None when everything is visible (lets SDPA take its unmasked path)."""
    rel = qpos[..., :, None] - kpos[..., None, :]  # [..., Tq, S]
    ok = None
    if window is not None:
        ok = rel.abs() < window  # non-causal window: the public reference also bounds keys after the query
    if causal:
        ok = rel >= 0 if ok is None else ok & (rel >= 0)
    return ok


# ----------------------------------------------------------------------------------------------------------
# the model


class DFlashCache:
    """Per-layer context K/V in preallocated buffers with a length pointer.

    Buffers grow by doubling; `crop` only moves the pointer (rejected slots are overwritten later). The
    slots past `length` are also the scratch space where a proposal writes its block K/V, so a proposal
    attends to a view of one buffer instead of concatenating the context every step.
    """

    def __init__(
        self, cfg: DFlashConfig, *, device: torch.device, dtype: torch.dtype, capacity: int = 256
    ) -> None:
        self.block_size = cfg.block_size
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, max(capacity, cfg.block_size), cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [L, nkv, cap, D]
        self.v = torch.zeros(shape, device=device, dtype=dtype)  # [L, nkv, cap, D]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, n: int) -> None:
        """Make room for `n` positions in total (context plus a block of scratch)."""
        if n <= self.capacity:
            return
        cap = self.capacity
        while cap < n:
            cap *= 2
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], cap, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop the drafter cache of {self.length} positions to {length}")
        self.length = length


class DFlashDraftModel(nn.Module):
    """DFlash drafter weights (public parameter names) and its two forwards: cached block inference and
    the block-sparse training forward."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.feature_dim, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        D = cfg.head_dim
        # [D/2] fp32, not a parameter of the public format: recomputed from rope_theta, kept out of
        # state_dict and out of .to(dtype) casts (RoPE angles need fp32); follows the device lazily.
        # Built on the CPU explicitly: from_pretrained constructs the module under torch.device("meta").
        if cfg.rope_scaling is None:
            arange = torch.arange(0, D, 2, dtype=torch.float32, device="cpu")
            self._inv_freq, self._rope_scale = 1.0 / cfg.rope_theta ** (arange / D), 1.0
        else:  # linear / YaRN, as transformers computes them
            inv, self._rope_scale = rope_frequencies(cfg)
            self._inv_freq = torch.tensor(inv, dtype=torch.float32, device="cpu")
        # [K] int64 ids the drafter reads out, or None: from the config (not a weight), on the CPU
        # explicitly like _inv_freq; .to(device) moves it, .to(dtype) leaves integer buffers alone
        vocab = None if cfg.draft_vocab is None else torch.tensor(cfg.draft_vocab, device="cpu")
        self.register_buffer("draft_vocab", vocab, persistent=False)
        self.candidate_selector = None if cfg.dflash2 is None else CandidateSelector(cfg)  # DFlash2

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., T, D] in the model dtype for positions [..., T]."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        return _rope_cos_sin(positions, self._inv_freq, self.dtype, self._rope_scale)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., K*H] -> injected context hidden states [..., H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(
        self, ctx: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context (k, v) [B, nkv, T, D] of projected context ctx [B, T, H] at positions
        [B or 1, T].

        The context never passes through a layer's input norm or MLP: every layer sees the same `ctx`,
        through its own k_proj/v_proj, k_norm and RoPE.
        """
        cos, sin = self.rope(positions)
        return [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]

    # ---- inference -----------------------------------------------------------------------------------

    def extend_cache(self, cache: DFlashCache, features: torch.Tensor) -> None:
        """Append committed positions: features [n, K*H]."""
        n, start = features.shape[0], cache.length
        if n == 0:
            return
        cache.reserve(start + n + cache.block_size)
        ctx = self.project(features.to(self.dtype)[None])  # [1, n, H]
        positions = torch.arange(start, start + n, device=ctx.device)[None]  # [1, n]
        for i, (k, v) in enumerate(self.context_kv(ctx, positions)):
            cache.k[i, :, start : start + n] = k[0]
            cache.v[i, :, start : start + n] = v[0]
        cache.length = start + n

    def forward_cached(self, cache: DFlashCache, block_embeds: torch.Tensor) -> torch.Tensor:
        """Block hidden states after the final norm, [1, bs, H], for block_embeds [1, bs, H] at positions
        cache.length .. cache.length+bs-1, attending to every cached context position (windowed layers:
        the last `sliding_window`). The cache length does not change."""
        cfg, start, bs = self.cfg, cache.length, block_embeds.shape[1]
        cache.reserve(start + bs)
        end = start + bs
        qpos = torch.arange(start, end, device=block_embeds.device)  # [bs]
        cos, sin = self.rope(qpos[None])  # [1, bs, D]
        masks: dict[int | None, tuple[int, torch.Tensor | None]] = {}  # window -> (first key, mask)
        x = block_embeds.to(self.dtype)
        for i, layer in enumerate(self.layers):
            w = layer.sliding_window
            if w not in masks:
                # a windowed layer never looks further back than start - w + 1: slice the keys there
                lo = 0 if w is None else max(0, start - w + 1)
                need = (w is not None and end - 1 - lo >= w) or cfg.is_causal
                kpos = torch.arange(lo, end, device=qpos.device)
                masks[w] = (lo, _visible(qpos, kpos, w, cfg.is_causal)[None] if need else None)
            lo, mask = masks[w]

            def join(k: torch.Tensor, v: torch.Tensor, i: int = i, lo: int = lo) -> tuple[torch.Tensor, ...]:
                # block K/V go to the scratch slots after the context (not committed: length is unchanged)
                cache.k[i, :, start:end] = k[0]
                cache.v[i, :, start:end] = v[0]
                return cache.k[i, None, :, lo:end], cache.v[i, None, :, lo:end]  # [1, nkv, S, D]

            x = layer(x, cos, sin, join, mask, bs)
        return self.norm(x)

    # ---- training ------------------------------------------------------------------------------------

    def anchor_blocks(
        self,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        anchors: torch.Tensor,
        block_embeds: torch.Tensor,
    ) -> torch.Tensor:
        """The block forward of training: hidden states [B, C, bs, H] after the final norm of the embedded
        blocks block_embeds [B, C, bs, H] at anchors [B, C], against per-layer context K/V [B, nkv, T, D]
        (`context_kv`). Block-sparse mask: the block at anchor a (positions a..a+bs-1) sees the context
        positions < a and its own block (bidirectionally), never another block; window / causal rules of
        the config on top."""
        cfg = self.cfg
        B, C, bs, _ = block_embeds.shape
        T, dev = ctx_kv[0][0].shape[2], block_embeds.device
        ctx_pos = torch.arange(T, device=dev)  # [T]
        qpos = (anchors[:, :, None] + torch.arange(bs, device=dev)).reshape(B, C * bs)  # [B, C*bs]
        block_of = torch.arange(C, device=dev).repeat_interleave(bs)  # [C*bs]
        anc_q = anchors.repeat_interleave(bs, dim=1)  # [B, C*bs]
        m_ctx = ctx_pos[None, None, :] < anc_q[:, :, None]  # [B, C*bs, T]
        m_blk = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)  # [B, C*bs, C*bs]
        base = torch.cat([m_ctx, m_blk], dim=2)  # [B, C*bs, T + C*bs]
        kpos = torch.cat([ctx_pos.expand(B, T), qpos], dim=1)  # [B, T + C*bs]
        masks = {}
        for w in {layer.sliding_window for layer in self.layers}:
            extra = _visible(qpos, kpos, w, cfg.is_causal)
            masks[w] = base if extra is None else base & extra
        x = block_embeds.reshape(B, C * bs, -1).to(self.dtype)  # [B, C*bs, H]
        cos, sin = self.rope(qpos)  # [B, C*bs, D]
        for i, layer in enumerate(self.layers):

            def join(k: torch.Tensor, v: torch.Tensor, i: int = i) -> tuple[torch.Tensor, ...]:
                ck, cv = ctx_kv[i]
                return torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2)  # [B, nkv, T + C*bs, D]

            x = layer(x, cos, sin, join, masks[layer.sliding_window], bs)
        return self.norm(x).view(B, C, bs, -1)

    def forward_train(
        self,
        features: torch.Tensor,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        *,
        attn_chunk: int | None = None,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """All anchor blocks of a batch of sequences in one call (`anchor_blocks`, `attn_chunk` anchors at a
        time to bound the attention memory; None: all at once). features [B, T, K*H] teacher-forced target
        features, block_embeds [B, A, bs, H] the embedded blocks `[x_anchor, MASK...]`, anchors [B, A].
        Returns head(hidden) (`head`, e.g. the LM head, applied per chunk) or hidden [B, A, bs, H]."""
        T, A = features.shape[1], anchors.shape[1]
        ctx = self.project(features.to(self.dtype))  # [B, T, H]
        ctx_kv = self.context_kv(
            ctx, torch.arange(T, device=features.device)[None]
        )  # per layer [B, nkv, T, D]
        chunk = attn_chunk or A
        outs = []
        for c0 in range(0, A, chunk):
            x = self.anchor_blocks(ctx_kv, anchors[:, c0 : c0 + chunk], block_embeds[:, c0 : c0 + chunk])
            outs.append(head(x) if head is not None else x)
        return torch.cat(outs, dim=1)

    def train_logits(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        embed_fn: EmbedFn,
        lm_head_fn: LMHeadFn,
        *,
        attn_chunk: int | None = None,
    ) -> torch.Tensor:
        """Block logits [B, A, bs, V] for anchors [B, A] of sequences input_ids [B, T] with features
        [B, T, K*H]. Position k of the block for anchor a is trained on input_ids[a + k] (k >= 1)."""
        bs, mask_id = self.cfg.block_size, self.cfg.mask_token_id
        first = torch.gather(input_ids, 1, anchors)  # [B, A] the anchor tokens
        ids = torch.full((*anchors.shape, bs), mask_id, dtype=input_ids.dtype, device=input_ids.device)
        ids[:, :, 0] = first  # [B, A, bs]
        return self.forward_train(features, embed_fn(ids), anchors, attn_chunk=attn_chunk, head=lm_head_fn)


# ----------------------------------------------------------------------------------------------------------
# proposer


@dataclass(frozen=True)
class BlockProposal:
    """One drafted block."""

    tokens: list[int]
    diffusion_steps: int  # denoising passes over the block (1 for DFlash)
    forward_passes: int  # drafter forwards spent (1)
    peak_activation_bytes: int | None  # allocator peak above what was held before the call; None: unmeasured
    peak_memory: MemoryRecord | None  # the device probe's record around the call; None: not measured


class DFlashProposer:
    """Proposes blocks from a `DFlashDraftModel` and the verifier's embedding / LM head callbacks.

    Owns the context cache: `extend(features)` after each commit, `rollback(n)`, `reset()`. Committed
    features are projected into the cache when a proposal needs them, all at once: behind `+lookup` most
    steps draft without DFlash, and projecting every commit cost ~1.7 ms of a ~50 ms step on a 2-core CPU.
    With `measure_memory` every proposal resets and reads the device's memory probe (costs a little).
    """

    def __init__(
        self,
        model: DFlashDraftModel,
        embed_fn: EmbedFn,
        lm_head_fn: LMHeadFn,
        *,
        measure_memory: bool = False,
        capacity: int = 256,
    ) -> None:
        """`lm_head_fn` maps to the model's draft vocabulary ([..., K] over `model.draft_vocab`) when it
        has one, else to the full vocabulary."""
        self.model, self.embed_fn, self.lm_head_fn = model, embed_fn, lm_head_fn
        self.cfg = cfg = model.cfg
        self.rows = model.draft_vocab  # [K] or None
        self.d2 = cfg.dflash2  # DFlash2's read-out and selector, or None
        # the mask token is never proposed (DFlash2 keeps the public reference's read-out as it is)
        self._mask_col = cfg.mask_column if self.d2 is None else None  # from the config: no device read
        self.block_size = cfg.block_size
        self.measure_memory = measure_memory
        self.cache = DFlashCache(cfg, device=model.device, dtype=model.dtype, capacity=capacity)
        # [bs] the block ids [bonus, MASK...]; only slot 0 changes per proposal
        self._block_ids = torch.full(
            (cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=model.device
        )
        self._probe: MemoryProbe | None = None
        self._pending: list[torch.Tensor] = []  # features [n_i, K*H] committed since the last projection

    @property
    def context_len(self) -> int:
        return self.cache.length + sum(f.shape[0] for f in self._pending)

    def reset(self) -> None:
        self.cache.crop(0)
        self._pending = []

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.context_len:
            raise ValueError(f"cannot roll back {n} positions: the drafter holds {self.context_len}")
        self._project()
        self.cache.crop(self.cache.length - n)

    @torch.inference_mode()
    def _project(self) -> None:
        if self._pending:
            feats = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending)  # [n, K*H]
            self._pending = []
            self.model.extend_cache(self.cache, feats.to(device=self.model.device))

    @torch.inference_mode()
    def extend(self, features: torch.Tensor) -> None:
        """Append committed positions: features [n, K*H] (projected by the next proposal)."""
        if features.dim() != 2 or features.shape[1] != self.cfg.feature_dim:
            raise ValueError(
                f"features must be [n, {self.cfg.feature_dim}] (K={self.cfg.num_target_features} x "
                f"H={self.cfg.hidden_size}), got {list(features.shape)}"
            )
        if features.shape[0]:
            self._pending.append(features)

    @torch.inference_mode()
    def block_hidden(self, last_token: int) -> torch.Tensor:
        """Hidden states [bs, H] of the block [last_token, MASK...] with `last_token` at context_len."""
        self._project()
        self._block_ids[0] = last_token  # a device-side fill: no host sync
        emb = self.embed_fn(self._block_ids)[None]  # [1, bs, H]
        if self.d2 is not None and self.d2.input_embedding_scale != 1.0:
            emb = emb * self.d2.input_embedding_scale
        return self.model.forward_cached(self.cache, emb)[0]  # [bs, H]

    @torch.inference_mode()
    def block_logits(self, last_token: int, n: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, K] over the draft vocabulary (K = V without one) of block positions 1..n, the mask
        token at -inf (DFlash2: times its output multiplier, soft-capped), with `last_token` at
        context_len; `hidden` [bs, H] when `block_hidden` was already run."""
        hidden = self.block_hidden(last_token) if hidden is None else hidden
        logits = self.lm_head_fn(hidden[1 : n + 1])  # [n, K]
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

    def propose_block(
        self, last_token: int, n: int | None = None, *, policy: DraftPolicy | None = None
    ) -> BlockProposal:
        """Greedy block: n tokens (default block_size - 1) to follow `last_token`, cut by `policy` (its
        top-1 probabilities as the confidence: `DraftPolicy.cut`; None: whole).

        Always runs the full block (what the model was trained on) and keeps the first n: where a verify of
        several tokens costs much more than a one-token step (CPUs), unlikely drafts are not worth
        verifying."""
        n = self.block_size - 1 if n is None else n
        if not 0 <= n < self.block_size:
            raise ValueError(f"can propose 0..{self.block_size - 1} tokens per block, asked for {n}")
        if n == 0:
            return BlockProposal([], 0, 0, None, None)
        dev = self.model.device
        cuda = self.measure_memory and dev.type == "cuda"
        before = torch.cuda.memory_allocated(dev) if cuda else 0
        if self.measure_memory:
            self._probe = self._probe or self.memory_probe()
            self._probe.reset()
        if self.d2 is not None:
            draft = self._walk_draft(last_token, n, policy)
            return BlockProposal(draft.tokens, 1, 1, *self._measured(cuda, before))
        logits = self.block_logits(last_token, n)  # [n, K]
        cut = policy is not None and policy.needs_confidence("dflash")
        if cut:
            top, best = logits.float().softmax(dim=-1).max(dim=-1)  # [n], [n] columns
        else:
            best = logits.argmax(dim=-1)  # [n] columns
        if self.rows is not None:
            best = self.rows[best]  # [n] vocabulary ids
        draft = Draft(best.tolist(), "dflash")  # the one sync of a proposal
        if cut:
            draft = policy.cut(Draft(draft.tokens, "dflash", top.tolist()))  # computed by now: no second wait
        return BlockProposal(draft.tokens, 1, 1, *self._measured(cuda, before))

    def _walk_draft(self, last_token: int, n: int, policy: DraftPolicy | None) -> Draft:
        """DFlash2's greedy walk, cut by `policy` with the walk's own chances."""
        walk = self.walk(last_token, n)
        if policy is None or not policy.needs_confidence("dflash"):
            return Draft(walk.tokens.tolist(), "dflash")  # the one sync of a proposal
        return policy.cut(Draft(walk.tokens.tolist(), "dflash", walk.chances().tolist()))

    def _measured(self, cuda: bool, before: int) -> tuple[int | None, MemoryRecord | None]:
        """(peak activation bytes, the probe's record) of a proposal, when memory is measured."""
        if not self.measure_memory:
            return None, None
        peak = int(torch.cuda.max_memory_allocated(self.model.device)) - before if cuda else None
        return peak, self._probe.read()

    def memory_probe(self) -> MemoryProbe:
        from specdec.memory import probe_for_module

        return probe_for_module(self.model)


# ----------------------------------------------------------------------------------------------------------
# Drafter protocol adapter


class DFlashDrafter:
    """The `Drafter` protocol over a DFlash model. `bind(verifier)` before `extend` / `propose`."""

    runtime = "torch"

    def __init__(
        self,
        model: DFlashDraftModel,
        *,
        name: str = "dflash",
        measure_memory: bool = False,
        policy: DraftPolicy | None = None,
    ) -> None:
        """`policy`: where each greedy block is cut (`DraftPolicy`: by the running top-1 probability, or
        by verify cost); the default proposes whole blocks."""
        self.policy = policy or DraftPolicy()
        cfg = model.cfg
        self.model = model.eval()
        use_cpu_linears(model)  # on a CPU: a block costs much less (see specdec.kernels)
        self.cfg = cfg
        self.name = name
        self.block_size = cfg.block_size
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.feature_dim = cfg.feature_dim
        self.vocab_size: int | None = cfg.vocab_size
        self.mask_token_id = cfg.mask_token_id
        self.device, self.dtype = model.device, model.dtype
        self.measure_memory = measure_memory
        self.proposer: DFlashProposer | None = None
        self.path: str | None = None  # the checkpoint folder it was loaded from

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

    def _need(self) -> DFlashProposer:
        if self.proposer is None:
            raise RuntimeError(f"drafter {self.name!r} is not bound: call bind(verifier) first")
        return self.proposer

    @property
    def context_len(self) -> int:
        return 0 if self.proposer is None else self.proposer.context_len

    def bind(self, verifier: Verifier) -> None:
        check_target(self.cfg, verifier, name=self.name)
        embed = verifier.embed_fn(device=self.device, dtype=self.dtype)
        rows = self.model.draft_vocab
        head = verifier.lm_head_fn(device=self.device, dtype=self.dtype, rows=rows)  # [..., K] (or V)
        self.bind_fns(embed, head, over_draft_vocab=True)

    def bind_fns(self, embed_fn: EmbedFn, lm_head_fn: LMHeadFn, *, over_draft_vocab: bool = False) -> None:
        """Bind the embedding / LM head callbacks directly (no verifier checks). `lm_head_fn` maps to the
        full vocabulary unless `over_draft_vocab` (then to the model's draft vocabulary, as the verifiers'
        `lm_head_fn(rows=...)` build it, which skips the unused rows)."""
        rows = self.model.draft_vocab
        if rows is not None and not over_draft_vocab:
            full_head = lm_head_fn

            def lm_head_fn(h: torch.Tensor) -> torch.Tensor:
                return full_head(h).index_select(-1, rows)  # [..., K]

        self.proposer = DFlashProposer(self.model, embed_fn, lm_head_fn, measure_memory=self.measure_memory)

    def reset(self) -> None:
        if self.proposer is not None:
            self.proposer.reset()

    def extend(self, features: torch.Tensor, tokens: Sequence[int]) -> None:
        if features.shape[0] != len(tokens):
            raise ValueError(
                f"extend got features for {features.shape[0]} positions but {len(tokens)} tokens"
            )
        self._need().extend(features)  # DFlash conditions on features only; the tokens are not needed

    def propose(self, last_token: int, n: int) -> list[int]:
        proposer = self._need()
        return proposer.propose_block(last_token, n, policy=self.policy).tokens

    def propose_logits(self, last_token: int, n: int) -> torch.Tensor:
        """Logits [n, V] of the next n positions, for sampled proposals at temperature > 0."""
        return self._need().vocab_logits(last_token, n)

    def propose_tree(self, last_token: int, depth: int, budget: TreeBudget) -> Tree:
        """A tree of the block's candidates, best first by path probability (`specdec.tree.best_first`)."""
        return best_first(last_token, self._need().vocab_logits(last_token, depth), budget)  # [depth, V]

    @property
    def walks(self) -> bool:
        """DFlash2: sampled proposals are the selector's walk (`propose_walk`), not independent rows."""
        return self.cfg.dflash2 is not None

    def propose_walk(
        self, last_token: int, n: int, *, temperature: float, u: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """DFlash2 at temperature > 0: the selector's walk sampled with uniforms u [n] -> (tokens, q [n, V],
        each row the distribution its token was drawn from given the tokens before it)."""
        walk = self._need().walk(last_token, n, temperature=temperature, u=u)
        return walk.tokens.tolist(), walk.dense(self.cfg.vocab_size)

    def rollback(self, n: int) -> None:
        self._need().rollback(n)

    def memory_probe(self) -> MemoryProbe:
        from specdec.memory import probe_for_module

        return probe_for_module(self.model)
