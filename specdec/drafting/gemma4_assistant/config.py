"""Gemma-4 assistant drafters (`google/gemma-4-*-it-assistant`, transformers' `gemma4_assistant`): the
checkpoint's config and weights header read and checked before anything loads, and their fit to a
Gemma 4 verifier (the kind's registry entry is `gemma4_assistant.entry`). The drafters run in
`gemma4_assistant.torch` (PyTorch, beside the HF verifier) and `gemma4_assistant.mlx` (MLX, beside the MLX
verifier).

What one draft step computes (transformers 5.25's `SinglePositionMultiTokenCandidateGenerator`, Google's
own code path, read as the reference): with P committed positions and the last token t at position P,
x = pre_projection(cat(target_embed(t) (scaled by sqrt(H) as Gemma embeds), h)), h = the target's last
hidden state at position P - 1 after its final norm; the assistant's decoder layers (Gemma 4 text layers,
every one KV-shared: q_proj, q_norm, RoPE at position id P, no keys of their own) attend over the
target's K/V: a full-attention layer over all P positions of the target's last full-attention layer that
computes K/V, a sliding layer over the window + 1 most recent of its last such sliding layer (transformers
builds that layer's mask bidirectional with |q - kv| <= window, flipped to the past); then the
assistant's norm, its head (dense, or centroid-sparse with `use_ordered_embeddings`: the top-k centroids'
tokens only, the rest never drafted), and post_projection gives the h of the next step, which stays at
position id P with the token just drafted. The assistant keeps nothing between steps.

Where transformers' loop hands the assistant more than the committed positions it is not copied: after a
verify with a rejected draft, its K/V still hold the rejected drafts' keys (the sliding layer's at its
end, the full layer's one position past the committed ones), so its next drafts attend over them. Ours
read the committed positions only; they equal transformers' candidates wherever transformers' inputs are
the committed ones (after a prefill, after a fully accepted block).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.drafting.fields import is_int, is_number

__all__ = [
    "ASSISTANT_BLOCK_SIZE",
    "AssistantConfig",
    "LastRow",
    "check_assistant_shape",
    "check_assistant_target",
    "fit_verifier",
    "gemma4_text",
    "kv_shape",
    "kv_source_layers",
    "kv_window",
    "read_assistant",
]  # fmt: skip

#: drafts per step + 1 where --block-size does not say and the checkpoint's generation_config.json names
#: no `num_assistant_tokens`: each draft costs a pass through the assistant's layers
ASSISTANT_BLOCK_SIZE = 5
_TYPES = ("full_attention", "sliding_attention")
#: the verifiers' model types an assistant drafts for (unified: the 12B's family, and its assistant)
GEMMA4_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")


#: transformers' `Gemma4TextConfig` defaults of the fields read here, for configs that leave them out
_TEXT_DEFAULTS = {"head_dim": 256, "num_key_value_heads": 4, "sliding_window": 512}


def gemma4_text(text: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 4 text config with transformers' defaults where it leaves a field read here out (or null),
    and its `layer_types` derived as transformers derives them (five sliding layers to a full one)."""
    out = {**_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    n = out.get("num_hidden_layers")
    if not out.get("layer_types") and isinstance(n, int):
        out["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    return out


def effective_window(text: dict[str, Any]) -> int:
    """The sliding window transformers' `Gemma4TextConfig` runs (it halves a bidirectional model's)."""
    w = int(text.get("sliding_window") or 512)
    return w // 2 + 1 if text.get("use_bidirectional_attention") == "all" else w


def kv_shape(text: dict[str, Any], layer: int) -> tuple[int, int]:
    """(K/V heads, head dim) of layer `layer` of a Gemma 4 text config, in either of its forms: the
    full-attention layers' `global_head_dim` / `num_global_key_value_heads` (with K = V) of released
    configs, or transformers 5's `per_layer_config` overrides."""
    # transformers 5.25 keys them by the index zero-padded to the widest one ("05" of 12 layers)
    over = next((v for k, v in (text.get("per_layer_config") or {}).items() if int(k) == layer), None) or {}
    heads, dim = text["num_key_value_heads"], text["head_dim"]
    if text["layer_types"][layer] == "full_attention":
        if text.get("attention_k_eq_v") and text.get("num_global_key_value_heads"):
            heads = text["num_global_key_value_heads"]
        dim = text.get("global_head_dim") or dim
    return int(over.get("num_key_value_heads") or heads), int(over.get("head_dim") or dim)


def kv_source_layers(text: dict[str, Any]) -> dict[str, int]:
    """Per layer type, the Gemma 4 target layer whose K/V an assistant reads: the last of that type that
    computes its own (transformers' "store" layers: the KV-shared layers after it reuse its K/V)."""
    types = list(text.get("layer_types") or [])
    first_shared = len(types) - int(text.get("num_kv_shared_layers") or 0)
    own = types[:first_shared]
    return {t: max(i for i, u in enumerate(own) if u == t) for t in set(own)}


@dataclass(frozen=True)
class AssistantConfig:
    """A Gemma-4 assistant checkpoint as read from its folder (config.json and the weights' header)."""

    text: dict[str, Any]  # its Gemma 4 text config (all layers KV-shared)
    backbone_hidden_size: int  # the target's hidden size
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    sliding_window: int  # the assistant's (transformers' effective one)
    ordered: bool  # centroid-sparse head (`use_ordered_embeddings`)
    num_centroids: int
    top_k: int  # centroids kept per step
    block_size: int  # drafts per step + 1
    weights_file: str
    dtype: str  # the weights' dtype as stored


def _generation_drafts(folder: Path) -> int | None:
    import json

    try:
        gen = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return None
    n = gen.get("num_assistant_tokens") if isinstance(gen, dict) else None
    return int(n) if isinstance(n, int) and n > 0 else None


def _header(folder: Path, where: str) -> tuple[str, dict[str, tuple[list[int], str]]]:
    """The weights' file names and {tensor: (shape, dtype)} from the safetensors headers only."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{where} has no *.safetensors weights")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():  # noqa: SIM118
                    sl = h.get_slice(k)
                    out[k] = (list(sl.get_shape()), str(sl.get_dtype()))
        except Exception as e:  # safetensors' errors of a truncated or foreign file
            raise ValueError(f"{where}: cannot read {f.name} (truncated or not safetensors): {e}") from None
    return ", ".join(f.name for f in files), out


#: the counts read here: positive integers where the config gives them (top level, its text config); the
#: optional ones may be null
_POSITIVE = ("backbone_hidden_size", "num_centroids", "centroid_intermediate_top_k")
_TEXT_POSITIVE = (
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "intermediate_size",
)
_TEXT_OPTIONAL = ("global_head_dim", "num_global_key_value_heads")


def _check_fields(raw: dict[str, Any], where: str) -> None:
    """The counts read here positive integers and the per-layer parts well formed (`_check_layers`): a
    one-line ValueError naming the field."""
    text = raw["text_config"]
    fields = [(raw, k, "", False) for k in _POSITIVE]
    fields += [(text, k, "text_config.", False) for k in _TEXT_POSITIVE]
    fields += [(text, k, "text_config.", True) for k in _TEXT_OPTIONAL]
    for scope, k, prefix, optional in fields:
        v = scope.get(k)
        if k not in scope or (v is None and optional):
            continue
        if not (is_int(v) and v > 0):
            raise ValueError(f"{where}: config.json's {prefix}{k} must be a positive integer, got {v!r}")
    _check_layers(text, where)


def _transformers_reads(raw: dict[str, Any], where: str) -> None:
    """Where transformers is installed, the config as its config classes type and validate it (what its
    loader would raise later, in its words on one line); after specdec's own checks, which say more."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return
    from transformers import AutoConfig
    from transformers.activations import ACT2FN
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    text = raw["text_config"]
    act = text.get("hidden_activation")
    if act is not None and act not in ACT2FN:
        raise ValueError(
            f"{where}: config.json's text_config.hidden_activation {act!r} is not one transformers has"
        )
    for t, rope in (text.get("rope_parameters") or {}).items():
        kind = rope.get("rope_type", "default")
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"{where}: config.json's text_config.rope_parameters.{t}.rope_type {kind!r} is unknown"
            )

    try:
        AutoConfig.for_model(**raw)
    except Exception as e:  # transformers' strict dataclass checks, in its words
        why = " ".join(str(e).split())[:200]
        raise ValueError(f"{where}: config.json is not one transformers reads: {why}") from None


def _check_layers(text: dict[str, Any], where: str) -> None:
    """The per-layer parts of an assistant's text config: `layer_types` (Gemma 4's two kinds), a
    `rope_parameters` entry per kind (a positive `rope_theta`, a `partial_rotary_factor` in (0, 1]) and
    `per_layer_config` overrides of positive sizes; one-line ValueError naming the field."""
    at = f"{where}: config.json's text_config"
    types = text.get("layer_types")
    if not (isinstance(types, list) and types and all(t in _TYPES for t in types)):
        raise ValueError(f"{at}.layer_types must be a list of {list(_TYPES)}, got {types!r}"[:300])
    rope = text.get("rope_parameters")
    if rope is not None:
        if not (isinstance(rope, dict) and all(isinstance(rope.get(t), dict) for t in set(types))):
            raise ValueError(f"{at}.rope_parameters must hold an object per layer type {sorted(set(types))}")
        for t in set(types):
            entry = rope[t]
            if not is_number(entry.get("rope_theta")):
                raise ValueError(f"{at}.rope_parameters.{t}.rope_theta must be a positive number")
            if "partial_rotary_factor" in entry and not is_number(entry["partial_rotary_factor"], hi=1):
                raise ValueError(f"{at}.rope_parameters.{t}.partial_rotary_factor must be in (0, 1]")
            if not isinstance(entry.get("rope_type", "default"), str):
                raise ValueError(f"{at}.rope_parameters.{t}.rope_type must be a string")
    over = text.get("per_layer_config")
    if over is None:
        return
    if not isinstance(over, dict) or not all(isinstance(v, dict) for v in over.values()):
        raise ValueError(f"{at}.per_layer_config must be an object of objects, got {over!r}"[:300])
    for i, entry in over.items():
        if not (str(i).isdigit() and int(i) < len(types)):
            raise ValueError(f"{at}.per_layer_config names layer {i!r} of {len(types)}")
        for k, v in entry.items():
            if k in _TEXT_POSITIVE and not (is_int(v) and v > 0):
                raise ValueError(f"{at}.per_layer_config.{i}.{k} must be a positive integer, got {v!r}")


def read_assistant(folder: Path, raw: dict[str, Any]) -> AssistantConfig:
    """The assistant in `folder` (config `raw`) checked against its weights' names and shapes: a one-line
    ValueError naming what is missing or wrong, before anything loads."""
    name = folder.name
    if not isinstance(raw.get("text_config"), dict):
        raise ValueError(f"Gemma-4 assistant {name!r}: config.json has no text_config")
    _check_fields(raw, f"Gemma-4 assistant {name!r}")
    text = gemma4_text(raw["text_config"])
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if text.get(k) is None]
    if missing or not raw.get("backbone_hidden_size"):
        raise ValueError(f"Gemma-4 assistant {name!r}: config lacks {missing or ['backbone_hidden_size']}")
    types = tuple(text["layer_types"])
    if set(types) - set(_TYPES) or len(types) != text["num_hidden_layers"]:
        raise ValueError(f"Gemma-4 assistant {name!r}: layer_types {list(types)} are not Gemma 4's")
    shared = text.get("num_kv_shared_layers") or text["num_hidden_layers"]  # transformers: all, if unset
    if (
        shared != text["num_hidden_layers"]
        or text.get("enable_moe_block")
        or text.get("hidden_size_per_layer_input")
    ):
        raise ValueError(
            f"Gemma-4 assistant {name!r}: every layer must be KV-shared, without MoE or per-layer inputs"
        )
    _transformers_reads(raw, f"Gemma-4 assistant {name!r}")
    H, Hb, V = int(text["hidden_size"]), int(raw["backbone_hidden_size"]), int(text["vocab_size"])
    ordered = bool(raw.get("use_ordered_embeddings"))
    C, k = int(raw.get("num_centroids", 2048)), int(raw.get("centroid_intermediate_top_k", 32))
    if ordered and (V % C or not 0 < k <= C):
        raise ValueError(f"Gemma-4 assistant {name!r}: {C} centroids, top {k}, do not split vocabulary {V}")
    want = {"pre_projection.weight": [H, 2 * Hb], "post_projection.weight": [Hb, H],
            "model.embed_tokens.weight": [V, H], "model.norm.weight": [H]}  # fmt: skip
    if ordered:
        want |= {"masked_embedding.centroids.weight": [C, H], "masked_embedding.token_ordering": [V]}
    file, header = _header(folder, f"Gemma-4 assistant {name!r}")
    for key, shape in want.items():
        got = header.get(key, (None,))[0]
        if got != shape:
            say = "lacks" if got is None else f"has {got} for"
            raise ValueError(f"Gemma-4 assistant {name!r}: its weights {say} {key} {shape}")
    n = int(text["num_hidden_layers"])
    if any(f"model.layers.{i}.self_attn.q_proj.weight" not in header for i in range(n)):
        raise ValueError(f"Gemma-4 assistant {name!r}: its weights lack some of its {n} layers")
    heads = int(text["num_attention_heads"])
    for i in range(n):  # each layer's queries: its heads x its head dim (per-layer overrides included)
        key, dim = f"model.layers.{i}.self_attn.q_proj.weight", kv_shape(text, i)[1]
        if header[key][0] != [heads * dim, H]:
            raise ValueError(
                f"Gemma-4 assistant {name!r}: its weights have {header[key][0]} for {key}, its config says "
                f"{[heads * dim, H]} ({heads} heads of {dim})"
            )
    return AssistantConfig(
        text=text,
        backbone_hidden_size=Hb,
        hidden_size=H,
        vocab_size=V,
        layer_types=types,
        sliding_window=effective_window(text),
        ordered=ordered,
        num_centroids=C,
        top_k=k,
        block_size=(_generation_drafts(folder) or ASSISTANT_BLOCK_SIZE - 1) + 1,
        weights_file=file,
        dtype=header["model.norm.weight"][1],
    )


def check_assistant_shape(cfg: AssistantConfig, target: Any, *, name: str) -> None:
    """The fit known before the verifier loads (`models.model_shape` or a verifier): hidden size and
    vocabulary; one-line ValueError."""
    if target.hidden_size != cfg.backbone_hidden_size:
        raise ValueError(
            f"drafter {name!r} is a Gemma-4 assistant for a backbone of hidden size "
            f"{cfg.backbone_hidden_size}; {target.model_name} has {target.hidden_size}"
        )
    if target.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"drafter {name!r} has vocabulary {cfg.vocab_size}; {target.model_name} has {target.vocab_size}"
        )


def check_assistant_target(
    cfg: AssistantConfig, model_type: str, text: dict[str, Any], *, name: str, model_name: str
) -> dict[str, int]:
    """The loaded verifier's text config `text` against the assistant: a Gemma 4 whose K/V source layers
    (`kv_source_layers`) have the kinds, K/V heads and head dims the assistant's layers read. Returns
    {layer type: target layer}; one-line ValueError."""
    if model_type not in GEMMA4_TYPES:
        raise ValueError(f"drafter {name!r} is a Gemma-4 assistant; {model_name} is a {model_type!r} model")
    sources = kv_source_layers(text)
    for t in sorted(set(cfg.layer_types)):
        if t not in sources:
            raise ValueError(
                f"drafter {name!r} reads {t} K/V; {model_name} has no such layer computing its own"
            )
        want, have = kv_shape(cfg.text, cfg.layer_types.index(t)), kv_shape(text, sources[t])
        if want != have:
            raise ValueError(
                f"drafter {name!r}'s {t} layers read K/V of {want} (heads, dim); "
                f"{model_name}'s layer {sources[t]} has {have}"
            )
    return {t: sources[t] for t in set(cfg.layer_types)}


def fit_verifier(cfg: AssistantConfig, verifier: Any, *, name: str, runtime: str) -> dict[str, int]:
    """What binding a drafter of `runtime` ("torch" / "mlx") to `verifier` checks and sets, one line of
    ValueError where it cannot: the verifier of that runtime, handing K/V (`SharedKV`), a Gemma 4 the
    assistant fits; its sliding layers then keep window + 1 positions. {layer type: source layer}."""
    from specdec.protocols import SharedKV

    if verifier.runtime != {"torch": "hf"}.get(runtime, runtime) or not isinstance(verifier, SharedKV):
        raise ValueError(
            f"drafter {name!r} (a Gemma-4 assistant) runs in PyTorch beside the HF verifier and in MLX "
            f"beside the MLX one (--drafter-runtime mlx); not in {runtime} beside the {verifier.runtime} one"
        )
    check_assistant_shape(cfg, verifier, name=name)
    raw = verifier.config if isinstance(verifier.config, dict) else verifier.config.to_dict()
    text = gemma4_text(raw.get("text_config") or raw)
    mtype = text.get("model_type", raw.get("model_type", ""))
    sources = check_assistant_target(cfg, mtype, text, name=name, model_name=verifier.model_name)
    verifier.keep_window(cfg.sliding_window + 1)
    return sources


def kv_window(cfg: AssistantConfig, layer_type: str) -> int | None:
    """How many of the verifier's most recent positions the assistant's layers of `layer_type` read: a
    sliding layer the window + 1, a full one all (None)."""
    return cfg.sliding_window + 1 if layer_type == "sliding_attention" else None


class LastRow:
    """An assistant's context, whatever its runtime: how many positions are committed and the verifier's
    last-layer outputs that came with them, kept as handed (no copy; a verifier never writes them again),
    of which only the last committed position's row is read."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self._chunks: list[tuple[int, Any]] = []  # (first position, outputs [n_i, H])

    def extend(self, features: Any, n: int) -> None:
        if tuple(features.shape) != (n, self.width):
            raise ValueError(f"features must be [{n}, {self.width}], got {list(features.shape)}")
        if n:
            self._chunks.append((self.n, features))
            self.n += n

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.n:
            raise ValueError(f"cannot roll back {n} positions: the drafter holds {self.n}")
        self.n -= n
        while self._chunks and self._chunks[-1][0] >= self.n:
            self._chunks.pop()

    def last(self) -> Any:
        """The row [1, H] of the last committed position."""
        start, rows = self._chunks[-1]
        return rows[self.n - 1 - start : self.n - start]
