"""What the HF verifier puts into transformers: attention functions registered under its attention
interface (copy-free grouped-query SDPA, the batch-invariant attention of bf16 / fp16 verifies, the tree
verify's attention, a packed forward's attention of several sequences) and cache layers (the one that
grows in place, a wider sliding one, a packed forward's); and how a vision-language checkpoint's language
model loads alone (`text_part`, `language_model`). `specdec.verifiers.hf` uses them."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from specdec.kernels import KEY_ALIGN, TreeAttention, invariant_attention

__all__ = [
    "PACK", "TREE", "Packed", "attend_invariant", "attend_packed", "growing_layer", "has_sinks",
    "language_model", "packed_layer", "sdpa_gqa", "set_attention", "text_part", "wide_sliding_layer",
]  # fmt: skip


#: the tree a `verify_tree` on this thread is running: our attention functions then attend by its mask
TREE: ContextVar[TreeAttention | None] = ContextVar("specdec_tree", default=None)
#: the packed forward of several sequences this thread is running (`Packed`, `hf_batch`): the invariant
#: attention then attends each sequence's rows over its own cache (`attend_packed`)
PACK: ContextVar[Any] = ContextVar("specdec_pack", default=None)


def sdpa_gqa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kw: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that a masked multi-token call lets torch broadcast the
    shared K/V heads (`enable_gqa`) where transformers would `repeat_kv`, i.e. copy the whole cache
    n_rep times in every layer of every verify. CPU only: there torch's SDPA kernel takes both."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (tree := TREE.get()) is not None:
        return _attend_tree(module, query, key, value, tree, **kw)
    plain = (
        query.device.type != "cpu"
        or getattr(module, "num_key_value_groups", 1) == 1
        or attention_mask is None
        or query.shape[2] == 1
        or kw.get("dropout", 0.0)
        or kw.get("softcap") is not None
        or kw.get("position_bias") is not None
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=kw.get("scaling"), enable_gqa=True
    )  # [1, heads, T, D]
    return out.transpose(1, 2).contiguous(), None  # [1, T, heads, D] as transformers returns it


def attend_invariant(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kw: Any,
) -> tuple[torch.Tensor, None]:
    """`specdec.kernels.invariant_attention` under transformers' attention interface: the keys of the call
    sit at absolute positions ending at the last query's (full layers from 0, sliding layers from where
    their window starts), which is what the alignment needs.

    No mask means what it means to transformers' SDPA attention: causal (aligned at the first key, as
    torch's `is_causal`) for a call of several queries in a causal module, every key visible for one
    query. transformers passes none for a causal call whose queries are all its keys (a prefill on an
    empty cache, a training forward) and relies on `is_causal`; read as "every key visible", that prefill
    let each position see the ones after it (SmolLM2-135M bf16: 2.6% of argmaxes right)."""
    if (tree := TREE.get()) is not None:
        return _attend_tree(module, query, key, value, tree, **kw)
    if (pack := PACK.get()) is not None:
        return attend_packed(module, query, pack, **kw), None
    pos = kw.get("position_ids")
    T, S = query.shape[2], key.shape[2]
    start = int(pos[0, -1]) - S + 1 if pos is not None else 0
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:  # an additive float mask: 0 where visible
        mask = mask == 0
    causal = kw.get("is_causal")
    if mask is None and T > 1 and (getattr(module, "is_causal", True) if causal is None else causal):
        mask = torch.ones(T, S, dtype=torch.bool, device=query.device).tril()[None, None]  # [1, 1, T, S]
    scale = kw.get("scaling") or query.shape[-1] ** -0.5
    out = invariant_attention(
        query,
        key,
        value,
        mask,
        scale=scale,
        key_start=start,
        softcap=kw.get("softcap"),
        sinks=kw.get("s_aux"),
    )
    return out.transpose(1, 2).contiguous(), None  # [1, T, heads, D] as transformers returns it


def _attend_tree(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree: TreeAttention,
    **kw: Any,
) -> tuple[torch.Tensor, None]:
    """A tree verify's attention: the last T keys are the tree's nodes, the ones before them the newest
    cached positions; each node sees those (within the layer's sliding window) and its ancestors, in
    place of transformers' causal mask, each row computed as its path verified as a chain computes it
    (`TreeAttention.attend`: bit for bit where the verifier is batch-invariant)."""
    window = kw.get("sliding_window") or getattr(module, "sliding_window", None)
    out = tree.attend(
        query,
        key,
        value,
        scale=kw.get("scaling") or query.shape[-1] ** -0.5,
        softcap=kw.get("softcap"),
        window=window,
        sinks=kw.get("s_aux"),
    )
    return out.transpose(1, 2).contiguous(), None  # [1, T, heads, D] as transformers returns it


def has_sinks(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention has sinks (gpt-oss: transformers passes them as `s_aux`)."""
    return any(hasattr(m, "sinks") for m in model.modules())


def set_attention(model: torch.nn.Module, name: str, fn: Any, *, sinks: bool = False) -> bool:
    """Switch a model that runs transformers' SDPA attention (or one of ours) to `fn`, registered as `name`
    with the same masks; whether it was switched. `sinks`: `fn` reads attention sinks (`s_aux`), so a
    model that runs transformers' eager attention for its sinks (gpt-oss) is switched too."""
    ours = ("sdpa", "specdec_sdpa", "specdec_invariant")
    impl = getattr(model.config, "_attn_implementation", None)
    eager_sinks = sinks and impl == "eager" and has_sinks(model)
    if impl not in ours and not eager_sinks:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    return True


@cache
def growing_layer() -> type:
    """The `DynamicLayer` of our verifier's cache: its keys and values live in a buffer that grows by
    doubling, so an append writes only the new positions and a crop only shortens the view. transformers'
    own layer concatenates the whole cache on every append: at 400 cached positions that copy was ~2 ms of
    a ~50 ms SmolLM2-135M step on a 2-core CPU (~0.7 ms in place). Attention reads the same values (a
    strided view); the buffer holds up to twice the cached positions."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        exact_rollback = True  # for `check_rollback` (by attribute: a class made twice by racing threads)

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            self._k = self._v = None  # [B, H, capacity, D] each, allocated by the first update
            self._n = 0  # positions held

        def _view(self) -> tuple[torch.Tensor, torch.Tensor]:
            self.keys, self.values = self._k.narrow(-2, 0, self._n), self._v.narrow(-2, 0, self._n)
            return self.keys, self.values

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, T = self._n, key_states.shape[-2]
            if self._k is None or n + T > self._k.shape[-2]:
                cap = max(-(-(n + T) // 256) * 256, 2 * (0 if self._k is None else self._k.shape[-2]))
                k = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))
                v = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
                if n:
                    k[..., :n, :], v[..., :n, :] = self._k[..., :n, :], self._v[..., :n, :]
                self._k, self._v = k, v
            self._k.narrow(-2, n, T).copy_(key_states)
            self._v.narrow(-2, n, T).copy_(value_states)
            self._n = n + T
            return self._view()

        def keep_last(self, T: int, rows: torch.Tensor) -> None:
            """Of the last T positions keep `rows` [n], in that order (a tree verify's accepted path)."""
            n0 = self._n - T
            self._k[..., n0 : n0 + len(rows), :] = self._k[..., n0 + rows, :]  # indexing copies: no overlap
            self._v[..., n0 : n0 + len(rows), :] = self._v[..., n0 + rows, :]
            self._n = n0 + len(rows)
            self._view()

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError(f"crop takes minus the positions to remove, got {tokens_to_remove}")
            if tokens_to_remove and self.is_initialized and self._k is not None:
                self._n = max(0, self._n + tokens_to_remove)
                self._view()

        def reset(self) -> None:
            self._k = self._v = None
            self._n = 0
            super().reset()

    return GrowingLayer


def wide_sliding_layer(layer: Any, keep: int) -> Any:
    """transformers' `DynamicSlidingWindowLayer` `layer`, switched in place to keep the `keep` most recent
    positions after a crop instead of `sliding_window - 1` (a Gemma-4 assistant reads the last window + 1
    keys of the target's sliding layer). What attention sees is unchanged: its `update` hands attention
    the last `sliding_window - 1 + T` positions whatever the layer holds, and its mask comes from the
    position count (`get_mask_sizes`), not from the stored length."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    if type(layer) is DynamicSlidingWindowLayer:
        layer.__class__ = _wide_sliding_class()
    layer.keep = keep
    return layer


@cache
def _wide_sliding_class() -> type:
    from transformers.cache_utils import DynamicSlidingWindowLayer

    class WideSlidingLayer(DynamicSlidingWindowLayer):
        exact_rollback = True  # for `check_rollback`: its crop is transformers' own, keeping more

        def crop(self, tokens_to_remove: int) -> None:
            if self.get_seq_length() < self.sliding_window or tokens_to_remove > 0:
                return super().crop(tokens_to_remove)  # all positions held (or its own error)
            end = self.keys.shape[-2] + tokens_to_remove  # minus the positions to remove
            start = max(end - max(self.keep, self.sliding_window - 1), 0)
            self.keys, self.values = self.keys[:, :, start:end], self.values[:, :, start:end]
            self.cumulative_length += tokens_to_remove

    return WideSlidingLayer


@dataclass
class Packed:
    """One packed forward: each sequence's cache, its rows' span [start, end) in the packed rows and the
    position after its last row; the keys / values each layer's update left in each sequence's cache
    (read by `attend_packed`)."""

    caches: list[Any]
    spans: list[tuple[int, int]]
    ends: list[int]
    kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    masks: dict[Any, torch.Tensor] = field(default_factory=dict)  # by the calls' shapes and the window
    buffers: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # the same keys
    shared: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)  # by layer kind


def attend_packed(module: torch.nn.Module, query: torch.Tensor, pack: Packed, **kw: Any) -> torch.Tensor:
    """The attention of a packed forward: each sequence's rows over the keys its cache layer handed back
    (all of them, or a sliding layer's window), as `attend_invariant` computes a call of that sequence
    alone, in one batched call: the sequences' rows padded to the longest (rows of zeros), their keys
    placed as alone on the KEY_ALIGN blocks counted from position 0 (masked keys before them) and padded
    to the longest, each row seeing its own keys causally and within the layer's window; which
    `invariant_attention` computes each real row of bit for bit as alone (measured: `hf_batch`).
    query [1, heads, sum T] -> [1, sum T, heads, D]."""
    kv = _sequence_kv(module, pack)
    window = kw.get("sliding_window") or getattr(module, "sliding_window", None)
    # per sequence: rows T, keys S, the keys' first position, the masked keys that align it
    shapes = [
        (e - s, k.shape[2], end - k.shape[2], (end - k.shape[2]) % KEY_ALIGN)
        for (s, e), (k, _), end in zip(pack.spans, kv, pack.ends, strict=True)
    ]
    Tm = max(t for t, *_ in shapes)
    Sm = -(-max(o + n for _, n, _, o in shapes) // KEY_ALIGN) * KEY_ALIGN  # whole blocks: no more padding
    key = (tuple(shapes), window)
    k, v = _packed_kv(pack, key, kv, shapes, Sm)
    mask = pack.masks.get(key)
    if mask is None:  # the same for every layer of this kind whose caches are as long: once per forward
        mask = pack.masks[key] = _packed_mask(shapes, Tm, Sm, window, k.device)
    B, (_, H, _, D) = len(shapes), query.shape
    if all(t == Tm for t, *_ in shapes):  # calls of one length (the usual): the rows as they lie
        q = query[0].view(H, B, Tm, D).transpose(0, 1)  # [B, H, Tm, D]
    else:  # rows of zeros after a shorter call's
        q = query.new_zeros(B, H, Tm, D)
        for b, (s, e) in enumerate(pack.spans):
            q[b, :, : e - s] = query[0, :, s:e]
    scale = kw.get("scaling") or query.shape[-1] ** -0.5
    out = invariant_attention(q, k, v, mask, scale=scale, softcap=kw.get("softcap"), sinks=kw.get("s_aux"))
    if all(t == Tm for t, *_ in shapes):
        return out.transpose(0, 1).reshape(H, B * Tm, D).transpose(0, 1)[None].contiguous()
    return (
        torch.cat([out[b, :, :T] for b, (T, *_) in enumerate(shapes)], 1).transpose(0, 1)[None].contiguous()
    )


def _sequence_kv(module: torch.nn.Module, pack: Packed) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence's keys and values for `module`'s attention: what its cache layer handed back, or for
    a KV-shared layer (Gemma 4) what the last layer of its kind that stores them for sharing handed back
    (transformers' `shared_kv_states`, per sequence)."""
    kind = getattr(module, "layer_type", None)
    if getattr(module, "is_kv_shared_layer", False):
        return pack.shared[kind]
    kv = pack.kv[module.layer_idx]
    if getattr(module, "store_full_length_kv", False):
        pack.shared[kind] = kv
    return kv


def _packed_kv(
    pack: Packed, key: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], shapes: list[Any], Sm: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences' keys and values [B, Hkv, Sm, D], each placed after its `o` masked keys: buffers of
    zeros made once per forward for layers of this kind and written over by each (only the real keys
    move; the padding stays zeros)."""
    k0 = kv[0][0]
    bufs = pack.buffers.get(key)
    if bufs is None or bufs[0].dtype != k0.dtype:
        shape = (len(shapes), k0.shape[1], Sm, k0.shape[3])
        bufs = pack.buffers[key] = (k0.new_zeros(shape), k0.new_zeros(shape))
    k, v = bufs
    for b, ((k_, v_), (_, n, _, o)) in enumerate(zip(kv, shapes, strict=True)):
        k[b, :, o : o + n] = k_[0]
        v[b, :, o : o + n] = v_[0]
    return k, v


def _packed_mask(
    shapes: list[tuple[int, int, int, int]], Tm: int, Sm: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[B, 1, Tm, Sm]: row j of a call of T rows over S keys from position `start` (placed after `o`
    masked keys) sees its keys up to its own position, and within `window` of it; a padding row its first
    key (no empty softmax)."""
    rows = torch.arange(Tm, device=device)[:, None]  # [Tm, 1]
    idx = torch.arange(Sm, device=device)[None]  # [1, Sm]
    masks = []
    for T, S, start, o in shapes:
        at, q = start - o + idx, start + S - T + rows  # the keys' and the rows' positions
        seen = (idx >= o) & (idx < o + S) & (at <= q)
        if window is not None:
            seen &= at > q - window
        masks.append(torch.where(rows < T, seen, idx == o))
    return torch.stack(masks)[:, None]


def pack_linear_attention(model: torch.nn.Module) -> int:
    """Let the Gated DeltaNet modules of `model` (`linear_attn`: Qwen3.5 / 3.6, Qwen3-Next) take part in a
    packed forward: while `PACK` is set, each sequence's rows run through the module on their own, with
    that sequence's cache (its conv and recurrent states, recorded for rollback as alone), so each gets
    bit for bit what its call alone gets; otherwise the module runs as it is. How many were switched."""
    n = 0
    for m in model.modules():
        inner = getattr(m, "linear_attn", None)
        if inner is None or getattr(inner, "specdec_packed", False):
            continue
        own = inner.forward

        def forward(
            hidden_states: torch.Tensor,
            cache: Any = None,
            attention_mask: Any = None,
            _own: Any = own,
            **kw: Any,
        ) -> torch.Tensor:
            pack = PACK.get()
            if pack is None:
                return _own(hidden_states, cache=cache, attention_mask=attention_mask, **kw)
            return torch.cat(  # [1, sum T, H]
                [_own(hidden_states[:, s:e], cache=c, **kw) for c, (s, e) in zip(pack.caches, pack.spans)], 1
            )

        inner.forward, inner.specdec_packed = forward, True
        n += 1
    return n


def packed_layer(pack: Packed, layer: int) -> Any:
    """A cache layer of a packed forward: appends each sequence's rows to that sequence's own cache."""
    return _packed_layer_class()(pack, layer)


@cache
def _packed_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class PackedLayer(DynamicLayer):
        def __init__(self, pack: Packed, layer: int) -> None:
            super().__init__()
            self.pack, self.layer = pack, layer

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *a: Any, **kw: Any) -> Any:
            pack, i = self.pack, self.layer
            pack.kv[i] = [
                c.layers[i].update(key_states[:, :, s:e], value_states[:, :, s:e])
                for c, (s, e) in zip(pack.caches, pack.spans, strict=True)
            ]
            return key_states, value_states  # unread: `attend_packed` reads `pack.kv`

        def get_seq_length(self) -> int:
            return 0

        def get_mask_sizes(self, query_length: int, *a: Any) -> tuple[int, int]:
            return query_length, 0  # a mask nobody reads (`attend_packed`)

    return PackedLayer


#: where multimodal checkpoints keep their language model's weights (transformers 5, then 4), and where
#: its causal LM class reads them
_TEXT_WEIGHTS = {r"^model\.language_model\.": "model.", r"^language_model\.model\.": "model.",
                 r"^language_model\.lm_head\.": "lm_head."}  # fmt: skip


def text_part(config: Any) -> tuple[Any, dict[str, Any]]:
    """(config, `from_pretrained` options) that load only the language model of a multimodal checkpoint
    whose causal-LM class is the whole vision-language model (Gemma 3 / 4, Gemma 4 unified): the text
    model's own causal LM on the same weights, the vision and audio towers left unread. Other configs
    pass unchanged (Qwen3.5's causal-LM class already is its text model)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

    text = config.get_text_config(decoder=True)
    whole = names.get(config.model_type, "").endswith("ForConditionalGeneration")
    if text is config or not whole or text.model_type not in names:
        return config, {}
    return text, {"key_mapping": _TEXT_WEIGHTS}


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """A vision-language model object's language model as its text model's own causal LM (as `text_part`
    loads it from a folder), sharing its modules: nothing is copied. Other models as they are."""
    inner = getattr(getattr(model, "model", None), "language_model", None)
    if not isinstance(inner, torch.nn.Module):
        return model
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):  # the shell only: its modules are the model's own
            text = AutoModelForCausalLM.from_config(model.config.get_text_config(decoder=True))
    except ValueError:  # no causal LM for the text model: refused as unsupported below
        return model
    text.model, text.lm_head = inner, model.get_output_embeddings()
    if any(t.is_meta for t in [*text.parameters(), *text.buffers()]):
        return model
    text.generation_config = model.generation_config
    text.config._name_or_path = getattr(model.config, "_name_or_path", "")
    return text
