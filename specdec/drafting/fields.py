"""A drafter config's fields checked by JSON type and range before any is used, one way for every kind:
a string where a size belongs would otherwise be multiplied into nonsense shapes, a null passed to
`int()` as a traceback, a 0 divided by. Each problem is named by its field."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["dflash_problems", "first_given", "is_flag", "is_int", "is_number"]


def is_int(v: Any) -> bool:
    """A JSON integer (not a boolean)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any, *, hi: float | None = None) -> bool:
    """A finite JSON number > 0 (and <= `hi`)."""
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    return ok and (hi is None or v <= hi)


def is_flag(v: Any) -> bool:
    """A JSON boolean: the string "false" is not one (`bool("false")` is True)."""
    return isinstance(v, bool)


def first_given(*values: Any) -> Any:
    """The first of `values` that is not None: a field given as null takes its default."""
    return next(v for v in values if v is not None)


def dflash_problems(raw: Mapping[str, Any], *, required: Sequence[str], dflash2: Sequence[str]) -> list[str]:
    """What is of the wrong type or range in a DFlash / DFlash2 config dict (`required`: its sizes,
    `dflash2`: DFlash2's sizes), at the top level and in `dflash_config`, which the readers look in."""
    dflash = raw.get("dflash_config")
    if dflash is not None and not isinstance(dflash, Mapping):
        return [f"dflash_config must be an object, got {dflash!r}"]
    dflash = dflash or {}

    def get(k: str) -> Any:
        return dflash.get(k, raw.get(k))

    out = [
        f"{k} must be a positive integer, got {raw[k]!r}"
        for k in required
        if k in raw and not (is_int(raw[k]) and raw[k] >= 1)
    ]
    positive = ("head_dim", "block_size", "max_position_embeddings", "sliding_window", *dflash2)
    given = [(k, v) for k in positive for v in (dflash.get(k), raw.get(k)) if v is not None]
    out += [f"{k} must be a positive integer, got {v!r}" for k, v in given if not (is_int(v) and v >= 1)]
    out += [
        f"{k} must be true or false, got {raw[k]!r}"
        for k in ("attention_bias", "is_causal")
        if raw.get(k) is not None and not is_flag(raw[k])
    ]
    out += [
        f"{k} must be an object, got {raw[k]!r}"
        for k in ("rope_parameters", "rope_scaling")
        if raw.get(k) is not None and not isinstance(raw[k], Mapping)
    ]
    for k in ("architectures", "layer_types"):
        v = raw.get(k)
        if v is not None and not (isinstance(v, list) and all(isinstance(a, str) for a in v)):
            out.append(f"{k} must be a list of strings, got {v!r}")
    if raw.get("hidden_act") is not None and not isinstance(raw["hidden_act"], str):
        out.append(f"hidden_act must be a string, got {raw['hidden_act']!r}")
    if get("mask_token_id") is not None and not is_int(get("mask_token_id")):
        out.append(f"mask_token_id must be an integer, got {get('mask_token_id')!r}")
    for k in ("target_layer_ids", "draft_vocab"):
        v = get(k)
        if v is not None and not (isinstance(v, list) and all(is_int(i) for i in v)):
            out.append(f"{k} must be a list of integers, got {v!r}")
    numbers = ("rms_norm_eps", "rope_theta", "output_multiplier", "input_embedding_scale")
    out += [
        f"{k} must be a positive number, got {get(k)!r}"
        for k in numbers
        if get(k) is not None and not is_number(get(k))
    ]
    cap = get("final_logit_softcapping")
    if cap is not None and not (isinstance(cap, int | float) and not isinstance(cap, bool)):
        out.append(f"final_logit_softcapping must be a number (<= 0: none), got {cap!r}")
    return out
