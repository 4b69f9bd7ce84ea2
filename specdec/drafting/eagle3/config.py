"""EAGLE-3 checkpoints as specdec reads them, in the three public dialects, checked before anything loads.

- speculators (RedHatAI, vLLM's `speculators` library): `speculators_model_type` "eagle3", the draft
  layer's shape in `transformer_layer_config` (llama, or qwen3 with q/k norms), the flags
  `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`, `eagle_aux_hidden_state_layer_ids`,
  and `speculators_config` (its `speculative_tokens`, the verifier it was made for); weights
  `layers.{i}.*`, `fc`, `norm`, `lm_head`, `d2t` / `t2d`, an optional `embed_tokens`.
- yuhuili's (the EAGLE authors'): a flat Llama config with `draft_vocab_size`, weights in
  `pytorch_model.bin` with the one decoder layer named `midlayer.*`.
- SGLang / SpecForge: `architectures` LlamaForCausalLMEagle3, the same flat config, `model.safetensors`.

All map onto one `Eagle3Config` and the speculators weight names (`param_shapes`). Which hidden states it
reads: an aux layer id i names the residual stream *entering* decoder layer i (vLLM's `llama_eagle3.py`
collects `hidden_states + residual` before layer i runs; mlx-vlm captures layer i - 1's output), which is
specdec's target layer i - 1 (`target_layer_ids`); id 0 (the embeddings) is refused. The default ids are
[2, N // 2, N - 3] for a target of N layers (vLLM's and mlx-vlm's default).

A `pytorch_model.bin` is read with `torch.load(..., weights_only=True)` only: no code from a checkpoint runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specdec.drafting.fields import is_flag, is_number
from specdec.drafting.rope import rope_scaling

__all__ = [
    "EAGLE3_BLOCK_SIZE", "Eagle3Config", "check_eagle3", "default_aux_ids", "load_eagle3_weights",
    "param_shapes", "read_eagle3", "save_eagle3",
]  # fmt: skip

#: drafts per step + 1 where the checkpoint does not say (`speculators_config` speculative_tokens): each
#: draft costs one forward of the draft layer, so chains are short unless the cost cut extends them
EAGLE3_BLOCK_SIZE = 6
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
#: weights a checkpoint may carry that drafting does not use (training's copies of the verifier's parts)
_UNUSED = ("verifier_", "t2d")


def default_aux_ids(num_target_layers: int) -> tuple[int, ...]:
    """The aux layer ids an EAGLE-3 checkpoint that names none reads: [2, N // 2, N - 3]."""
    n = num_target_layers
    return (2, n // 2, n - 3)


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 drafter's config, whatever its dialect. `aux_layer_ids` as the checkpoint names them
    (None: the default for the target, `default_aux_ids`, fixed by `for_target`)."""

    dialect: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool
    qk_norm: bool  # a qwen3 layer: per-head q / k RMSNorm
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    block_size: int = EAGLE3_BLOCK_SIZE
    target_model: str | None = None  # the verifier it was made for, where the config names it
    weights_file: str = "model.safetensors"
    has_embed: bool = False  # ships its own embed_tokens (else the verifier's embeddings are used)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # P-EAGLE (speculators_model_type peagle): the mask token of its parallel rows (None: EAGLE-3)
    parallel_mask_token_id: int | None = None

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """specdec's target layers (decoder-layer outputs) the aux ids read: id i is layer i - 1's output."""
        assert self.aux_layer_ids is not None, "call for_target first"
        return tuple(i - 1 for i in self.aux_layer_ids)

    @property
    def num_aux(self) -> int:
        return 3 if self.aux_layer_ids is None else len(self.aux_layer_ids)

    @property
    def feature_dim(self) -> int:
        return self.num_aux * self.target_hidden_size

    def for_target(self, num_target_layers: int) -> Eagle3Config:
        """This config with its aux ids fixed for a target of `num_target_layers` layers."""
        if self.aux_layer_ids is not None:
            return self
        return replace(self, aux_layer_ids=default_aux_ids(num_target_layers))


def _int(raw: Mapping[str, Any], key: str, where: str, default: Any = None) -> int:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{where}: {key} must be a positive integer, got {v!r}")
    return v


def _float(raw: Mapping[str, Any], key: str, where: str, default: float) -> float:
    """`raw[key]` as a finite positive number (`default` where absent or null)."""
    v = raw.get(key)
    if v is None:
        return default
    if not is_number(v):
        raise ValueError(f"{where}: {key} must be a positive number, got {v!r}")
    return float(v)


def _flag(raw: Mapping[str, Any], key: str, where: str) -> bool:
    """`raw[key]` as a JSON boolean (False where absent or null): a string "false" is not one."""
    v = raw.get(key)
    if v is None:
        return False
    if not is_flag(v):
        raise ValueError(f"{where}: {key} must be true or false, got {v!r}")
    return v


def _layer_config(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The draft layer's config: speculators' `transformer_layer_config`, else the flat config itself."""
    sub = raw.get("transformer_layer_config")
    if sub is None:
        return dict(raw)
    if not isinstance(sub, Mapping):
        raise ValueError(f"{where}: transformer_layer_config must be an object")
    return dict(sub)


def _aux_ids(raw: Mapping[str, Any], where: str) -> tuple[int, ...] | None:
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}")
    if 0 in ids:
        raise ValueError(
            f"{where}: aux layer id 0 reads the token embeddings, which specdec's verifiers do not hand over "
            f"(ids {ids}); only decoder-layer outputs (ids >= 1)"
        )
    return tuple(ids)


def _speculators(raw: Mapping[str, Any], where: str) -> tuple[int | None, str | None]:
    """(speculative tokens per step, the verifier's name) from a `speculators_config`, where given; what
    it gives is checked (an object, a list of methods, a positive token count)."""
    sc = raw.get("speculators_config")
    if sc is None:
        return None, None
    if not isinstance(sc, Mapping):
        raise ValueError(f"{where}: speculators_config must be an object, got {sc!r}"[:200])
    methods = sc.get("proposal_methods") or []
    if not isinstance(methods, list) or not all(isinstance(m, Mapping) for m in methods):
        raise ValueError(f"{where}: speculators_config.proposal_methods must be a list of objects")
    k = methods[0].get("speculative_tokens") if methods else None
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k <= 0):
        raise ValueError(
            f"{where}: speculators_config.proposal_methods[0].speculative_tokens must be a positive "
            f"integer, got {k!r}"
        )
    ver = sc.get("verifier")
    name = ver.get("name_or_path") if isinstance(ver, Mapping) else None
    return k, (name if isinstance(name, str) else None)


def parse_config(raw: Mapping[str, Any], *, dialect: str, weights_file: str, where: str) -> Eagle3Config:
    """An `Eagle3Config` from a config dict of any dialect (ValueError, one line, naming the field)."""
    layer = _layer_config(raw, where)
    mtype = str(layer.get("model_type") or "llama")
    if mtype not in ("llama", "qwen3", "mistral"):
        raise ValueError(f"{where}: draft layers of model_type {mtype!r} are not read (llama, qwen3)")
    H = _int(layer, "hidden_size", where)
    heads = _int(layer, "num_attention_heads", where)
    types = layer.get("layer_types") or []
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    rope = layer.get("rope_scaling") or layer.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"{where}: rope_scaling must be an object, got {rope!r}")
    theta = _float(layer, "rope_theta", where, _float(rope, "rope_theta", where, 10000.0))
    try:
        scaling = rope_scaling(dict(rope))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    k, target = _speculators(raw, where)
    cfg = Eagle3Config(
        dialect=dialect,
        hidden_size=H,
        intermediate_size=_int(layer, "intermediate_size", where),
        num_layers=_int(layer, "num_hidden_layers", where, 1),
        num_attention_heads=heads,
        num_key_value_heads=_int(layer, "num_key_value_heads", where, heads),
        head_dim=_int(layer, "head_dim", where, H // heads) if layer.get("head_dim") else H // heads,
        rms_norm_eps=_float(layer, "rms_norm_eps", where, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=_flag(layer, "attention_bias", where),
        qk_norm=mtype == "qwen3",
        vocab_size=_int(layer, "vocab_size", where),
        draft_vocab_size=_int(raw, "draft_vocab_size", where, layer.get("vocab_size")),
        target_hidden_size=_int(raw, "target_hidden_size", where, H) if raw.get("target_hidden_size") else H,
        aux_layer_ids=_aux_ids(raw, where),
        norm_before_residual=_flag(raw, "norm_before_residual", where),
        norm_before_fc=_flag(raw, "norm_before_fc", where),
        fc_norm=_flag(raw, "fc_norm", where),
        norm_output=_flag(raw, "norm_output", where),
        block_size=(k + 1) if k else EAGLE3_BLOCK_SIZE,
        target_model=target,
        weights_file=weights_file,
        sliding_window=_int(layer, "sliding_window", where) if sliding else None,
        sliding_layers=sliding,
    )
    if raw.get("speculators_model_type") == "peagle":
        mask = raw.get("mask_token_id")
        if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < cfg.vocab_size:
            raise ValueError(
                f"{where}: a P-EAGLE config needs a mask_token_id in the vocabulary, got {mask!r}"
            )
        cfg = replace(cfg, parallel_mask_token_id=mask)
    if cfg.norm_before_fc and cfg.fc_norm:
        raise ValueError(f"{where}: norm_before_fc and fc_norm are exclusive, the config sets both")
    if cfg.draft_vocab_size > cfg.vocab_size:
        raise ValueError(
            f"{where}: draft_vocab_size {cfg.draft_vocab_size} exceeds the vocabulary ({cfg.vocab_size})"
        )
    return cfg


def param_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every weight an EAGLE-3 drafter of `cfg` has, by its speculators name, and its shape (without the
    optional `embed_tokens.weight`; `d2t` only with a draft vocabulary)."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, cfg.feature_dim), "norm.weight": (H,)}
    out["lm_head.weight"] = (cfg.draft_vocab_size, H)
    if cfg.draft_vocab_size != cfg.vocab_size:
        out["d2t"] = (cfg.draft_vocab_size,)
    if cfg.norm_before_fc:
        out["input_norm.weight"] = (cfg.feature_dim,)
    if cfg.parallel_mask_token_id is not None:  # P-EAGLE: the fused-hidden input of its parallel rows
        out["mask_hidden"] = (1, 1, cfg.feature_dim)
    for j in range(cfg.num_aux if cfg.fc_norm else 0):
        out[f"fc_norm.{j}.weight"] = (cfg.target_hidden_size,)
    for i in range(cfg.num_layers):
        p, inp = f"layers.{i}.", 2 * H if i == 0 else H
        out |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
        out |= {
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        }
        for name, o, i_ in (("q", q, inp), ("k", kv, inp), ("v", kv, inp), ("o", H, q)):
            out[p + f"self_attn.{name}_proj.weight"] = (o, i_)
            if cfg.attention_bias:
                out[p + f"self_attn.{name}_proj.bias"] = (o,)
        if cfg.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)}
        if i == 0:
            out[p + "hidden_norm.weight"] = (H,)
    return out


def _canonical(name: str) -> str:
    """A weight's speculators name: SGLang's `model.` prefix off, yuhuili's `midlayer.` as `layers.0.`."""
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def _read_tensors(file: Path, *, shapes_only: bool) -> dict[str, Any]:
    """{canonical name: shape (shapes_only) or tensor} of a safetensors or pytorch_model.bin file; one line
    of ValueError where it cannot be read (truncated, not that format)."""
    try:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                get = (lambda k: tuple(f.get_slice(k).get_shape())) if shapes_only else f.get_tensor
                return {_canonical(k): get(k) for k in f.keys()}  # noqa: SIM118
        try:  # weights only: no pickled code runs; mmap: the header alone is read for the shapes
            state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be mapped
            state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(
            f"cannot read {str(file)!r} (truncated or not a weights file): {str(e)[:200]}"
        ) from None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{str(file)!r} holds no plain name -> tensor mapping")
    return {_canonical(k): (tuple(v.shape) if shapes_only else v) for k, v in state.items()}


def _check_weights(cfg: Eagle3Config, shapes: Mapping[str, tuple[int, ...]], where: str) -> bool:
    """Names and shapes against `param_shapes` (one line naming the first problems); whether it ships its
    own embeddings."""
    want = param_shapes(cfg)
    emb = shapes.get("embed_tokens.weight")
    if emb is not None and emb != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"{where}: embed_tokens.weight is {list(emb)}, expected {[cfg.vocab_size, cfg.hidden_size]}"
        )
    used = {k: s for k, s in shapes.items() if not k.startswith(_UNUSED) and "rotary_emb" not in k}
    missing = sorted(set(want) - set(used))
    extra = sorted(set(used) - set(want) - {"embed_tokens.weight", "d2t"})
    wrong = [
        f"{k} {list(used[k])} (expected {list(want[k])})" for k in want if k in used and used[k] != want[k]
    ]
    if "d2t" in used and used["d2t"] != (cfg.draft_vocab_size,):
        wrong.append(f"d2t {list(used['d2t'])} (expected [{cfg.draft_vocab_size}]: one per draft token)")
    for what, items in (
        ("is missing", missing),
        ("has wrong shapes:", wrong),
        ("has unexpected weights", extra),
    ):
        if items:
            more = f" and {len(items) - 4} more" if len(items) > 4 else ""
            raise ValueError(f"{where} {what} {', '.join(items[:4])}{more}")
    return emb is not None


def read_eagle3(folder: str | Path, raw: Mapping[str, Any], *, dialect: str) -> Eagle3Config:
    """The config of an EAGLE-3 checkpoint folder, its weights' names and shapes checked (the header only,
    or a memory map of a pytorch_model.bin), and its draft vocabulary map read and checked."""
    folder = Path(folder)
    file = next((folder / n for n in _WEIGHT_FILES if (folder / n).is_file()), None)
    where = f"EAGLE-3 checkpoint {str(folder)!r}"
    if file is None:
        raise FileNotFoundError(f"{where} has no {' or '.join(_WEIGHT_FILES)}")
    cfg = parse_config(raw, dialect=dialect, weights_file=file.name, where=f"{where} (config.json)")
    cfg = replace(cfg, has_embed=_check_weights(cfg, _read_tensors(file, shapes_only=True), where))
    if cfg.draft_vocab_size != cfg.vocab_size:
        draft_vocab(cfg, _read_tensors(file, shapes_only=False)["d2t"], where=where)
    return cfg


def draft_vocab(cfg: Eagle3Config, d2t: torch.Tensor, *, where: str) -> torch.Tensor:
    """The target id of each draft token [K] (draft id j is target id j + d2t[j]), checked: in the
    vocabulary and all different."""
    ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
        raise ValueError(f"{where}: d2t maps draft tokens outside the vocabulary 0..{cfg.vocab_size - 1}")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{where}: d2t maps two draft tokens to one target token")
    return ids


def load_eagle3_weights(folder: str | Path, cfg: Eagle3Config) -> dict[str, torch.Tensor]:
    """The checkpoint's weights by speculators name, the unused ones left out (checked by `read_eagle3`)."""
    state = _read_tensors(Path(folder) / cfg.weights_file, shapes_only=False)
    return {k: v for k, v in state.items() if not k.startswith(_UNUSED) and "rotary_emb" not in k}


def check_eagle3(cfg: Eagle3Config, target: Any, *, name: str) -> Eagle3Config:
    """`cfg` fixed for `target` (a verifier, or the model's shape before it loads: `model_name`,
    `num_layers`, `hidden_size`, `vocab_size`), or a one-line ValueError with the offending values."""
    cfg = cfg.for_target(target.num_layers)
    model = target.model_name
    bad = [i for i in cfg.aux_layer_ids or () if not 1 <= i <= target.num_layers]
    if bad:
        raise ValueError(
            f"drafter {name!r} reads aux layers {bad}, but {model!r} has ids 1..{target.num_layers} (the "
            "input of each decoder layer after the first, and the last one's output)"
        )
    if cfg.target_hidden_size != target.hidden_size:
        raise ValueError(
            f"drafter {name!r} reads hidden states of width {cfg.target_hidden_size}, {model!r} has "
            f"{target.hidden_size}: the drafter was built for another model"
        )
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter {name!r} has vocabulary size {cfg.vocab_size}, {model!r} has {target.vocab_size}: the "
            "drafter was built for another model"
        )
    if not cfg.has_embed and cfg.hidden_size != target.hidden_size:
        raise ValueError(
            f"drafter {name!r} ships no embeddings and its width {cfg.hidden_size} is not {model!r}'s "
            f"{target.hidden_size}: it cannot share the verifier's"
        )
    return cfg


def save_eagle3(folder: str | Path, cfg: Eagle3Config, state: Mapping[str, torch.Tensor]) -> Path:
    """Write an EAGLE-3 checkpoint in the speculators dialect: config.json and model.safetensors (`state`
    by speculators names, `d2t` included where the draft vocabulary is not the target's)."""
    import json

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layer = {
        "model_type": "qwen3" if cfg.qk_norm else "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "attention_bias": cfg.attention_bias, "vocab_size": cfg.vocab_size,
    }  # fmt: skip
    method = {"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}
    raw = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size, "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc, "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [method],
                               "verifier": {"name_or_path": cfg.target_model}},
    }  # fmt: skip
    if cfg.aux_layer_ids is not None:
        raw["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw, indent=1))
    return folder
