"""The DFlash drafters' rotary embedding as transformers computes it: the scaling part of a config's
`rope_scaling` / `rope_parameters` (`rope_scaling`) and the inverse frequencies and attention factor of
default, linear, YaRN and Llama-3 RoPE for a drafter config (`rope_frequencies`: its `head_dim`,
`rope_theta`, `rope_scaling`). Both drafter runtimes (torch, MLX) and both drafter kinds use it."""

from __future__ import annotations

from typing import Any

__all__ = ["ROPE_TYPES", "rope_frequencies", "rope_scaling"]

#: RoPE types the drafters compute (`rope_frequencies`)
ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def rope_scaling(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The scaling part of a config's `rope_scaling` / `rope_parameters`: None for plain RoPE; ValueError
    for a type the drafters do not compute."""
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type {kind!r} is not supported by the drafters (only {list(ROPE_TYPES)})")
    if kind == "default":
        return None
    if not isinstance(spec.get("factor"), (int, float)) or spec["factor"] <= 0:
        raise ValueError(f"RoPE scaling {spec} needs a positive 'factor'")
    if kind in ("yarn", "llama3") and not spec.get("original_max_position_embeddings"):
        raise ValueError(f"{kind} RoPE scaling {spec} needs 'original_max_position_embeddings'")
    return {
        "rope_type": kind,
        **{k: v for k, v in spec.items() if k not in ("rope_type", "type", "rope_theta")},
    }


def rope_frequencies(cfg: Any) -> tuple[list[float], float]:
    """The drafter's RoPE: inverse frequencies [D/2] and the factor cos / sin are scaled by, as
    transformers computes them for `cfg.rope_scaling` (default, linear, YaRN with its ramp between
    `beta_fast` and `beta_slow`, `truncate`, `mscale` / `mscale_all_dim` / `attention_factor`)."""
    import math

    D, base = cfg.head_dim, cfg.rope_theta
    inv = [1.0 / base ** (i / D) for i in range(0, D, 2)]
    sc = cfg.rope_scaling
    if sc is None:
        return inv, 1.0
    factor = float(sc["factor"])
    if sc["rope_type"] == "linear":
        return [f / factor for f in inv], 1.0
    orig = float(sc["original_max_position_embeddings"])
    if sc["rope_type"] == "llama3":
        return _llama3(inv, factor, orig, sc), 1.0

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength makes `rotations` turns
        return D * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_of(float(sc.get("beta_fast") or 32.0)), dim_of(float(sc.get("beta_slow") or 1.0))
    if sc.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, D - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = [min(max((i - lo) / (hi - lo), 0.0), 1.0) for i in range(D // 2)]
    inv = [f / factor * r + f * (1 - r) for f, r in zip(inv, ramp)]  # interpolated where ramp is 1

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attn = sc.get("attention_factor")
    if attn is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attn = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)
    return inv, float(attn)


def _llama3(inv: list[float], factor: float, orig: float, sc: dict[str, Any]) -> list[float]:
    """Llama 3.1's RoPE: wavelengths under orig / high_freq_factor kept, over orig / low_freq_factor divided
    by `factor`, smoothly between (as transformers' `_compute_llama3_parameters`)."""
    import math

    low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(f)
        elif wavelen > orig / low:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out
