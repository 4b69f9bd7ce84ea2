"""Teacher-forced target features, computed online from token ids by the verifier itself.

Stored features do not fit a corpus at scale: SmolLM2-135M with 6 target layers gives 3456 values per
token, ~35 GB in bf16 for 5M tokens. So each training batch runs the verifier (inference mode, fp32,
batched where the runtime can: `HFVerifier.batch_features`) over its sequences and hands the drafter the
outputs of the target layers; with `topk` also the verifier's top-k next-token log-probs (soft labels for
the KL term). Any other verifier answers one sequence at a time through the protocol (`reset`,
`set_target_layers`, `prefill` / `verify`, `features`), which is exactly what decoding sees.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.protocols import BatchFeatures, Verifier

__all__ = ["TargetFeatures"]


class TargetFeatures:
    """features [B, T, K*H] (and top-k soft labels) of right-padded sequences, from `verifier`."""

    def __init__(self, verifier: Verifier, layer_ids: Sequence[int], *, topk: int = 0) -> None:
        if not 0 <= topk <= verifier.vocab_size:
            raise ValueError(f"topk must be in 0..{verifier.vocab_size}, got {topk}")
        self.verifier, self.layer_ids, self.topk = verifier, tuple(layer_ids), topk
        self.width = len(self.layer_ids) * verifier.hidden_size

    def __call__(
        self, ids: torch.Tensor, lengths: Sequence[int], *, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """ids [B, T] (positions past each length are padding) -> features [B, T, K*H] fp32 on `device`,
        top-k log-probs [B, T, k] and ids [B, T, k] (None without topk); values at padding positions are
        unspecified (no anchor block ever reads them)."""
        v = self.verifier
        if isinstance(v, BatchFeatures):
            feats, lp, ti = v.batch_features(ids, self.layer_ids, topk=self.topk)
            move = lambda t: None if t is None else t.to(device)  # noqa: E731
            return feats.to(device, torch.float32), move(lp), move(ti)
        B, T = ids.shape
        feats = torch.zeros(B, T, self.width, device=device)
        lp = torch.zeros(B, T, self.topk, device=device) if self.topk else None
        ti = torch.zeros(B, T, self.topk, dtype=torch.long, device=device) if self.topk else None
        for b, n in enumerate(lengths):
            seq = ids[b, :n].tolist()
            v.set_target_layers(self.layer_ids)
            v.reset()
            if self.topk:
                seen: list[torch.Tensor] = []
                v.verify(
                    seq, sample=lambda logits, seen=seen: seen.append(logits) or logits.argmax(-1).tolist()
                )
                top = torch.log_softmax(seen[0].float(), -1).topk(self.topk, dim=-1)  # from [n, V]
                lp[b, :n], ti[b, :n] = top.values.to(device), top.indices.to(device)
            else:
                v.prefill(seq)
            feats[b, :n] = v.features(n, device=device, dtype=torch.float32)
        v.set_target_layers(())
        v.reset()
        return feats, lp, ti
