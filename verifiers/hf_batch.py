"""Several sequences on one loaded HF model, their calls verified together in one forward.

`HFBatch(verifier)` hands out `HFSequence`s: each the Verifier protocol with a KV cache of its own, sharing
the model, its tokenizer and what was measured when it loaded. While sequences are members of the batch
(`member`, what `specdec.batch` holds around a request's run), a call of one (`prefill`, `verify`) waits
until every member has one waiting; then one forward runs them: their tokens packed into one row
sequence [1, sum T], each at its own positions, every linear computing all rows in one product, and
attention computed per sequence over its own cache (`hf_parts.attend_packed`). A call of more than
`MAX_VERIFY_TOKENS` tokens (a long prefill) runs alone, and calls are grouped so no forward holds more
rows than that.

Exact, or refused: each sequence gets bit for bit the logits its call alone gets where the model's rows do
not depend on the rows beside them: `HFVerifier.batch_invariant` (the linears up to `MAX_VERIFY_TOKENS`
rows and the invariant attention, measured on the loaded model at load) and, measured here once more on
the model, packed calls against the same calls alone (`rendezvous.solo_mismatch`). A model or machine
where that does not hold, and models with layers the packed forward does not cover yet, get a one-line
ValueError: their requests run one at a time. Sliding-window layers are packed: each sequence's rows see
the window its cache layer hands back; KV-shared layers (Gemma 4) read each sequence's shared keys;
attention sinks (gpt-oss) enter each row's softmax as alone. Gated DeltaNet layers run each sequence's
rows on that sequence's own states (`hf_parts.pack_linear_attention`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdec.protocols import check_layer_ids
from specdec.rendezvous import Member, Rendezvous, solo_mismatch
from specdec.verifiers.hf import HFVerifier
from specdec.verifiers.hf_parts import PACK, Packed, pack_linear_attention, packed_layer

__all__ = ["HFBatch", "HFSequence"]


class HFSequence(Member, HFVerifier):
    """One sequence of an `HFBatch`: an `HFVerifier` with its own cache whose calls go through the batch."""

    def __init__(self, batch: HFBatch) -> None:
        self.join(batch)
        self._hooks, self._captured, self._layer_ids = [], {}, ()
        self.reset()

    def set_target_layers(self, layer_ids: Sequence[int]) -> None:
        self._layer_ids = check_layer_ids(layer_ids, self.num_layers, self.model_name)  # the batch hooks them

    def forward(self, tokens: Sequence[int], *, last_only: bool = False, tree: Any = None) -> torch.Tensor:
        if tree is not None:
            self.check_tree()
        self._check_call(tokens)
        return self.batch.call(self, list(tokens), last_only)


class HFBatch(Rendezvous):
    """Sequences on one loaded `HFVerifier` whose calls are verified together (module docstring)."""

    def __init__(self, verifier: HFVerifier) -> None:
        super().__init__(verifier)
        self.refuse(_unsupported(verifier))
        pack_linear_attention(verifier.model)  # a no-op for models without linear-attention layers
        self.refuse(solo_mismatch(self))

    def sequence(self) -> HFSequence:
        return HFSequence(self)

    @torch.inference_mode()
    def _forward(self, group: list[tuple[HFSequence, list[Any]]]) -> list[torch.Tensor]:
        """One forward of the group's calls (module docstring); each call's logits. A call alone runs as
        the verifier runs it (its own cache, transformers' attention path), calls together packed."""
        model, dev = self.base.model, self.base.device
        spans, ids, pos, keep, s = [], [], [], [], 0
        for seq, (tokens, last_only, _) in group:
            T = len(tokens)
            spans.append((s, s + T))
            ids += tokens
            pos.append(torch.arange(seq._pos, seq._pos + T))
            keep += [s + T - 1] if last_only else range(s, s + T)
            s += T
        for seq, (tokens, *_) in group:
            seq._record(len(tokens))
        pack = Packed([seq._cache for seq, _ in group], spans, [seq._pos + len(t) for seq, (t, *_) in group])
        if len(group) == 1:  # as `HFVerifier.forward`
            seq, (tokens, last_only, _) = group[0]
            cache, position_ids, keep_ = seq._cache, None, seq._keep(len(tokens), last_only)
        else:
            cache, position_ids = _packed_cache(model, pack), torch.cat(pos)[None].to(dev)
            keep_ = torch.tensor(keep, device=dev)
        got: dict[int, torch.Tensor] = {}
        wanted = sorted({i for seq, _ in group for i in seq._layer_ids})
        hooks = [self.base._layers[i].register_forward_hook(_tap(got, i)) for i in wanted]
        token = PACK.set(pack if len(group) > 1 else None)
        try:
            out = model(
                input_ids=torch.tensor([ids], device=dev),
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=keep_,
            ).logits[0]  # [len(keep), V]
        finally:
            PACK.reset(token)
            for h in hooks:
                h.remove()
        logits, row = [], 0
        for (seq, (_, last_only, _)), (a, b) in zip(group, spans, strict=True):
            n = 1 if last_only else b - a
            logits.append(out[row : row + n])
            row += n
            seq._advance(b - a)
            seq._captured = {i: got[i][a:b] for i in seq._layer_ids}
        return logits


def _packed_cache(model: torch.nn.Module, pack: Packed) -> Any:
    """A transformers cache whose layers append each sequence's rows to its own cache (`packed_layer`)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    cache.layers = [packed_layer(pack, i) for i in range(len(cache.layers))]
    return cache


def _tap(store: dict[int, torch.Tensor], i: int) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        store[i] = (output[0] if isinstance(output, tuple) else output)[0]  # [sum T, H]

    return hook


def _unsupported(v: HFVerifier) -> str | None:
    """Why `attend_packed` cannot run `v`'s model (None: it can)."""
    cfg = v.config
    if not v.batch_invariant:
        return f"its {v.dtype} verify is not batch-invariant here (measured at load)"
    types = getattr(cfg, "layer_types", None) or ()
    known = {"full_attention", "sliding_attention", "linear_attention"}
    if any(t not in known for t in types):
        return f"its {sorted(set(types) - known)} layers are not packed yet"
    return None
