"""Several sequences on one loaded mlx_lm model, their calls verified together in one forward.

`MLXBatch(verifier)` hands out `MLXSequence`s: each the Verifier protocol with caches of its own, sharing
the model and what was measured when it loaded. Members' calls meet in the batch (`specdec.rendezvous`)
and run as one forward of the model over a batch [B, T_max] of their tokens (right-padded), its layers'
caches replaced by `PackedKV`s for the forward:
- each sequence's RoPE at its own positions (the model's own rope, given a vector of offsets [B], as
  mlx_lm's batched generation gives it);
- each layer's new keys and values appended to each sequence's own KVCache (its real rows only), and its
  attention computed per sequence: the model's attention function, stood in for in its module for calls
  that carry a `PackedKV`, runs mlx_lm's own attention on the sequence's queries, its own cache and its
  own mask (as that cache makes it alone), so the attention is its call alone, shape for shape;
- every linear computes all B * T_max rows in one product: the rows' results do not depend on the rows
  beside them where the verifier's `batch_invariant` holds (measured on the loaded model), so groups hold
  at most `MAX_VERIFY_TOKENS` rows, padding included.

Exact, or refused: `MLXBatch` measures calls run together against the same calls through the verifier's
own path (`rendezvous.solo_mismatch`) and refuses where they differ, and refuses in one line models whose
caches are not one plain KVCache per layer beside Gated DeltaNet states (rotating windows); a KV-shared
layer (Gemma 4) attends over the keys its source layer's `PackedKV` fetched (`FETCHED`). A Gated
DeltaNet layer (Qwen3.5 / 3.6, Qwen3-Next) runs each sequence's rows through its mixer on their own
(`PackedMixer`), recorded by that sequence's own stand-in for its rollback, as alone.
A call alone, or longer than a group may hold (a long prefill), runs the verifier's own way.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from typing import Any

import mlx.core as mx

from specdec.kernels import MAX_VERIFY_TOKENS, TreeAttention
from specdec.protocols import check_call
from specdec.rendezvous import Call, Member, Rendezvous, solo_mismatch
from specdec.verifiers.mlx import MLXVerifier
from specdec.verifiers.mlx_cache import Recurrent, Tap, swapped

__all__ = ["MLXBatch", "MLXSequence"]

#: during a packed forward: id of the keys a `PackedKV` handed back -> that PackedKV (a KV-shared layer
#: attends over the keys its source layer handed back, with no cache of its own)
FETCHED: ContextVar[dict[int, Any] | None] = ContextVar("specdec_mlx_fetched", default=None)


class MLXSequence(Member, MLXVerifier):
    """One sequence of an `MLXBatch`: an `MLXVerifier` with its own caches whose calls go through it."""

    def __init__(self, batch: MLXBatch) -> None:
        self.join(batch)
        self._layer_ids = ()
        # its own recordings of the shared Gated DeltaNet mixers, found when the model loaded (not now: a
        # packed forward of other sequences may have stood in for them)
        self._recurrent = {i: Recurrent(r.mixer, r.names) for i, r in batch.base._recurrent.items()}
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.run_ahead = False  # a queued step would run outside the batch

    def rollback(self, n: int) -> None:
        # a Gated DeltaNet replay runs the shared mixers with its recorded projections swapped in: never
        # beside a forward of the batch (which holds this lock while it runs)
        with self.batch.lock:
            super().rollback(n)

    def _forward(
        self, tokens: Sequence[int] | mx.array, *, last_only: bool, tree: TreeAttention | None = None
    ) -> mx.array:
        if tree is not None:
            self.check_tree()
        tokens = tokens.tolist() if isinstance(tokens, mx.array) else list(tokens)
        check_call(len(tokens), self._pos, self.max_context)
        return self.batch.call(self, tokens, last_only)  # [T, V] or [1, V], evaluated


class MLXBatch(Rendezvous):
    """Sequences on one loaded `MLXVerifier` whose calls are verified together (module docstring)."""

    def __init__(self, verifier: MLXVerifier) -> None:
        super().__init__(verifier)
        self.refuse(_unsupported(verifier))
        _stand_in_attention(verifier.model)
        self.refuse(solo_mismatch(self))

    def sequence(self) -> MLXSequence:
        return MLXSequence(self)

    def fits(self, lengths: list[int]) -> bool:
        return len(lengths) * max(lengths) <= MAX_VERIFY_TOKENS  # padded rows count too

    def _forward(self, group: list[Call]) -> list[mx.array]:
        """One forward of the group's calls (module docstring); each call's logits, evaluated here: the
        thread that runs a forward may not be the one of the sequence that reads its results."""
        if len(group) == 1:  # as `MLXVerifier._forward`
            seq, (tokens, last_only, _) = group[0]
            logits = MLXVerifier._forward(seq, tokens, last_only=last_only)
            mx.eval(logits, seq._feats, [c.state for c in seq._cache])
            return [logits]
        seqs = [seq for seq, _ in group]
        lengths = [len(call[0]) for _, call in group]
        T = max(lengths)
        ids = mx.array([call[0] + [0] * (T - len(call[0])) for _, call in group], dtype=mx.int32)  # [B, T]
        offsets = mx.array([seq._pos for seq in seqs], dtype=mx.int32)  # [B]
        caches = [
            PackedStates([s._cache[i] for s in seqs], lengths, [s._recurrent[i] for s in seqs])
            if i in self.base._recurrent
            else PackedKV([s._cache[i] for s in seqs], lengths, offsets)
            for i in range(len(seqs[0]._cache))
        ]
        store: dict[int, mx.array] = {}
        taps = sorted({i for seq in seqs for i in seq._layer_ids})
        token = FETCHED.set({})
        try:
            with _mixers(self.base), _tapped(self.base, taps, store):  # the mixers first: taps wrap layers
                logits = self.base.model(ids, cache=caches)  # [B, T, V]
        finally:
            FETCHED.reset(token)
        out = []
        for b, (seq, (tokens, last_only, _)) in enumerate(group):
            n = len(tokens)
            out.append(logits[b, n - 1 : n] if last_only else logits[b, :n])  # [1|n, V]
            feats = [store[i][b, :n] for i in seq._layer_ids]  # [n, H] each
            seq._feats = mx.concatenate(feats, axis=-1) if feats else None  # [n, K*H]
            seq._advance(n, recorded=bool(seq._recurrent))  # a group holds at most MAX_VERIFY_TOKENS rows
        mx.eval(
            out, [s._feats for s in seqs if s._feats is not None], [c.state for s in seqs for c in s._cache]
        )
        return out


class PackedKV:
    """One layer's cache during a forward of several sequences: the rope's offsets [B], each sequence's
    real rows appended to its own KVCache, and what the attention of each sequence needs (its cache's
    keys, values and mask), which the stood-in attention function reads."""

    def __init__(self, caches: list[Any], lengths: list[int], offsets: mx.array) -> None:
        self.caches, self.lengths, self.offset = caches, lengths, offsets  # offset: [B], read by the rope
        self.fetched: list[tuple[mx.array, mx.array]] = []

    def make_mask(self, N: int, **kw: Any) -> PerSequence:
        return PerSequence([c.make_mask(n, **kw) for c, n in zip(self.caches, self.lengths, strict=True)])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys, values [B, H, T, D]: each sequence's first rows into its cache; they come back as given
        (the attention reads each sequence's cache instead)."""
        self.fetched = [
            c.update_and_fetch(keys[b : b + 1, :, :n], values[b : b + 1, :, :n])  # [1, H, L_b, D] each
            for b, (c, n) in enumerate(zip(self.caches, self.lengths, strict=True))
        ]
        if (fetched := FETCHED.get()) is not None:  # for the KV-shared layers that reuse these keys
            fetched[id(keys)] = self
        return keys, values

    def attend(self, attention: Any, queries: mx.array, mask: Any, kw: dict[str, Any]) -> mx.array:
        """queries [B, H, T, D] -> [B, H, T, D]: each sequence's rows by `attention` (mlx_lm's own) over
        its own keys with its own mask; padded rows zero."""
        T, outs = queries.shape[2], []
        for b, (c, n, (k, v)) in enumerate(zip(self.caches, self.lengths, self.fetched, strict=True)):
            m = mask.parts[b] if isinstance(mask, PerSequence) else mask
            o = attention(queries[b : b + 1, :, :n], k, v, cache=c, mask=m, **kw)  # [1, H, n, D]
            outs.append(mx.pad(o, [(0, 0), (0, 0), (0, T - n), (0, 0)]) if n < T else o)
        return mx.concatenate(outs, axis=0)


class PackedStates:
    """One Gated DeltaNet layer's caches during a forward of several sequences: each sequence's rows run
    through the layer's mixer on their own, recorded by that sequence's `Recurrent` for its rollback, on
    its own ArraysCache (`PackedMixer`)."""

    def __init__(self, caches: list[Any], lengths: list[int], recorders: list[Any]) -> None:
        self.caches, self.lengths, self.recorders = caches, lengths, recorders

    def make_mask(self, N: int) -> PerSequence:
        return PerSequence([c.make_mask(n) for c, n in zip(self.caches, self.lengths, strict=True)])


class PackedMixer:
    """Stands in for a Gated DeltaNet mixer (`linear_attn`) during a packed forward: x [B, T, H] -> each
    sequence's real rows through its recorder (the mixer, recorded) on its own cache, as its call alone;
    padded rows zero."""

    def __call__(self, x: mx.array, mask: Any, cache: PackedStates) -> mx.array:
        T, outs = x.shape[1], []
        for b, (c, n, r) in enumerate(zip(cache.caches, cache.lengths, cache.recorders, strict=True)):
            m = mask.parts[b] if isinstance(mask, PerSequence) else mask
            o = r(x[b : b + 1, :n], m, c)  # [1, n, H]
            outs.append(mx.pad(o, [(0, 0), (0, T - n), (0, 0)]) if n < T else o)
        return mx.concatenate(outs, axis=0)


@contextmanager
def _mixers(v: MLXVerifier) -> Iterator[None]:
    """The Gated DeltaNet mixers of `v`'s model stood in for by `PackedMixer`s for a packed forward."""
    layers, start = v._layer_list()
    with ExitStack() as stack:
        for i in v._recurrent:
            stack.enter_context(swapped(layers[start + i], {"linear_attn": PackedMixer()}))
        yield


class PerSequence:
    """The masks of a `PackedKV`'s sequences, each as its cache makes it alone (None, "causal", array)."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts


def _stand_in_attention(model: Any) -> None:
    """In every module of `model`'s classes that calls mlx_lm's `scaled_dot_product_attention`, stand in
    for it (once): calls with a `PackedKV` attend per sequence, every other call is the original's."""
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        real = getattr(module, "scaled_dot_product_attention", None)
        if real is None or getattr(real, "packed", False):
            continue

        def attention(queries, keys, values, cache=None, scale=1.0, mask=None, real=real, **kw):  # type: ignore[no-untyped-def]
            if cache is None and (fetched := FETCHED.get()) is not None:  # a KV-shared layer: its source's
                cache = fetched.get(id(keys))
            if isinstance(cache, PackedKV):
                return cache.attend(real, queries, mask, {"scale": scale, **kw})
            return real(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

        attention.packed = True  # type: ignore[attr-defined]
        module.scaled_dot_product_attention = attention


class _tapped:
    """The decoder layers `ids` of `v`'s model record their output [B, T, H] into `store` for a forward."""

    def __init__(self, v: MLXVerifier, ids: list[int], store: dict[int, mx.array]) -> None:
        self.layers, self.start = v._layer_list()
        self.ids, self.store = ids, store

    def __enter__(self) -> None:
        self.originals = {i: self.layers[self.start + i] for i in self.ids}
        for i, layer in self.originals.items():
            self.layers[self.start + i] = Tap(layer, self.store, i, False)

    def __exit__(self, *exc: Any) -> None:
        for i, layer in self.originals.items():
            self.layers[self.start + i] = layer


def _unsupported(v: MLXVerifier) -> str | None:
    """Why a forward of several sequences cannot run `v`'s model (None: it can; exactness is measured)."""
    kinds = sorted({type(c).__name__ for i, c in enumerate(v._cache) if i not in v._recurrent})
    if len(v._cache) > v.num_layers or kinds != ["KVCache"]:  # fewer: KV-shared layers keep none
        return (
            f"its caches {kinds} are not one plain KV cache per layer beside its Gated DeltaNet states "
            "(rotating windows, say)"
        )
    if not v.batch_invariant:  # measured (after the look at its caches: nothing to measure where refused)
        return f"its {v.dtype} verify is not batch-invariant here (measured)"
    return None
