"""Runtime compatibility: what transformers 5 writes that mlx_lm reads otherwise, kept in one place.

- `config_fixes`: config fields mlx_lm needs at the top level that transformers 5 stores elsewhere
  (rope values under `rope_parameters`, layer-type periods, renamed fields), used when a folder is
  converted (`specdec.models.fetch`) and when the MLX verifier loads one.
- `model_classes` / `transformers_layout`: mlx_lm's model classes with a sanitize step that first reads the
  weight layouts transformers 5 saves and mlx_lm's own sanitize does not.
- `cast_params`: an mlx_lm model in another float dtype, quantized layers' scales kept.

Pure Python at import; mlx and mlx_lm load inside the functions that need them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = ["cast_params", "config_fixes", "model_classes", "transformers_layout"]


#: transformers' text-only model types and the mlx_lm model that reads them as its `text_config`
_TEXT_ONLY = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
#: model types with a `text_config` that mlx_lm reads (it names gemma4_unified gemma4 itself)
_WRAPPED = ("gemma3", "gemma4", "gemma4_unified", "qwen3_5", "qwen3_5_moe")
#: transformers' text model types that are another's with features off, and the fields that turn them
#: off where mlx_lm's defaults would turn them on: Gemma 4 unified (the 12B) is Gemma 4 without
#: per-layer inputs and without the MoE block (mlx_lm's default per-layer input width is 256)
_SUBSETS = {"gemma4_unified_text": ("gemma4_text", {"hidden_size_per_layer_input": 0})}


def config_fixes(config: dict[str, Any]) -> dict[str, Any]:
    """Config fields mlx_lm needs at the top level that transformers 5 stores elsewhere (pass as
    `model_config`). Without them mlx_lm silently uses its defaults (rope_theta 10000, window pattern 6,
    Gemma 4's global head_dim 512) or fails to build (Qwen3-MoE's `num_experts`). A Gemma 4 or Qwen3.5
    multimodal config gets its fixes inside `text_config`; a text-only Qwen3.5 (`qwen3_5_text`, which
    mlx_lm has no module for) becomes the `text_config` of the multimodal type; a Gemma 4 unified text
    config becomes the Gemma 4 text config it is a part of."""
    text = config.get("text_config")
    mtype = config.get("model_type")
    if mtype in _WRAPPED and isinstance(text, dict):
        inner = _flat_fixes(text)
        fixes = {"text_config": {**text, **inner}} if inner else {}
        if mtype.startswith("gemma") and "vocab_size" not in config and "vocab_size" in text:
            # mlx_lm's gemma3 / gemma4 overwrite the text vocabulary with their top-level default (262144+)
            fixes["vocab_size"] = text["vocab_size"]
        return fixes
    if mtype in _TEXT_ONLY:  # transformers' text-only Qwen3.5 layout: mlx_lm reads it as the outer model's
        return {"model_type": _TEXT_ONLY[mtype], "text_config": {**config, **_flat_fixes(config)}}
    return _flat_fixes(config)


def _flat_fixes(config: dict[str, Any]) -> dict[str, Any]:
    """`config_fixes` of one flat (text) config."""
    mtype = config.get("model_type")
    fixes: dict[str, Any] = {}
    if mtype in _SUBSETS:
        mtype, off = _SUBSETS[mtype]
        fixes = {"model_type": mtype, **{k: v for k, v in off.items() if config.get(k) is None}}
        config = {**config, "model_type": mtype}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):  # each field only where the config has no top-level value of its own
        per_type = {k: v for k, v in rope.items() if isinstance(v, dict)}
        full = per_type.get("full_attention", rope) if per_type else rope
        if "rope_theta" in full and "rope_theta" not in config:
            fixes["rope_theta"] = full["rope_theta"]
        if not per_type and "partial_rotary_factor" in full and "partial_rotary_factor" not in config:
            fixes["partial_rotary_factor"] = full["partial_rotary_factor"]  # e.g. qwen3_next
        if full.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
            fixes["rope_scaling"] = {
                k: v for k, v in full.items() if k != "rope_theta"
            }  # e.g. gpt-oss's YaRN
        sliding = per_type.get("sliding_attention")
        if sliding and "rope_theta" in sliding and "rope_local_base_freq" not in config:
            fixes["rope_local_base_freq"] = sliding["rope_theta"]
    types = config.get("layer_types")
    # mlx_lm derives these layer patterns from a period that transformers 5 no longer writes
    period_keys = {"gemma3_text": ("sliding_window_pattern", "sliding_attention"),
                   "qwen3_next": ("full_attention_interval", "linear_attention"),
                   "qwen3_5_text": ("full_attention_interval", "linear_attention"),
                   "qwen3_5_moe_text": ("full_attention_interval", "linear_attention")}  # fmt: skip
    if mtype in period_keys and types and period_keys[mtype][0] not in config:
        key, other = period_keys[mtype]
        if "full_attention" not in types:
            raise ValueError(f"{mtype} config has no full_attention layer in layer_types; mlx_lm needs one")
        p = types.index("full_attention") + 1
        expect = ["full_attention" if (i + 1) % p == 0 else other for i in range(len(types))]
        if list(types) != expect:
            raise ValueError(
                f"{mtype} layer_types {types} are not periodic; mlx_lm's {mtype} only supports a fixed {key}"
            )
        fixes[key] = p
    if "num_local_experts" in config and "num_experts" not in config:  # transformers 5 renames it
        fixes["num_experts"] = config["num_local_experts"]
    per_layer = config.get("per_layer_config")
    if config.get("model_type") == "gemma4_text" and isinstance(per_layer, dict) and types:
        # transformers 5 folds global_head_dim / num_global_key_value_heads into per-layer overrides of
        # the full-attention layers; mlx_lm reads the top-level names
        # keyed by the layer index, zero-padded to the widest one ("05" of 12 layers)
        over = {int(k): v for k, v in per_layer.items()}
        full = [over.get(i) or {} for i, t in enumerate(types) if t == "full_attention"]
        for key, name in (
            ("head_dim", "global_head_dim"),
            ("num_key_value_heads", "num_global_key_value_heads"),
        ):
            values = {o[key] for o in full if key in o}
            if len(values) > 1:
                raise ValueError(f"gemma4 full-attention layers disagree on {key}: {sorted(values)}")
            if values and name not in config:
                fixes[name] = values.pop()
    return fixes


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx_lm's model classes for `config`, with a `sanitize` that first reads the layouts transformers 5
    saves which mlx_lm's own does not (`transformers_layout`)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mtype = config.get("model_type")

    def sanitize(self: Any, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = transformers_layout(mtype, weights)
        return model_class.sanitize(self, weights) if hasattr(model_class, "sanitize") else weights

    return type(model_class.__name__, (model_class,), {"sanitize": sanitize}), args_class


def transformers_layout(model_type: str | None, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Weights as mlx_lm's sanitizers expect them, from two layouts transformers 5.25 saves:
    - Qwen3.5-MoE experts one by one (`...mlp.experts.<e>.<gate|up|down>_proj.weight`), which mlx_lm's
      qwen3_5_moe reads only fused: stacked into `...mlp.switch_mlp.<name>.weight` [E, out, in];
    - gpt-oss experts as bare input-major tensors (`...experts.gate_up_proj` [E, H, 2I], `down_proj`
      [E, I, H]), where mlx_lm expects OpenAI's output-major `....weight`: transposed and renamed.
    mlx-community conversions (already sanitized) match neither pattern and pass unchanged."""
    import re

    import mlx.core as mx

    if model_type not in ("qwen3_5_moe", "gpt_oss"):
        return weights
    out: dict[str, mx.array] = {}
    experts: dict[tuple[str, str], dict[int, mx.array]] = {}
    for k, v in weights.items():
        m = re.fullmatch(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", k)
        if m and model_type == "qwen3_5_moe":
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = v
        elif (
            model_type == "gpt_oss" and re.search(r"\.experts\.(gate_up_proj|down_proj)$", k) and v.ndim == 3
        ):
            out[k + ".weight"] = mx.swapaxes(v, -1, -2)
        else:
            out[k] = v
    for (prefix, name), by_e in experts.items():
        out[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack([by_e[e] for e in sorted(by_e)])  # [E, out, in]
    return out


def cast_params(model: Any, dtype: mx.Dtype, *, recast_quantized: bool) -> None:
    """Cast an mlx_lm model's floating-point parameters to `dtype`, except the scales and biases of
    quantized layers (their precision is part of the checkpoint) unless `recast_quantized`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params = tree_flatten(model.parameters())
    keep = ("scales", "biases") if not recast_quantized else ()
    cast = [
        (k, v.astype(dtype))
        for k, v in params
        if mx.issubdtype(v.dtype, mx.floating) and k.rsplit(".", 1)[-1] not in keep
    ]
    model.update(tree_unflatten(cast))
