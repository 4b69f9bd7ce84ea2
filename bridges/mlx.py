"""mx.array <-> torch, and the target's embedding / LM head as torch callables built from MLX weights.

Contract:
- `to_torch(x, device=, dtype=)` evaluates `x` first (so a timer that stops after it is honest) and
  shares its memory with no copy when the runtimes allow it: DLPack on the CPU build and, onto MPS, on
  Metal where torch imports MLX's kDLMetal export (checked once: `metal_dlpack_ok`), else the buffer
  protocol (Apple unified memory: no copy on the host side; `.to("mps")` then copies).
  A copy happens when `device` or `dtype` differ from the array's, or when `x` is not row-contiguous
  (column slices, transposes, reversed steps are made contiguous on the MLX side: torch aborts on DLPack
  negative strides). The result aliases MLX memory: treat it as read-only.
- `to_mlx(t)` always copies (tokens, ids: the small things that go the other way).
- `make_embed_fn` / `make_lm_head_fn` rebuild the model's embedding and LM head in torch from its
  weights (dequantized where quantized), matching what the mlx_lm implementation computes: Gemma's
  embedding scale rounded as that model rounds it, the final-logit soft-capping where the model applies
  it, tied or untied heads. The final norm is NOT part of the LM head (the drafter has its own).
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch
import torch.nn.functional as F

from specdec.kernels import linear_fn
from specdec.protocols import EmbedFn, LMHeadFn

__all__ = [
    "MLX_DTYPES",
    "UNSUPPORTED_HEAD_TYPES",
    "dequantized_weight",
    "dtype_name",
    "embed_scale",
    "final_softcap",
    "head_module",
    "make_embed_fn",
    "make_lm_head_fn",
    "materialize",
    "text_model",
    "to_mlx",
    "to_torch",
]

_KDL_CPU, _KDL_METAL = 1, 8  # DLPack device types
#: the dtypes an MLX model or drafter runs in, by name
MLX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def dtype_name(d: mx.Dtype) -> str:
    """ "mlx.core.float32" -> "float32"."""
    return str(d).rsplit(".", 1)[-1]


#: mlx_lm architectures whose embedding or head does something this module does not reproduce (scaled
#: logits, muP multipliers, per-layer inputs, ...): found by grepping mlx_lm 0.32 models/ for embedding
#: and logit scale factors, minus the Gemma 1/2/3/4 conventions handled below. Gemma 4's per-layer inputs
#: are a second embedding the model feeds to each decoder layer internally; the drafter shares only the
#: main (scaled) token embedding, so they are not part of embed_fn.
UNSUPPORTED_HEAD_TYPES = frozenset(
    {
        "afmoe",
        "cohere",
        "cohere2",
        "falcon_h1",
        "gear",
        "gemma3n",
        "granite",
        "granitemoe",
        "granitemoehybrid",
        "minicpm",
        "minicpm3",
        "muse_glimmer",
        "muse_spark",
        "phi3small",
    }
)


def materialize(*objs: Any) -> None:
    """Evaluate every array `objs` hold, here: an mlx model's parameters and the arrays its modules keep
    outside them (private attributes, and those of the plain objects they hold: mlx_lm's RoPE variants
    keep their frequencies as `_freqs`). MLX >= 0.32 keeps default streams per thread: a lazy array made
    on the thread that loads cannot be evaluated on the thread that decodes (a server's, an app's)."""
    mx.eval(_arrays(objs, set()))


def _arrays(obj: Any, seen: set[int]) -> list[mx.array]:
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, list | tuple):
        return [a for x in obj for a in _arrays(x, seen)]
    children = list(obj.values()) if isinstance(obj, dict) else []  # a Module is a dict of its children
    attrs = getattr(obj, "__dict__", None)
    if attrs is not None and (isinstance(obj, nn.Module) or type(obj).__module__.startswith("mlx_lm")):
        children += list(attrs.values())
    return [a for x in children for a in _arrays(x, seen)]


def to_torch(
    x: mx.array, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`x` as a torch tensor on `device` (copied only if `device`/`dtype` require it)."""
    # Row-contiguous arrays (and row slices of them) pass through as they are; anything else is made
    # contiguous on the MLX side first: torch aborts the process on DLPack's negative strides (x[:, ::-1])
    x = mx.contiguous(x)
    mx.eval(x)  # DLPack export would force it anyway; explicit so the bridge time is honest
    return _import(x, torch.device(device).type).to(
        device=device, dtype=dtype
    )  # `t` itself if nothing changes


def _import(x: mx.array, device_type: str) -> torch.Tensor:
    """An evaluated, contiguous `x` in torch without a copy: DLPack on the CPU build; on Metal, DLPack into
    MPS where this torch imports MLX's kDLMetal export (`metal_dlpack_ok`), else the buffer protocol (unified
    memory: still no copy, but a host-visible tensor that `.to("mps")` then copies). The DLPack capsule's
    deleter keeps the MLX buffer alive as long as the torch tensor uses it."""
    kind = _dlpack_kind(x)
    if kind == _KDL_CPU or (kind == _KDL_METAL and device_type == "mps" and metal_dlpack_ok()):
        return torch.from_dlpack(x)
    return _via_buffer(x)


def _dlpack_kind(x: mx.array) -> int:
    return int(x.__dlpack_device__()[0])


@functools.cache
def metal_dlpack_ok() -> bool:
    """Whether torch imports MLX's Metal DLPack export onto MPS, correctly (MLX >= 0.32 exports kDLMetal with
    a byte offset; checked once with a round trip of an offset slice). False off Apple Silicon."""
    if not torch.backends.mps.is_available() or tuple(map(int, mx.__version__.split(".")[:2])) < (0, 32):
        return False
    try:
        a = mx.arange(12, dtype=mx.float32)[4:]  # an offset into its buffer
        mx.eval(a)
        t = torch.from_dlpack(a)
        return t.device.type == "mps" and torch.equal(t.cpu(), torch.arange(4, 12, dtype=torch.float32))
    except Exception:  # an older torch: "Unsupported device type" and the like
        return False


def _via_buffer(x: mx.array) -> torch.Tensor:
    if x.dtype == mx.bfloat16:  # numpy has no bfloat16: move the bits as uint16
        return torch.from_numpy(np.array(x.view(mx.uint16), copy=False)).view(torch.bfloat16)
    return torch.from_numpy(np.array(x, copy=False))


def to_mlx(t: torch.Tensor) -> mx.array:
    """A copy of `t` as an mx.array (same dtype, bfloat16 included)."""
    return mx.array(t.detach().cpu())


def text_model(model: nn.Module) -> nn.Module:
    """The causal-LM part of an mlx_lm model (Gemma 3 multimodal checkpoints wrap it in `language_model`)."""
    return getattr(model, "language_model", model)


def _model_type(model: nn.Module) -> str:
    return str(getattr(text_model(model), "model_type", type(model).__module__.rsplit(".", 1)[-1]))


def _check_supported(model: nn.Module) -> nn.Module:
    tm, mtype = text_model(model), _model_type(model)
    if mtype in UNSUPPORTED_HEAD_TYPES:
        raise ValueError(
            f"mlx_lm model type {mtype!r} scales its embedding or logits in a way specdec does not reproduce "
            "in embed_fn / lm_head_fn; a drafter cannot share its embedding and head"
        )
    inner = getattr(tm, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens"):
        raise ValueError(
            f"mlx_lm model type {mtype!r} has no `model.embed_tokens`: cannot build embed_fn / lm_head_fn"
        )
    return inner


def dequantized_weight(module: nn.Module) -> mx.array:
    """[out, in] float weight of an Embedding / Linear, dequantized if it is a Quantized* module."""
    if isinstance(module, (nn.QuantizedEmbedding, nn.QuantizedLinear)):
        return mx.dequantize(
            module.weight,
            module.scales,
            module.get("biases"),
            module.group_size,
            module.bits,
            mode=module.mode,
        )
    if isinstance(module, (nn.Embedding, nn.Linear)):
        return module.weight
    raise TypeError(f"cannot take a weight matrix from {type(module).__name__}")


def embed_scale(model: nn.Module) -> float | None:
    """The factor the model multiplies its token embeddings by, as the model computes it (None: no scale)."""
    inner, mtype = _check_supported(model), _model_type(model)
    h_dtype = inner.embed_tokens(mx.array([0])).dtype  # dequantized dtype for quantized embeddings
    hidden = int(text_model(model).args.hidden_size)
    if mtype == "gemma3_text":
        # gemma3_text: h *= mx.array(hidden_size**0.5, mx.bfloat16).astype(h.dtype) -- rounded to bf16 first
        return mx.array(hidden**0.5, mx.bfloat16).astype(h_dtype).item()
    if mtype in ("gemma", "gemma2", "gemma4_text"):
        # h * (hidden_size**0.5): a Python scalar takes h's dtype
        return mx.array(hidden**0.5, h_dtype).item()
    return None


def final_softcap(model: nn.Module) -> float | None:
    """The final-logit soft-capping value if the mlx_lm model applies one (None otherwise).

    mlx_lm's gemma3_text ignores `final_logit_softcapping` (transformers applies it when the config sets
    it; released Gemma 3 configs have null), so only gemma2 and gemma4_text cap here: we match the MLX
    verifier.
    """
    mtype = _model_type(model)
    if mtype == "gemma2":
        return float(text_model(model).args.final_logit_softcapping)
    if mtype == "gemma4_text":
        cap = text_model(model).final_logit_softcapping  # None: no capping
        return None if cap is None else float(cap)
    return None


def head_module(model: nn.Module) -> nn.Module:
    """The module whose weight is the LM head: `lm_head` if untied, else the token embedding."""
    inner, tm = _check_supported(model), text_model(model)
    head = getattr(tm, "lm_head", None)
    if head is not None and not getattr(tm, "tie_word_embeddings", False):
        return head
    return inner.embed_tokens


def make_embed_fn(
    model: nn.Module, *, device: torch.device | str, dtype: torch.dtype, weight: torch.Tensor | None = None
) -> EmbedFn:
    """ids [..., T] -> [..., T, H] as the model embeds them. `weight` ([V, H] on device/dtype) may be
    passed to share one copy with a tied head."""
    inner = _check_supported(model)
    if weight is None:
        weight = to_torch(dequantized_weight(inner.embed_tokens), device=device, dtype=dtype)  # [V, H]
    scale = embed_scale(model)
    if scale is None:
        return lambda ids: F.embedding(ids, weight)
    return lambda ids: F.embedding(ids, weight) * scale


def make_lm_head_fn(
    model: nn.Module,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    weight: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> LMHeadFn:
    """hidden [..., H] (after the model's final norm) -> logits [..., V] as the model's head computes them;
    with `rows` (a draft vocabulary [K]) the logits [..., K] of those ids only, from a [K, H] copy."""
    head = head_module(model)
    if weight is None:
        weight = to_torch(dequantized_weight(head), device=device, dtype=dtype)  # [V, H]
    bias = head.get("bias") if isinstance(head, (nn.Linear, nn.QuantizedLinear)) else None
    b = to_torch(bias, device=device, dtype=dtype) if bias is not None else None  # [V]
    if rows is not None:
        rows = rows.to(device=weight.device)
        weight, b = weight[rows], None if b is None else b[rows]  # [K, H], [K]
    cap = final_softcap(model)
    linear = linear_fn(device, dtype)  # oneDNN on a CPU (fp32, bf16): a block read-out costs half

    def lm_head(h: torch.Tensor) -> torch.Tensor:
        logits = linear(h, weight, b)  # [..., V]
        return torch.tanh(logits / cap) * cap if cap is not None else logits

    return lm_head
