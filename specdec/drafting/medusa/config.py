"""A Medusa checkpoint in vLLM's layout (what its `Medusa` model loads, and what converters for it write):
config.json with `model_type` medusa, `num_heads`, `num_hidden_layers` (residual layers per head),
`hidden_size`, `vocab_size`, optionally `truncated_vocab_size` (a draft vocabulary, mapped to the
target's ids by a `token_map` tensor), `medusa_fc_bias`, `logit_scale` and `original_lm_head` (one LM
head shared by every head); weights in safetensors, `blocks.{i}.layers.{j}.weight` [H, H] (+ `.bias`),
`lm_heads.{i}.weight` [K, H], optionally under `medusa_heads.`. Head i computes
`x <- x + silu(W_ij x + b_ij)` for each of its layers j from the verifier's last hidden state after its
final norm, then its LM head. FasterDecoding's own layout (`medusa_num_heads`, `medusa_lm_head.pt`, a
pickle) is named and refused: it is not loaded without running code from the file."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.drafting.fields import is_flag, is_int, is_number

__all__ = ["MedusaConfig", "check_medusa_fits", "read_medusa"]


@dataclass(frozen=True)
class MedusaConfig:
    """A Medusa checkpoint as read: its shapes, and the weights' names as stored (`names`)."""

    num_heads: int
    num_layers: int  # residual layers per head
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int  # < vocab_size: a `token_map` maps its ids to the target's
    fc_bias: bool
    logit_scale: float
    shared_head: bool
    weights_file: str
    prefix: str  # "" or "medusa_heads."

    @property
    def block_size(self) -> int:
        """The verified block: the bonus token and one draft per head."""
        return self.num_heads + 1

    def names(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold -> its shape."""
        H, K, p = self.hidden_size, self.draft_vocab_size, self.prefix
        out: dict[str, tuple[int, ...]] = {}
        for i in range(self.num_heads):
            for j in range(self.num_layers):
                out[f"{p}blocks.{i}.layers.{j}.weight"] = (H, H)
                if self.fc_bias:
                    out[f"{p}blocks.{i}.layers.{j}.bias"] = (H,)
            if i == 0 or not self.shared_head:
                out[f"{p}lm_heads.{i}.weight"] = (K, H)
        if self.vocab_size > K:
            out[f"{p}token_map"] = (K,)
        return out


def _weights_file(folder: Path, name: str) -> Path:
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(
            f"drafter {name!r}: a Medusa checkpoint holds one .safetensors file; found "
            f"{[f.name for f in files]}"
        )
    return files[0]


def read_medusa(folder: Path, raw: Mapping[str, Any], *, name: str | None = None) -> MedusaConfig:
    """The checkpoint in `folder` (config `raw`), its config and weights' header checked (names, shapes);
    one-line ValueError naming what is wrong. No weights load."""
    from safetensors import safe_open

    name = name or str(folder)
    if "medusa_num_heads" in raw:
        raise ValueError(
            f"drafter {name!r} holds Medusa heads in FasterDecoding's layout (medusa_num_heads, a pickled "
            "medusa_lm_head.pt); specdec reads vLLM's layout (model_type medusa, blocks.* / lm_heads.* in "
            "safetensors)"
        )
    ints = ("num_heads", "num_hidden_layers", "hidden_size", "vocab_size")
    bad = [k for k in ints if not (is_int(raw.get(k)) and raw[k] > 0)]
    K = raw.get("truncated_vocab_size") or raw.get("vocab_size")
    bad += [] if is_int(K) and 0 < K <= (raw.get("vocab_size") or 0) else ["truncated_vocab_size"]
    bad += [k for k in ("medusa_fc_bias", "original_lm_head") if k in raw and not is_flag(raw[k])]
    bad += [] if is_number(raw.get("logit_scale", 1.0)) else ["logit_scale"]
    if bad:
        raise ValueError(
            f"drafter {name!r}: config.json has no valid {', '.join(bad)} for a Medusa checkpoint"
        )
    path = _weights_file(folder, name)
    with safe_open(path, framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    prefix = "medusa_heads." if any(k.startswith("medusa_heads.") for k in shapes) else ""
    cfg = MedusaConfig(
        num_heads=raw["num_heads"],
        num_layers=raw["num_hidden_layers"],
        hidden_size=raw["hidden_size"],
        vocab_size=raw["vocab_size"],
        draft_vocab_size=K,
        fc_bias=bool(raw.get("medusa_fc_bias", False)),
        logit_scale=float(raw.get("logit_scale", 1.0)),
        shared_head=bool(raw.get("original_lm_head", False)),
        weights_file=path.name,
        prefix=prefix,
    )
    for key, shape in cfg.names().items():
        if key not in shapes:
            raise ValueError(f"drafter {name!r}: {path.name} has no {key!r}")
        if shapes[key] != shape:
            raise ValueError(
                f"drafter {name!r}: {key} is {list(shapes[key])} in {path.name}, not {list(shape)}"
            )
    return cfg


def check_medusa_fits(cfg: MedusaConfig, target: Any, name: str) -> None:
    """A one-line ValueError where the heads cannot read `target`'s hidden states or write its ids."""
    want, got = (cfg.hidden_size, cfg.vocab_size), (target.hidden_size, target.vocab_size)
    if want != got:
        raise ValueError(
            f"drafter {name!r}: Medusa heads for hidden size {want[0]} and vocabulary {want[1]}; "
            f"{target.model_name!r} has {got[0]} and {got[1]}"
        )
