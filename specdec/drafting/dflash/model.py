"""The DFlash draft model in PyTorch (arXiv 2602.06036): a few Qwen3-style decoder layers with no embedding
and no LM head of its own, whose context keys and values come from the verifier's features.

The block `[bonus, MASK x (bs-1)]` is embedded with the verifier's `embed_fn` and read out through its
`lm_head_fn`. The verifier's features of the committed context (K chosen decoder-layer outputs,
concatenated) are projected once, `hidden_norm(fc(features))`, and injected into every layer as extra
keys/values (through that layer's k_proj/v_proj, k_norm and RoPE at the context positions); only block
tokens make queries. Block position k predicts the token AT position k, so a block of 16 proposes 15 tokens.
Inference keeps the context K/V of every layer in preallocated buffers with a length pointer
(`DFlashCache`, gpt-fast style). `DFlashDraftModel.anchor_blocks` is the training-time block forward over
many anchor blocks of a sequence with the block-sparse mask (a block sees the context strictly before its
anchor and its own block, never other blocks); `forward_train` runs it `attn_chunk` anchors at a time, and
so does the training loss (`specdec.train`). DFlash2's parts: `specdec.drafting.dflash.dflash2`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafting.dflash.config import SLIDING, DFlashConfig
from specdec.drafting.dflash.dflash2 import CandidateSelector, DynamicConv
from specdec.drafting.layers import RMSNorm, apply_rope, attend, rope_cos_sin
from specdec.drafting.rope import rope_frequencies
from specdec.protocols import EmbedFn, LMHeadFn

__all__ = ["DFlashCache", "DFlashDraftModel"]


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
        return apply_rope(q, cos, sin)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k, v [B, nkv, T, D] (k normed and rotated)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v


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
        o = attend(q, keys, values, mask).transpose(1, 2).reshape(B, Tq, -1)  # [B, Tq, nh*D]
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
        self.markov_head = self.confidence_head = self.embed_tokens = None
        if cfg.dspark is not None:  # DSpark's Markov and confidence heads (`specdec.drafting.dflash.dspark`)
            from specdec.drafting.dflash.dspark import torch_heads

            self.markov_head, self.confidence_head = torch_heads(cfg)
            if cfg.dspark.own_embeddings:
                self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.own_lm_head:  # a speculators checkpoint's head over its draft vocabulary
            self.lm_head = nn.Linear(
                cfg.hidden_size, len(cfg.draft_vocab or ()) or cfg.vocab_size, bias=False
            )

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
        return rope_cos_sin(positions, self._inv_freq, self.dtype, self._rope_scale)

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
