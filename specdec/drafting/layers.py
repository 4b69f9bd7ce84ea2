"""Torch building blocks the drafters' networks share: Qwen3's RMSNorm, rotate-half RoPE, GQA attention
without repeating K/V (DFlash, EAGLE-3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNorm", "apply_rope", "attend", "rope_cos_sin"]


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


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., T, D] for positions [..., T] (angles in fp32, as HF Qwen3; both times `scale`,
    YaRN's attention factor, before the cast)."""
    ang = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, D/2]
    ang = torch.cat([ang, ang], dim=-1)  # [..., T, D]
    if scale == 1.0:
        return ang.cos().to(dtype), ang.sin().to(dtype)
    return (ang.cos() * scale).to(dtype), (ang.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [B, nh, T, D]; cos/sin [B or 1, T, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
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
