"""DFlash drafter checkpoints in the public format (z-lab hub drafters, vLLM `dflash`, SGLang `DFLASH`).

A checkpoint is a folder with `config.json` and `model.safetensors`. The config is a Qwen3 config plus
`architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers` and
`dflash_config: {mask_token_id, target_layer_ids}`; the weights use the names of `public_param_shapes`.
DFlash2 (`architectures: ["DFlash2DraftModel"]`) adds to `dflash_config` the fields of `DFlash2Config`
and to the weights a grouped dynamic causal convolution around each layer's attention and MLP and the
candidate selector (its two codebooks stored as bare tensors).
`load_config` / `load_state_dict` read that format and `save_checkpoint` writes exactly it, so a drafter
trained here serves on vLLM / SGLang and a hub drafter loads here. Keys we do not use are kept in
`DFlashConfig.extra` and written back unchanged. Only torch, safetensors and `specdec.kernels` (the verify
size limit) are imported.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.drafting.fields import dflash_problems, first_given
from specdec.drafting.rope import rope_scaling
from specdec.kernels import MAX_VERIFY_TOKENS

#: (format kind, dialect): the public format, DFlash in the speculators container (`speculators.py`) and
#: DSpark (`dspark.py`: DFlash with a Markov head)
DFLASH_FORMATS = frozenset(
    {("dflash", "public"), ("dflash2", "public"), ("dflash", "speculators"), ("dspark", "public")}
)
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE2 = "DFlash2DraftModel"
FULL, SLIDING = "full_attention", "sliding_attention"

# config.json keys that DFlashConfig owns (everything else goes to `extra` and is written back as read)
_OWNED = {
    "architectures", "model_type", "block_size", "num_target_layers", "dflash_config", "hidden_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings", "vocab_size",
    "layer_types", "sliding_window", "attention_bias", "is_causal", "hidden_act", "tie_word_embeddings",
    "dtype", "torch_dtype",  # describes the stored weights: written from them on save
}  # fmt: skip
_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "num_target_layers",
)


def _dflash2_config(raw: dict[str, Any], dflash: dict[str, Any]) -> DFlash2Config:
    """The DFlash2 fields of a config (`dflash_config` first, then the top level, as the reference reads
    them); ValueError naming the missing ones."""

    def get(k: str) -> Any:
        return dflash.get(k, raw.get(k))

    missing = [f"dflash_config.{k}" for k in DFlash2Config.FIELDS if get(k) is None]
    if missing:
        raise ValueError(f"DFlash2 config is missing {missing}")
    cap = get("final_logit_softcapping")
    return DFlash2Config(
        **{k: int(get(k)) for k in DFlash2Config.FIELDS},
        output_multiplier=float(get("output_multiplier") or 1.0),
        final_logit_softcapping=None if cap is None or float(cap) <= 0 else float(cap),
        input_embedding_scale=float(get("input_embedding_scale") or 1.0),
    )


def _dflash2_fields(d2: DFlash2Config) -> dict[str, Any]:
    out = {k: getattr(d2, k) for k in (*DFlash2Config.FIELDS, "output_multiplier")}
    if d2.final_logit_softcapping is not None:
        out["final_logit_softcapping"] = d2.final_logit_softcapping
    if d2.input_embedding_scale != 1.0:
        out["input_embedding_scale"] = d2.input_embedding_scale
    return out


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The public default: one target layer per draft layer, evenly spaced from 1 to L-3 (L//2 for one)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    # Python's round (half to even) as in the public implementations, so the ids agree with theirs exactly
    return tuple(round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True, kw_only=True)
class DFlash2Config:
    """What DFlash2 adds (`dflash_config` fields): around each layer's attention and MLP a causal
    convolution over the block whose taps are a base kernel plus a kernel projected from the sublayer's
    normed input per group of channels; the read-out scaled and soft-capped; a candidate selector that
    walks the top-k candidates of each position scored with a low-rank predecessor x successor term."""

    conv_kernel_size: int  # taps, looking back within the block
    conv_group_size: int  # channels sharing one dynamic tap
    selector_rank: int
    selector_top_k: int
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None or <= 0: none
    input_embedding_scale: float = 1.0

    FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    OPTIONAL = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")


@dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    """Everything that shapes a DFlash drafter. `target_layer_ids` None means the public default."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int  # layers of the target model the drafter was built for
    mask_token_id: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    # RoPE scaling as transformers reads it ({"rope_type": "linear" | "yarn", "factor": ..., ...}); None:
    # plain RoPE. Qwen3.6 drafters use YaRN (z-lab/dflash "Fix Qwen3.6 Rope")
    rope_scaling: dict[str, Any] | None = None
    layer_types: tuple[str, ...] | None = None  # None: all full attention
    sliding_window: int | None = None
    attention_bias: bool = False
    is_causal: bool = False  # causal inside the block; public DFlash drafters are non-causal
    # the K vocabulary ids the drafter reads out (dflash_config.draft_vocab); None: all V. A shortlist of
    # the ids the target really writes makes the read-out V/K times cheaper to train and to run, and
    # cannot cost exactness (the verifier decides every token). Kept in config.json, not in the weights,
    # so model.safetensors stays exactly the public format.
    draft_vocab: tuple[int, ...] | None = None
    dflash2: DFlash2Config | None = None  # None: a DFlash drafter
    # a speculators checkpoint (`speculators.py`): its own LM head over the draft vocabulary; the target's
    # depth unrecorded (num_target_layers is then only the deepest layer read + 1, not compared)
    own_lm_head: bool = False
    dialect: str = "public"
    dspark: Any = None  # `dspark.DSparkParams` of a DSpark drafter
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # unused config.json keys, kept

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once here so every reader sees complete values
        if self.head_dim is None:
            set_(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.target_layer_ids is None:
            set_(
                self,
                "target_layer_ids",
                default_target_layer_ids(self.num_target_layers, self.num_hidden_layers),
            )
        set_(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.layer_types is None:
            set_(self, "layer_types", (FULL,) * self.num_hidden_layers)
        set_(self, "layer_types", tuple(self.layer_types))
        if self.draft_vocab is not None:
            set_(self, "draft_vocab", tuple(int(i) for i in self.draft_vocab))
        self._validate()

    def _validate(self) -> None:
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 2 <= self.block_size <= MAX_VERIFY_TOKENS:
            problems.append(
                f"block_size {self.block_size} is not 2..{MAX_VERIFY_TOKENS} (one verify holds the block: at "
                f"most {MAX_VERIFY_TOKENS} tokens)"
            )
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            problems.append(
                f"target_layer_ids {bad} outside 0..{self.num_target_layers - 1} (num_target_layers)"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
        if unknown:
            problems.append(f"layer_types {unknown} unknown (expected {FULL!r} or {SLIDING!r})")
        if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            problems.append(
                f"sliding_attention layers need a positive sliding_window, got {self.sliding_window}"
            )
        if self.mask_token_id < 0:
            problems.append(f"mask_token_id {self.mask_token_id} is negative")
        if self.draft_vocab is not None:
            ids = self.draft_vocab
            if not ids:
                problems.append("draft_vocab is empty")
            elif not all(0 <= i < self.vocab_size for i in ids):
                problems.append(f"draft_vocab ids must lie in 0..{self.vocab_size - 1}")
            elif len(set(ids)) != len(ids):
                problems.append("draft_vocab has repeated ids")
        if self.dflash2 is not None:
            problems += self._dflash2_problems()
        if problems:
            raise ValueError("invalid DFlash config: " + "; ".join(problems))

    def _dflash2_problems(self) -> list[str]:
        d2, out = self.dflash2, []
        if min(d2.conv_kernel_size, d2.conv_group_size, d2.selector_rank, d2.selector_top_k) < 1:
            out.append(f"DFlash2 sizes must be >= 1: {d2}")
        elif self.hidden_size % d2.conv_group_size:
            out.append(f"conv_group_size {d2.conv_group_size} does not divide hidden_size {self.hidden_size}")
        if d2.selector_top_k > self.vocab_size:
            out.append(f"selector_top_k {d2.selector_top_k} exceeds the vocabulary ({self.vocab_size})")
        if self.draft_vocab is not None:
            out.append("a draft vocabulary is not supported for DFlash2 (its selector reads the full one)")
        return out

    @property
    def architecture(self) -> str:
        """The config's `architectures` entry: DFlash or DFlash2."""
        return ARCHITECTURE if self.dflash2 is None else ARCHITECTURE2

    @property
    def num_target_features(self) -> int:
        """K: how many target layers are concatenated per position."""
        return len(self.target_layer_ids)

    @property
    def feature_dim(self) -> int:
        """K*H: width of one position's target features."""
        return self.num_target_features * self.hidden_size

    @property
    def mask_column(self) -> int | None:
        """The logit column of the mask token in the drafter's read-out (never proposed): its id, or its
        index in the draft vocabulary; None when the draft vocabulary lacks it."""
        if self.draft_vocab is None:
            return self.mask_token_id
        vocab = list(self.draft_vocab)
        return vocab.index(self.mask_token_id) if self.mask_token_id in vocab else None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, num_target_features: int | None = None) -> DFlashConfig:
        """Parse a public-format config dict. `num_target_features` (K, e.g. from `fc.weight`) picks the
        default layer ids when the config names none; without it the public default K = draft layers."""
        problems = dflash_problems(raw, required=_REQUIRED, dflash2=DFlash2Config.FIELDS)
        if problems:
            raise ValueError("invalid DFlash config: " + "; ".join(problems))
        missing = [k for k in _REQUIRED if k not in raw]
        dflash = dict(raw.get("dflash_config") or {})
        mask_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask_id is None:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise ValueError(f"DFlash config is missing {missing}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"hidden_act {raw['hidden_act']!r} is not supported (DFlash drafters use 'silu')"
            )
        arch = raw.get("architectures")
        if arch is not None and ARCHITECTURE not in arch and ARCHITECTURE2 not in arch:
            raise ValueError(
                f"config architectures {arch} include neither {ARCHITECTURE!r} nor {ARCHITECTURE2!r}: not a "
                "DFlash drafter"
            )
        dflash2 = _dflash2_config(raw, dflash) if arch is not None and ARCHITECTURE2 in arch else None
        rope = raw.get("rope_parameters") or {}
        try:
            scaling = rope_scaling(raw.get("rope_scaling") or rope)
        except ValueError as e:
            raise ValueError(f"invalid DFlash config: {e}") from None
        ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        if ids is None and num_target_features is not None:
            ids = default_target_layer_ids(int(raw["num_target_layers"]), num_target_features)
        theta = first_given(raw.get("rope_theta"), rope.get("rope_theta"), 1_000_000.0)
        if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
            raise ValueError(f"invalid DFlash config: rope_theta must be a positive number, got {theta!r}")
        extra = {k: v for k, v in raw.items() if k not in _OWNED}
        extra_dflash = {
            k: v
            for k, v in dflash.items()
            if k not in ("mask_token_id", "target_layer_ids", "block_size", "draft_vocab")
            and not (dflash2 and k in DFlash2Config.FIELDS + DFlash2Config.OPTIONAL)
        }
        if extra_dflash:
            extra["dflash_config"] = extra_dflash
        return cls(
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw["num_key_value_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            num_target_layers=int(raw["num_target_layers"]),
            mask_token_id=int(mask_id),
            head_dim=raw.get("head_dim"),
            block_size=int(first_given(raw.get("block_size"), dflash.get("block_size"), 16)),
            target_layer_ids=None if ids is None else tuple(ids),
            rms_norm_eps=float(first_given(raw.get("rms_norm_eps"), 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(first_given(raw.get("max_position_embeddings"), 40960)),
            layer_types=None if raw.get("layer_types") is None else tuple(raw["layer_types"]),
            sliding_window=raw.get("sliding_window"),
            attention_bias=bool(raw.get("attention_bias")),
            is_causal=bool(raw.get("is_causal")),
            draft_vocab=dflash.get("draft_vocab"),
            dflash2=dflash2,
            extra=extra,
        )

    def to_dict(self) -> dict[str, Any]:
        """The public config.json contents (both rope_theta spellings, for transformers 4 and 5 readers)."""
        out = dict(self.extra)
        extra_dflash = dict(out.pop("dflash_config", {}))
        out.update(
            architectures=[self.architecture],
            model_type="qwen3",
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={
                **extra_dflash,
                "block_size": self.block_size,  # newer readers look here first, older ones at the top level
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                **({} if self.draft_vocab is None else {"draft_vocab": list(self.draft_vocab)}),
                **({} if self.dflash2 is None else _dflash2_fields(self.dflash2)),
            },
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_parameters={
                "rope_theta": self.rope_theta,
                **(self.rope_scaling or {"rope_type": "default"}),
            },
            rope_scaling=None if self.rope_scaling is None else dict(self.rope_scaling),  # public: null
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window,
            attention_bias=self.attention_bias,
            is_causal=self.is_causal,
        )
        out.update(hidden_act="silu", tie_word_embeddings=False)  # no embedding of its own to tie
        return dict(sorted(out.items()))


def public_param_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every public parameter name of a drafter with config `cfg`, with its shape."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (nq, H),
                p + "self_attn.k_proj.weight": (nkv, H),
                p + "self_attn.v_proj.weight": (nkv, H),
                p + "self_attn.o_proj.weight": (H, nq),
                p + "self_attn.q_norm.weight": (D,),
                p + "self_attn.k_norm.weight": (D,),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
            }
        )
        if cfg.attention_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (nq,),
                    p + "self_attn.k_proj.bias": (nkv,),
                    p + "self_attn.v_proj.bias": (nkv,),
                    p + "self_attn.o_proj.bias": (H,),
                }
            )
    shapes.update({"fc.weight": (H, cfg.feature_dim), "hidden_norm.weight": (H,), "norm.weight": (H,)})
    if cfg.own_lm_head:
        shapes["lm_head.weight"] = (len(cfg.draft_vocab or ()) or cfg.vocab_size, H)
    if cfg.dspark is not None:  # `dspark.DSparkParams`: its heads
        shapes |= cfg.dspark.param_shapes(cfg)
    d2 = cfg.dflash2
    if d2 is not None:
        taps, dyn = d2.conv_kernel_size, 2 * d2.conv_kernel_size * (H // d2.conv_group_size)
        for i in range(cfg.num_hidden_layers):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, taps, H)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (dyn, H)
        R, V = d2.selector_rank, cfg.vocab_size
        shapes.update(
            {
                "candidate_selector.hidden_projection.weight": (R, H),
                "candidate_selector.predecessor_codebook": (V, R),
                "candidate_selector.successor_codebook": (V, R),
            }
        )
    return shapes


def require_file(path: Path, name: str) -> Path:
    """`path / name`, or FileNotFoundError naming what is missing."""
    if not path.is_dir():
        raise FileNotFoundError(f"DFlash checkpoint folder {str(path)!r} does not exist or is not a folder")
    f = path / name
    if not f.is_file():
        present = sorted(p.name for p in path.iterdir())
        raise FileNotFoundError(f"DFlash checkpoint {str(path)!r} has no {name} (found: {present})")
    return f


def _fc_num_features(weights: Path, hidden_size: int) -> int | None:
    """K from the shape of `fc.weight` [H, K*H], read from the safetensors header only."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        if "fc.weight" not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
            return None
        width = f.get_slice("fc.weight").get_shape()[1]
    return width // hidden_size if width % hidden_size == 0 else None


def load_config(path: str | Path) -> DFlashConfig:
    """Read `config.json` of a public-format checkpoint folder."""
    path = Path(path)
    file = require_file(path, CONFIG_NAME)
    try:
        raw = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(file)!r} is not a JSON config: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{str(file)!r} is not a JSON config: a {type(raw).__name__}, not an object")
    from specdec.formats import refuse_as_drafter

    refuse_as_drafter(path, raw, name=str(path), readable=DFLASH_FORMATS)  # another format is named
    problems = dflash_problems(raw, required=_REQUIRED, dflash2=DFlash2Config.FIELDS)
    if problems:
        raise ValueError(f"invalid DFlash config {str(file)!r}: " + "; ".join(problems))
    k = None
    ids = (raw.get("dflash_config") or {}).get("target_layer_ids", raw.get("target_layer_ids"))
    if ids is None and (path / WEIGHTS_NAME).is_file() and "hidden_size" in raw:
        k = _fc_num_features(path / WEIGHTS_NAME, int(raw["hidden_size"]))  # K as trained, not a guess
    return DFlashConfig.from_dict(raw, num_target_features=k)


def check_state_dict(
    cfg: DFlashConfig, state: Mapping[str, torch.Tensor | tuple[int, ...]], *, source: str = "state dict"
) -> None:
    """Raise ValueError naming missing / unexpected parameters and shape mismatches against `cfg` (`state`:
    tensors, or their shapes)."""
    want = public_param_shapes(cfg)
    have = {k: tuple(v if isinstance(v, tuple) else v.shape) for k, v in state.items()}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    wrong = [
        f"{k}: {have[k]} (expected {want[k]})" for k in sorted(set(want) & set(have)) if have[k] != want[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(
            f"unexpected {len(unexpected)} weights: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    if wrong:
        problems.append(f"shape mismatch: {wrong[:8]}")
    if problems:
        raise ValueError(f"{source} does not match the DFlash config: " + "; ".join(problems))


def load_state_dict(path: str | Path, cfg: DFlashConfig | None = None) -> dict[str, torch.Tensor]:
    """Read `model.safetensors` (CPU tensors, stored dtype) and check it against the config."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = cfg or load_config(path)
    weights = require_file(path, WEIGHTS_NAME)
    try:
        state = load_file(str(weights))
    except Exception as e:  # safetensors' SafetensorError: truncated or not a safetensors file
        raise ValueError(f"cannot read {str(weights)!r} (truncated or not safetensors): {e}") from None
    state = usable_weights(cfg, state)
    check_state_dict(cfg, state, source=str(weights))
    return state


def usable_weights(cfg: DFlashConfig, state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` without what a speculators checkpoint keeps for training (`d2t`, `t2d`, `verifier_*`)."""
    if cfg.dspark is not None:
        return {k.removeprefix("model."): v for k, v in state.items()}
    if cfg.dialect != "speculators":
        return dict(state)
    drop = ("verifier_", "t2d", "d2t", "embed_tokens.")
    return {k: v for k, v in state.items() if not k.startswith(drop)}


def check_target(cfg: DFlashConfig, target: Any, *, name: str) -> None:
    """ValueError, with the offending values, where the DFlash drafter `name` of config `cfg` cannot run
    against `target`: a verifier, or anything with its `model_name`, `num_layers`, `hidden_size` and
    `vocab_size` (e.g. read from the model's config.json before it loads)."""
    from types import SimpleNamespace

    from specdec.protocols import check_compatible

    ids, fdim = cfg.target_layer_ids, cfg.feature_dim
    check_compatible(
        target, SimpleNamespace(name=name, target_layer_ids=ids, feature_dim=fdim, vocab_size=cfg.vocab_size)
    )
    if cfg.dialect == "public" and cfg.num_target_layers != target.num_layers:
        raise ValueError(
            f"drafter {name!r} was built for a target with {cfg.num_target_layers} layers, the verifier "
            f"{target.model_name!r} has {target.num_layers}: the drafter was built for another model"
        )
    if cfg.mask_token_id >= target.vocab_size:
        raise ValueError(
            f"drafter {name!r} uses mask_token_id {cfg.mask_token_id}, outside the vocabulary "
            f"(0..{target.vocab_size - 1}) of {target.model_name!r}: the drafter was built for another model"
        )


def check_checkpoint(path: str | Path) -> DFlashConfig:
    """Check a public-format checkpoint folder without loading its weights: the config, and the names and
    shapes in the safetensors header (a truncated file fails here too); its config."""
    from safetensors import safe_open

    cfg = load_config(path)
    weights = require_file(Path(path), WEIGHTS_NAME)
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors' SafetensorError: truncated or not a safetensors file
        raise ValueError(f"cannot read {str(weights)!r} (truncated or not safetensors): {e}") from None
    check_state_dict(cfg, shapes, source=str(weights))
    return cfg


def load_checkpoint(path: str | Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """Config and checked weights of a public-format checkpoint folder."""
    cfg = load_config(path)
    return cfg, load_state_dict(path, cfg)


def save_checkpoint(path: str | Path, cfg: DFlashConfig, state: Mapping[str, torch.Tensor]) -> Path:
    """Write `config.json` + `model.safetensors` in the public format (weights checked first)."""
    from safetensors.torch import save_file

    check_state_dict(cfg, state)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    raw = cfg.to_dict()
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) == 1:
        raw["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    text = json.dumps(dict(sorted(raw.items())), indent=2)
    if cfg.draft_vocab is not None:  # thousands of ids: one line, not one line each
        one_per_line = json.dumps(list(cfg.draft_vocab), indent=2).replace("\n", "\n    ")
        text = text.replace(one_per_line, json.dumps(list(cfg.draft_vocab)), 1)
    (path / CONFIG_NAME).write_text(text + "\n")
    return path
