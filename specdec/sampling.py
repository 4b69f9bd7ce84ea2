"""Sampling at temperature > 0 that keeps the verifier's distribution exactly.

`warp` is the one definition of the target distribution (temperature, then top-k, then top-p, then
min-p, as HF's logits processors apply them); plain sampling (block_size 1) and both verification
rules use it, so speculation never changes what is sampled from.

Randomness is indexed by absolute sequence position: each request draws, from its seed, one uniform
per position for each purpose (verifier sample, acceptance test, residual resample, draft sample).
Every committed position consumes its uniforms once, and uniforms of positions past a rejection were
never looked at by anything that was committed, so they stay fresh for the next step. Hence:
- rule "match": the verifier samples its own token at each position by inverse CDF with that
  position's uniform and drafts are accepted while they equal those samples. The committed token at
  position t is a function of (p_t, u_t) alone, so with the same seed the output is identical with or
  without speculation.
- rule "rejection" (Leviathan et al. / Chen et al.): accept draft x with probability
  min(1, p(x) / q(x)), on rejection resample from norm(max(0, p - q)), bonus from p when all drafts pass.
  The output distribution equals plain sampling, but the exact tokens differ from the match rule for
  the same seed. With argmax proposals q is one-hot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

RULES = ("match", "rejection")
PROPOSALS = ("argmax", "sample")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    seed: int = 0
    rule: str = "match"
    proposal: str = "argmax"  # how the drafter turns its logits into a draft at T > 0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in 0..2**63-1, got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {self.proposal!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits [T, V] -> probabilities [T, V] (fp32) of the distribution plain sampling draws from. Limits
    are taken as limits: a temperature so small that logits / T overflows gives the top token (the top
    tokens, shared equally, at an exact tie), a top_p below fp32's smallest number keeps the top token."""
    x = logits.float()
    # shifted so the top logit is 0: dividing by a tiny temperature then gives 0 and -inf, never inf - inf
    x = (x - x.amax(-1, keepdim=True)) / sp.temperature
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = x.topk(sp.top_k, dim=-1).values[..., -1:]  # [T, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if sp.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        # drop a token when the mass before it already reaches top_p; the top token always stays (a top_p
        # that fp32 rounds to 0 would otherwise drop it too)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= sp.top_p
        drop[..., 0] = False
        probs = probs.masked_fill(drop.scatter(-1, order, drop), 0.0)
    if sp.min_p > 0:
        probs = probs.masked_fill(probs < sp.min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs [T, V], u [T] in [0, 1) -> ids [T]; zero-probability ids never come out."""
    cdf = probs.cumsum(-1)  # [T, V]
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).to(cdf.dtype), right=True).squeeze(-1)
    idx = idx.clamp(max=probs.shape[-1] - 1)
    # searchsorted may land on a zero-probability id right after a plateau (u == boundary): step back
    bad = probs.gather(-1, idx[:, None]).squeeze(-1) == 0
    return torch.where(bad, probs.argmax(-1), idx)  # no `if bad.any()`: that would be a device sync


class Sampler:
    """Per-request sampling state: the seeded per-position uniforms and the verification rule."""

    def __init__(self, sp: SamplingParams, max_positions: int) -> None:
        self.sp = sp
        g = torch.Generator().manual_seed(sp.seed)
        # [4, max_positions]: verifier sample, acceptance test, residual resample, draft sample; drawn on the
        # CPU (the same numbers on every device), float32 (MPS has no float64), moved to the logits' device
        self._u = torch.rand(4, max_positions + 1, generator=g, dtype=torch.float32)
        self._on: dict[torch.device, torch.Tensor] = {}
        self.resampled = 0  # residual resamples in the last verify (0 or 1)

    def u(self, row: int, start: int, n: int, like: torch.Tensor) -> torch.Tensor:
        """[n] uniforms of `row` from position `start`, on `like`'s device."""
        if like.device not in self._on:
            self._on[like.device] = self._u.to(like.device)
        return self._on[like.device][row, start : start + n]

    def first(self, logits: torch.Tensor, pos: int) -> int:
        """The token at position `pos` from the last prompt position's logits [1, V]."""
        return int(sample_from(warp(logits, self.sp), self.u(0, pos, 1, logits)))

    def draft_uniforms(self, pos: int, k: int) -> torch.Tensor:
        """[k] the draft-sampling uniforms of positions pos..pos+k-1 (CPU), for a drafter that samples
        its own walk (`specdec.protocols.SampledWalk`)."""
        return self._u[3, pos : pos + k]

    def propose(self, draft_logits: torch.Tensor, pos: int) -> tuple[list[int], torch.Tensor]:
        """Sampled proposals: draft_logits [k, V] for positions pos..pos+k-1 -> (tokens, q [k, V])."""
        q = warp(draft_logits, self.sp)
        k = q.shape[0]
        return sample_from(q, self.u(3, pos, k, q)).tolist(), q

    def verify_tree(self, logits: torch.Tensor, depths: list[int], pos: int) -> list[int]:
        """A tree verify under the `match` rule: logits [N, V] of nodes at positions pos + depths[i] -> the
        verifier's token after each node, sampled with its position's uniform (`specdec.tree`)."""
        p = warp(logits, self.sp)  # [N, V]
        u = self.u(0, pos, max(depths) + 1, p)[torch.tensor(depths, device=p.device)]  # [N]
        return sample_from(p, u).tolist()

    def verify(
        self,
        logits: torch.Tensor,
        draft: list[int],
        q: torch.Tensor | None,
        pos: int,
        *,
        cut: torch.Tensor | None = None,
    ) -> list[int]:
        """logits [k+1, V] for positions pos..pos+k -> targets whose prefix agreement with `draft` is
        the accepted count, followed by the verifier's token (resampled or bonus). `cut` [V]: the q of a
        sampled draft after the last one, left out unverified because p gives it no mass (a grammar forbids
        it); its certain rejection is taken (the residual), not a bonus from p, which would not be exact."""
        p = warp(logits, self.sp)  # [k+1, V]
        k = len(draft)
        self.resampled = 0
        if self.sp.rule == "match":
            return sample_from(p, self.u(0, pos, k + 1, p)).tolist()
        d = torch.tensor(draft, dtype=torch.long, device=p.device)
        rows = torch.arange(k, device=p.device)
        px = p[rows, d]  # [k]
        qx = q[rows, d].to(p.device) if q is not None else torch.ones(k, device=p.device)  # argmax: q one-hot
        ok = (self.u(1, pos, k, p) * qx < px).tolist()  # accept with prob min(1, p/q)
        a = ok.index(False) if False in ok else k
        if a == k and cut is not None:
            self.resampled = 1
            residual = (p[k] - cut.to(p.device)).clamp(min=0)  # mass: p != cut, which holds a token p has not
            return [*draft, int(sample_from(residual[None], self.u(2, pos + k, 1, p)))]
        if a == k:
            return [*draft, int(sample_from(p[k : k + 1], self.u(0, pos + k, 1, p)))]
        residual = p[a] - (
            q[a].to(p.device) if q is not None else torch.nn.functional.one_hot(d[a], p.shape[-1]).float()
        )
        # rejection implies p(x) < q(x), so the residual has mass and excludes x
        residual = residual.clamp(min=0)
        self.resampled = 1
        tok = int(sample_from(residual[None], self.u(2, pos + a, 1, p)))
        assert tok != draft[a], "a residual sample cannot equal the rejected draft"
        return [*draft[:a], tok]
