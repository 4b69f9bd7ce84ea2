"""Medusa heads in PyTorch, beside a verifier that hands its final norm (`protocols.FinalNorm`: HF, stub;
what they compute: `config.py`).

They read one row of the verifier's features, its last decoder layer's output at the last committed
position, through the verifier's own final norm; every head drafts from that one state at once, so a
proposal is one batched matmul per residual layer and one for the heads, and the bonus token is not an
input (Medusa's heads never see it). Greedy drafts: at T > 0 the engine verifies them as point masses,
which keeps the verifier's distribution exact. A rollback moves a length pointer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.drafting.medusa.config import MedusaConfig, check_medusa_fits
from specdec.memory import probe_for_device
from specdec.protocols import FinalNorm, MemoryProbe

__all__ = ["MedusaDrafter"]


class MedusaDrafter:
    """The `Drafter` over a Medusa checkpoint's heads (module docstring). Build with `from_pretrained`."""

    runtime = "torch"

    def __init__(
        self,
        cfg: MedusaConfig,
        weights: dict[str, torch.Tensor],
        *,
        name: str,
        block_size: int | None,
        device: torch.device,
        dtype: torch.dtype,
        capacity: int = 256,
    ) -> None:
        self.cfg, self.name, self.device, self.dtype = cfg, name, device, dtype
        self.block_size = min(block_size or cfg.block_size, cfg.block_size)  # one draft per head at most
        self.feature_dim, self.vocab_size = cfg.hidden_size, cfg.vocab_size
        self.target_layer_ids: tuple[int, ...] = ()  # the verifier's last layer, at bind
        n, L, H, p = cfg.num_heads, cfg.num_layers, cfg.hidden_size, cfg.prefix
        w = lambda k: weights[p + k].to(device=device, dtype=dtype)  # noqa: E731
        self.w = torch.stack(
            [torch.stack([w(f"blocks.{i}.layers.{j}.weight") for j in range(L)]) for i in range(n)]
        )
        self.b = (
            torch.stack([torch.stack([w(f"blocks.{i}.layers.{j}.bias") for j in range(L)]) for i in range(n)])
            if cfg.fc_bias
            else torch.zeros(n, L, H, device=device, dtype=dtype)
        )
        self.heads = torch.stack(
            [w(f"lm_heads.{0 if cfg.shared_head else i}.weight") for i in range(n)]
        )  # [n, K, H]
        self.token_map = (
            weights[p + "token_map"].to(device).long() if p + "token_map" in weights else None
        )  # [K]
        self._hidden = torch.zeros(capacity, H, device=device, dtype=dtype)  # [T, H] last-layer outputs
        self._len = 0
        self._norm: Any = None

    @classmethod
    def from_pretrained(
        cls, folder: Path, cfg: MedusaConfig, *, name: str, block_size: int | None, device: Any, dtype: Any
    ) -> MedusaDrafter:
        """The heads of a checkpoint folder already read (`config.read_medusa`: `cfg`)."""
        from safetensors.torch import load_file

        weights = load_file(Path(folder) / cfg.weights_file)
        return cls(cfg, weights, name=name, block_size=block_size, device=torch.device(device), dtype=dtype)

    @property
    def context_len(self) -> int:
        return self._len

    def bind(self, verifier: Any) -> None:
        """Beside a verifier of the hidden size and vocabulary the heads were trained for: its last layer's
        outputs as features, its final norm (`FinalNorm`) applied here."""
        if not isinstance(verifier, FinalNorm):
            raise ValueError(
                f"drafter {self.name!r} (Medusa) reads the verifier's final norm, which the "
                f"{verifier.runtime} verifier does not hand out (the HF and stub verifiers do)"
            )
        check_medusa_fits(self.cfg, verifier, self.name)
        self._norm = verifier.final_norm_fn(device=self.device, dtype=self.dtype)
        self.target_layer_ids = (verifier.num_layers - 1,)
        self.reset()

    def reset(self) -> None:
        self._len = 0

    def extend(self, features: torch.Tensor, tokens: Any) -> None:
        n = len(tokens)
        if features.shape != (n, self.feature_dim):
            raise ValueError(f"features must be [{n}, {self.feature_dim}], got {list(features.shape)}")
        if self._len + n > self._hidden.shape[0]:
            grow = torch.zeros(2 * (self._len + n), self.feature_dim, device=self.device, dtype=self.dtype)
            grow[: self._len] = self._hidden[: self._len]
            self._hidden = grow
        self._hidden[self._len : self._len + n] = features.to(device=self.device, dtype=self.dtype)
        self._len += n

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._len:
            raise ValueError(f"cannot roll back {n} of {self._len} positions")
        self._len -= n

    @torch.inference_mode()
    def head_logits(self, n: int) -> torch.Tensor:
        """Logits [n, K] of the first n heads (over the draft vocabulary) at the last committed position."""
        h = self._norm(self._hidden[self._len - 1])  # [H], as the verifier's LM head reads it
        x = h.expand(n, -1)[:, None, :]  # [n, 1, H]: every head starts from the same state
        for j in range(self.cfg.num_layers):
            x = x + F.silu(torch.baddbmm(self.b[:n, j, None], x, self.w[:n, j].transpose(1, 2)))
        return torch.bmm(x, self.heads[:n].transpose(1, 2))[:, 0] * self.cfg.logit_scale  # [n, K]

    def propose(self, last_token: int, n: int) -> list[int]:
        n = min(n, self.block_size - 1)
        if n <= 0 or self._len == 0:
            return []
        ids = self.head_logits(n).argmax(-1)  # [n]
        return (ids if self.token_map is None else self.token_map[ids]).tolist()

    def describe(self) -> dict[str, Any]:
        """For the result JSON."""
        c = self.cfg
        return {"architecture": "medusa", "heads": c.num_heads, "layers_per_head": c.num_layers}

    def memory_probe(self) -> MemoryProbe:
        return probe_for_device(self.device)
