"""MLX pieces the MLX drafters share: one sampled draw per row, and a head over the verifier's own LM head
(quantized or not, soft-capped, or over a draft vocabulary's rows)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from specdec.bridges.mlx import final_softcap, head_module

__all__ = ["head_fn", "sample_rows"]


def sample_rows(q: mx.array, u: float) -> mx.array:
    """One draw from each row of q [B, V] with the uniform u, by inverse CDF as `specdec.sampling.sample_from`
    (a zero-probability id never comes out) -> ids [B], lazy. The MLX drafters' sampled walks draw here."""
    cdf = mx.cumsum(q, axis=-1)
    idx = mx.minimum(mx.sum(cdf <= u * cdf[:, -1:], axis=-1), q.shape[-1] - 1)
    zero = mx.take_along_axis(q, idx[:, None], axis=-1)[:, 0] == 0
    return mx.where(zero, mx.argmax(q, axis=-1), idx)


def head_fn(model: nn.Module, rows: mx.array | None) -> Any:
    """hidden [..., H] -> logits [..., V] (or [..., K] of the draft vocabulary `rows`) through the MLX model's
    own head module, quantized or not, soft-capped where the model caps (as the bridge computes it). The
    rows are taken once and evaluated here, so any thread may then decode."""
    head, cap = head_module(model), final_softcap(model)
    if rows is None:
        lin = head.as_linear if isinstance(head, (nn.Embedding, nn.QuantizedEmbedding)) else head
    elif isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w, s, b = head.weight[rows], head.scales[rows], head.get("biases")  # [K, ...] quantized rows
        b = None if b is None else b[rows]
        mx.eval(w, s, *(() if b is None else (b,)))
        gs, bits, mode = head.group_size, head.bits, getattr(head, "mode", "affine")
        kw = {"mode": mode} if mode != "affine" else {}

        def lin(h: mx.array) -> mx.array:
            return mx.quantized_matmul(h, w, s, b, transpose=True, group_size=gs, bits=bits, **kw)
    else:
        w = head.weight[rows]  # [K, H]
        bias = head.get("bias") if isinstance(head, nn.Linear) else None
        bias = None if bias is None else bias[rows]
        mx.eval(w, *(() if bias is None else (bias,)))

        def lin(h: mx.array) -> mx.array:
            return h @ w.T if bias is None else h @ w.T + bias

    if cap is None:
        return lin
    return lambda h: mx.tanh(lin(h) / cap) * cap
