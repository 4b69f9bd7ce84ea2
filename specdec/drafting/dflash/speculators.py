"""DFlash drafters in the speculators container (vLLM's `speculators` library), read as public DFlash.

`speculators_model_type` names the algorithm; specdec reads `eagle3` (`eagle3.config`, one of its dialects)
and `dflash` (here), and names the others in one line (`formats`). A speculators DFlash drafter is the
public DFlash network (the same Qwen3 layers, `fc`, `hidden_norm`, `norm`, context keys / values injected
the same way) with its config in `transformer_layer_config` and three differences this reader maps:
- `aux_hidden_state_layer_ids` count as EAGLE-3's do (the input of decoder layer i: speculators' DFlash
  converter writes z-lab's id + 1), so id i is specdec's target layer i - 1;
- a draft vocabulary (`draft_vocab_size` < the target's) comes with `d2t` and the drafter's own `lm_head`
  over it, kept in the weights; with the full vocabulary the verifier's head is used, as in the public
  format;
- the target's depth is not recorded (its layer count is not checked, its width and vocabulary are).
A block that also drafts from its first position (`sample_from_anchor`, DSpark's default) and causal
sliding-window layers inside the block are refused in one line: the DFlash drafters do neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from specdec.drafting.dflash.config import (
    WEIGHTS_NAME,
    DFlashConfig,
    check_state_dict,
    require_file,
    usable_weights,
)

__all__ = ["read_speculators_dflash"]


def _header(file: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:
        raise ValueError(f"cannot read {str(file)!r} (truncated or not safetensors): {e}") from None


def _draft_vocab(file: Path, K: int, V: int, where: str) -> tuple[int, ...]:
    import torch
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        if "d2t" not in f.keys():  # noqa: SIM118
            raise ValueError(
                f"{where}: draft_vocab_size {K} < the vocabulary {V} but the weights hold no d2t"
            )
        d2t = f.get_tensor("d2t")
    if tuple(d2t.shape) != (K,):
        raise ValueError(f"{where}: d2t is {list(d2t.shape)}, expected [{K}] (one per draft token)")
    ids = torch.arange(K) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != K:
        raise ValueError(f"{where}: d2t maps draft tokens outside 0..{V - 1} or two onto one")
    return tuple(ids.tolist())


def _checked_fields(raw: Mapping[str, Any], where: str) -> tuple[dict[str, Any], list[int], int]:
    """(the layer config, the aux ids, the mask token id) of a speculators DFlash config, or one line."""
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise ValueError(f"{where}: transformer_layer_config must be an object")
    if raw.get("sample_from_anchor"):
        raise ValueError(
            f"{where}: sample_from_anchor drafts from the block's first position too (DSpark-style), which "
            "the DFlash drafters do not"
        )
    if "sliding_attention" in (layer.get("layer_types") or []) and not raw.get("sliding_window_non_causal"):
        raise ValueError(f"{where}: its sliding-window layers are causal inside the block, which is not read")
    aux = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and i >= 1 for i in aux):
        raise ValueError(f"{where}: aux_hidden_state_layer_ids must be a list of ids >= 1, got {aux!r}")
    mask = raw.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise ValueError(f"{where}: mask_token_id must be an integer, got {mask!r}")
    return dict(layer), aux, mask


def read_speculators_dflash(folder: str | Path, raw: Mapping[str, Any]) -> DFlashConfig:
    """The `DFlashConfig` of a speculators DFlash checkpoint folder, its weights' names and shapes checked
    (the header only; `d2t` read where there is a draft vocabulary). One line of ValueError otherwise."""
    folder = Path(folder)
    where = f"speculators DFlash checkpoint {str(folder)!r}"
    layer, aux, mask = _checked_fields(raw, where)
    file = require_file(folder, WEIGHTS_NAME)
    shapes = _header(file)
    V = layer.get("vocab_size")
    K = raw.get("draft_vocab_size", V)
    if not isinstance(V, int) or not isinstance(K, int) or not 0 < K <= V:
        raise ValueError(f"{where}: draft_vocab_size {K!r} must be 1..vocab_size ({V!r})")
    ids = [i - 1 for i in aux]  # the input of layer i is layer i - 1's output
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    block = raw.get("block_size") or (methods[0].get("speculative_tokens") or 0) + 1
    public = {
        **{k: v for k, v in layer.items() if k not in ("architectures", "model_type", "layer_types")},
        "architectures": ["DFlashDraftModel"], "block_size": block, "num_target_layers": max(ids) + 1,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": ids},
    }  # fmt: skip
    if layer.get("layer_types"):
        public["layer_types"] = layer["layer_types"]
    try:
        cfg = DFlashConfig.from_dict(public)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    own_head = "lm_head.weight" in shapes
    if K != V and not own_head:
        raise ValueError(f"{where}: a draft vocabulary of {K} tokens needs its lm_head.weight; there is none")
    vocab = _draft_vocab(file, K, V, where) if K != V else None
    cfg = replace(cfg, draft_vocab=vocab, own_lm_head=own_head, dialect="speculators")
    check_state_dict(cfg, usable_weights(cfg, shapes), source=str(file))
    return cfg
