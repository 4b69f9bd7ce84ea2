"""Several sequences on one stub model, their calls verified together in one forward.

`StubBatch(verifier)` hands out `StubSequence`s: each the Verifier protocol with a KV buffer of its own
over the shared `StubModel`. Members' calls meet in the batch (`specdec.rendezvous`) and run as one pass
of the model's layers over their tokens packed into one row sequence [sum T], each at its own positions:
every linear computes all rows in one product, and each layer's attention is each sequence's own call
(`StubVerifier.attend` on its buffer, the same shapes as alone), so a row's result depends on the rows
beside it only through the linears, which `StubVerifier.batch_invariant` measured row-invariant on this
model here. The batch measures calls together against the same calls alone once more when it is made
(`rendezvous.solo_mismatch`) and refuses in one line where they differ (fp32 here, as on HF).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.kernels import TreeAttention
from specdec.protocols import check_call
from specdec.rendezvous import Call, Member, Rendezvous, solo_mismatch
from specdec.verifiers.stub import StubVerifier

__all__ = ["StubBatch", "StubSequence"]


class StubSequence(Member, StubVerifier):
    """One sequence of a `StubBatch`: a `StubVerifier` with its own KV buffer whose calls go through it."""

    def __init__(self, batch: StubBatch) -> None:
        self.join(batch)
        self._kv = torch.zeros_like(batch.base._kv)
        self._layer_ids, self._captured, self._pos = (), None, 0

    def forward(
        self, tokens: Sequence[int], *, last_only: bool = False, tree: TreeAttention | None = None
    ) -> torch.Tensor:
        if tree is not None:
            self.check_tree()
        check_call(len(tokens), self._pos, self.cfg.max_context)
        return self.batch.call(self, list(tokens), last_only)


class StubBatch(Rendezvous):
    """Sequences on one `StubVerifier` whose calls are verified together (module docstring)."""

    def __init__(self, verifier: StubVerifier) -> None:
        super().__init__(verifier)
        if not verifier.batch_invariant:
            self.refuse(f"its {verifier.dtype} verify is not batch-invariant here (measured at load)")
        self.refuse(solo_mismatch(self))

    def sequence(self) -> StubSequence:
        return StubSequence(self)

    @torch.inference_mode()
    def _forward(self, group: list[Call]) -> list[torch.Tensor]:
        """One pass of the layers over the group's calls (module docstring); each call's logits."""
        if len(group) == 1:  # as `StubVerifier.forward`
            seq, (tokens, last_only, _) = group[0]
            return [StubVerifier.forward(seq, tokens, last_only=last_only)]
        seqs = [seq for seq, _ in group]
        spans, s = [], 0
        for _, (tokens, _, _) in group:
            spans.append((s, s + len(tokens)))
            s += len(tokens)
        rows = [torch.arange(q._pos, q._pos + b - a) for q, (a, b) in zip(seqs, spans)]  # positions [T]
        masks = [p[:, None] >= torch.arange(p[-1] + 1)[None, :] for p in rows]  # causal [T, p0+T], per call

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = [  # each sequence's call as alone: [nh, T, hd]
                seq.attend(li, q[:, a:b], k[:, a:b], v[:, a:b], mask)
                for seq, (a, b), mask in zip(seqs, spans, masks, strict=True)
            ]
            return torch.cat(out, 1)  # [nh, sum T, hd]

        ids = [t for _, (tokens, _, _) in group for t in tokens]
        wanted = sorted({i for seq in seqs for i in seq._layer_ids})
        x, captured = self.base.layers(ids, torch.cat(rows), attend, wanted)  # [sum T, H]
        keep: list[int] = []  # the rows whose logits are asked for
        for (_, (_, last_only, _)), (a, b) in zip(group, spans, strict=True):
            keep += [b - 1] if last_only else range(a, b)
        logits = self.base.head(x[keep])  # [rows kept, V]
        out, row = [], 0
        for seq, (_, (_, last_only, _)), (a, b) in zip(seqs, group, spans, strict=True):
            n = 1 if last_only else b - a
            out.append(logits[row : row + n])
            row += n
            seq._pos += b - a
            feats = [captured[i][a:b] for i in seq._layer_ids]
            seq._captured = torch.cat(feats, -1) if feats else None  # [T, K*H]
        return out
