"""What the MLX verifier stands in for inside an mlx_lm model, as mlx-lm keeps its caches in their own
module: a recurrent mixer's input projections recorded and replayed (`Replay`, `Recurrent`: exact rollback
of Gated DeltaNet state), a decoder layer that records its output (`Tap`: the features), and a tree
verify's RoPE and cache (`TreeRoPE`, `TreeCache`: each node at its own position, the tree's mask).
`specdec.verifiers.mlx` swaps them in for the duration of a call. Also which caches it builds and why
(`EXACT_CACHES`, `WINDOW_MASK_FROM_ARGS`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ConcatenateKVCache, KVCache

from specdec.kernels import TreeAttention

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "EXACT_CACHES",
    "WINDOW_MASK_FROM_ARGS",
    "Recurrent",
    "Replay",
    "Tap",
    "TreeCache",
    "TreeRoPE",
    "swapped",
]

#: caches whose `trim(n)` only moves a write offset: rejected slots are overwritten by the next update
EXACT_CACHES = (KVCache, ConcatenateKVCache)

#: Sliding-window rollback. A RotatingKVCache cannot be trimmed once its window has wrapped
#: (`is_trimmable()` turns False and mlx_lm's `trim_prompt_cache` silently returns 0, mlx-lm #1423), and
#: snapshotting it would mean copying every sliding layer's window on every verify (MLX slice-assignment
#: rebinds the same array object, so a reference is not a snapshot). We give these architectures a plain
#: KVCache on every layer instead: exact rollback by offset, at the cost of keeping the whole context in
#: the sliding layers (memory O(context), as the global layers already do). This is only sound where the
#: model builds the sliding-window mask from the window size rather than from the cache type; read in
#: mlx_lm 0.32 for these types: both call `create_attention_mask(h, cache[i], window_size=W)`, which for
#: a KVCache becomes `cache.make_mask(N, window_size=W)` -> `create_causal_mask(N, offset, window_size=W)`
#: for every N, including single-token steps. Other architectures keep their RotatingKVCache and are
#: refused by `check_rollback`.
#: gemma4_text builds one mask per layer type the same way (`_make_masks`); its KV-shared layers have no
#: cache entry (make_cache returns fewer caches than layers) and attend over their producer layer's
#: updated KV with that type's mask, so they follow the producer's plain KVCache exactly. gpt_oss (sliding
#: and full layers alternating, attention sinks) builds its sliding mask the same way, and its sinks are
#: a per-head logit that does not depend on the cache.
WINDOW_MASK_FROM_ARGS = frozenset({"llama", "gemma3_text", "gemma4_text", "gpt_oss"})

#: `layer_types` entries of attention layers (anything else is recurrent / linear-attention state)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


class Replay:
    """Stands in for one input projection of a recurrent mixer: records its output during a verify; gives
    back the first `rows` positions of the given output during a replay (no product computed again)."""

    def __init__(self, proj: Any, out: mx.array | None = None, rows: int | None = None) -> None:
        self.proj, self.out, self.rows = proj, out, rows

    def __call__(self, x: mx.array) -> mx.array:
        if self.rows is not None:
            return self.out[:, : self.rows]
        self.out = self.proj(x)  # [1, T, D]
        return self.out


class Recurrent:
    """Stands in for one recurrent mixer (Gated DeltaNet: `layer.linear_attn`) during the calls since the last
    rollback, so that they can be undone exactly. It keeps the mixer's cache arrays as they were before the
    first of them (MLX arrays are immutable and the mixer assigns new ones, so the references are the
    snapshot), and each call's input and input-projection outputs. `replay(a)` restores the snapshot and
    runs mlx_lm's own mixer over the first `a` of those positions again with the recorded outputs: only the
    conv window and the recurrence are recomputed (the same per-token steps); the output projection is
    never evaluated. Several calls before one rollback: a draft model drafting token by token."""

    def __init__(self, mixer: nn.Module, proj_names: Sequence[str]) -> None:
        self.mixer, self.names = mixer, tuple(proj_names)
        self.cache: Any = None
        self.calls: list[tuple[mx.array, dict[str, Replay]]] = []  # since the last rollback

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if not self.calls:
            self.cache, self.before = cache, list(cache.cache)
        taps = {n: Replay(self.mixer[n]) for n in self.names}
        self.calls.append((x, taps))  # x: [1, T, H]
        with swapped(self.mixer, taps):
            return self.mixer(x, mask, cache)

    def held_bytes(self) -> int:
        """What the recorded calls keep: their inputs and input-projection outputs."""
        return sum(x.nbytes + sum(t.out.nbytes for t in taps.values()) for x, taps in self.calls)

    def forget(self) -> None:
        """Keep the state as it is: the recorded calls are committed."""
        self.calls = []

    def replay(self, a: int) -> None:
        calls, self.calls = self.calls, []
        self.cache.cache = list(self.before)
        if a == 0:
            return

        def joined(parts: list[mx.array]) -> mx.array:
            return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)

        x = joined([c[0] for c in calls])[:, :a]
        taps = {n: Replay(None, joined([c[1][n].out for c in calls]), a) for n in self.names}
        with swapped(self.mixer, taps):
            self.mixer(x, None, self.cache)


@contextmanager
def swapped(module: nn.Module, parts: dict[str, Any]) -> Iterator[None]:
    """`module`'s children `parts` replaced for the duration (mlx Modules are dicts: item assignment)."""
    originals = {n: module[n] for n in parts}
    for n, p in parts.items():
        module[n] = p
    try:
        yield
    finally:
        for n, p in originals.items():
            module[n] = p


class Tap:
    """Stands in for one decoder layer during a forward: records its output, optionally keeps only the
    last position (for the LM head), and forwards attribute reads (`layer.use_sliding` etc.)."""

    def __init__(self, layer: Any, store: dict[int, mx.array], slot: int | None, last_only: bool) -> None:
        self.layer, self.store, self.slot, self.last_only = layer, store, slot, last_only

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.layer(*args, **kwargs)
        h = out[0] if isinstance(out, tuple) else out  # [1, T, H]
        if self.slot is not None:
            self.store[self.slot] = h
        if not self.last_only:
            return out
        h = h[:, -1:, :]  # [1, 1, H]: what the final norm and LM head see
        return (h, *out[1:]) if isinstance(out, tuple) else h


class TreeRoPE(nn.Module):
    """Stands in for an attention layer's RoPE during a tree verify: each node at its own position (the
    call's rows become batch rows, so one rope call takes a vector of offsets), whatever offset the layer
    asks for (its cache's, the next slot)."""

    def __init__(self, rope: Any, positions: mx.array) -> None:
        super().__init__()
        self.inner, self.positions = rope, positions  # [T]

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        y = self.inner(x.transpose(2, 1, 0, 3), offset=self.positions)  # [1, H, T, D] -> [T, H, 1, D]
        return y.transpose(2, 1, 0, 3)


class TreeCache:
    """A layer's KV cache during a tree verify: appends the nodes as the cache does, and where the model
    asks its cache for the attention mask, gives the tree's (each node sees the context, within a sliding
    window by position, and its ancestors)."""

    def __init__(self, cache: Any, tree: TreeAttention) -> None:
        self.cache, self.tree = cache, tree

    @property
    def offset(self) -> int:
        return self.cache.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.cache.update_and_fetch(keys, values)

    def make_mask(self, n: int, *, window_size: int | None = None, **kw: Any) -> mx.array:
        mask = self.tree.flat_mask(self.tree.root, window_size)  # [T, root + T] bool, torch
        return mx.array(mask.numpy())
