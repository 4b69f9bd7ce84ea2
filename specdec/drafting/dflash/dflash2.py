"""The parts DFlash2 adds to the DFlash drafter (PyTorch): the grouped dynamic causal convolution around
each layer's attention and MLP, and the candidate selector that turns a block's logits into a draft.

Semantics (the public format, as z-lab/dflash `DFlash2DraftModel` and vLLM `qwen3_dflash2` read it):
- `DynamicConv`: for a sublayer with normed input h, `kernel_projection(h)` gives per position two sides
  of `taps` dynamic taps per group of `group` channels. Side 0 convolves h before the sublayer, side 1 the
  sublayer's output: out[t] = sum_j (base_kernel[side, j] + dynamic[t, side, j, group]) * x[t - j], over
  the positions of one block only (x before the block's first position is zero).
- `CandidateSelector`: the top-k candidates of each block position, scored by their logit plus
  `<predecessor_codebook[prev] * hidden_projection(h), successor_codebook[candidate]>`, and walked from the
  last committed token: each position takes the best candidate (or samples one, at a temperature) given
  the one chosen before it. The walk's own distribution over the k candidates is what a `rejection` rule
  verifies against, and its top probability what a confidence cut reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafting.dflash.config import DFlashConfig
from specdec.sampling import sample_from

__all__ = ["CandidateSelector", "DynamicConv", "Walk"]


class DynamicConv(nn.Module):
    """`attention_conv` / `mlp_conv` of one DFlash2 layer (see the module docstring)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        d2, H = cfg.dflash2, cfg.hidden_size
        self.taps, self.group = d2.conv_kernel_size, d2.conv_group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, H))  # [side, taps, H]
        self.kernel_projection = nn.Linear(H, 2 * self.taps * (H // self.group), bias=False)

    def dynamic(self, h: torch.Tensor) -> torch.Tensor:
        """Normed sublayer input h [B, L, H] -> dynamic taps [B, L, 2, taps, G]."""
        return self.kernel_projection(h).unflatten(-1, (2, self.taps, h.shape[-1] // self.group))

    def forward(self, x: torch.Tensor, dyn: torch.Tensor, side: int, block: int) -> torch.Tensor:
        """x [B, L, H], L a multiple of `block` (each block convolved on its own) -> [B, L, H]."""
        B, L, H = x.shape
        G = H // self.group
        xs = x.view(B, L // block, block, G, self.group)  # [B, C, bs, G, g]
        d = dyn[:, :, side].reshape(B, L // block, block, self.taps, G, 1)  # [B, C, bs, taps, G, 1]
        base = self.base_kernel[side].view(self.taps, G, self.group).to(x.dtype)  # [taps, G, g]
        out = torch.zeros_like(xs)
        for j in range(min(self.taps, block)):
            src = xs if j == 0 else F.pad(xs[:, :, :-j], (0, 0, 0, 0, j, 0))  # x[t - j], zero before t = j
            out = out + base[j] * src
            out = out + d[:, :, :, j] * src
        return out.view(B, L, H)


class Walk:
    """A drafted walk: `tokens` [n] (a device tensor), the walk's distribution over each position's
    candidates `probs` [n, k] and their ids `candidates` [n, k]."""

    def __init__(self, tokens: torch.Tensor, probs: torch.Tensor, candidates: torch.Tensor) -> None:
        self.tokens, self.probs, self.candidates = tokens, probs, candidates

    def chances(self) -> torch.Tensor:
        """[n] the walk's probability of each token it took."""
        return self.probs.max(dim=-1).values

    def dense(self, vocab_size: int) -> torch.Tensor:
        """[n, V] the walk's distribution at each position over the vocabulary (0 off its candidates)."""
        q = self.probs.new_zeros(self.probs.shape[0], vocab_size)
        return q.scatter_(1, self.candidates, self.probs)


class CandidateSelector(nn.Module):
    """`candidate_selector` of a DFlash2 drafter (see the module docstring)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        d2 = cfg.dflash2
        self.top_k = d2.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, d2.selector_rank, bias=False)
        # bare tensors in the public format (no `.weight`)
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, d2.selector_rank))  # [V, R]
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, d2.selector_rank))  # [V, R]

    def walk(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        first: int,
        *,
        temperature: float = 0.0,
        u: torch.Tensor | None = None,
    ) -> Walk:
        """hidden [n, H] and logits [n, V] of block positions 1..n -> the walk from token `first`: greedy
        (temperature 0: its `probs` are the softmax of the scores at temperature 1, for confidence cuts),
        or sampled at `temperature` with the uniforms u [n]. Scores in fp32; no host sync."""
        unary, cand = logits.float().topk(self.top_k, dim=-1)  # [n, k]
        proj = self.hidden_projection(hidden).float()  # [n, R]
        succ = self.successor_codebook[cand].float()  # [n, k, R]
        prev = torch.tensor([first], device=hidden.device)  # [1]
        tokens, probs = [], []
        for p in range(hidden.shape[0]):
            pre = self.predecessor_codebook[prev].float() * proj[p]  # [1, R]
            scores = unary[p] + (succ[p] @ pre[0])  # [k]
            if temperature > 0:
                q = (scores / temperature).softmax(-1)  # [k]
                idx = sample_from(q[None], u[p : p + 1].to(q.device))  # [1]
            else:
                q, idx = scores.softmax(-1), scores.argmax(-1, keepdim=True)
            prev = cand[p].gather(0, idx)  # [1]
            tokens.append(prev)
            probs.append(q)
        return Walk(torch.cat(tokens), torch.stack(probs), cand)
