"""The DFlash kind's registry entry (`registry.KINDS`): DFlash and DFlash2 checkpoints in the public
format, read by `specdec.drafting.dflash.config`, run by `specdec.drafting.dflash.torch` (torch) and
`specdec.drafting.dflash.mlx` (MLX)."""

from __future__ import annotations

from typing import Any

import torch

from specdec.drafting.dflash.config import DFLASH_FORMATS, check_checkpoint, check_target
from specdec.drafting.dflash.dspark import read_dspark
from specdec.drafting.dflash.speculators import read_speculators_dflash
from specdec.drafting.kind import DrafterKind

__all__ = ["DFLASH_KIND", "READERS"]

#: (format family, dialect) -> its reader: the variants of the one backbone are data, not branches
READERS = {
    ("dflash", "public"): lambda folder, raw: check_checkpoint(folder),
    ("dflash2", "public"): lambda folder, raw: check_checkpoint(folder),
    ("dspark", "public"): read_dspark,
    ("dflash", "speculators"): read_speculators_dflash,
}
assert frozenset(READERS) == DFLASH_FORMATS, "every format the checkpoint's checks accept has its reader"


def _load(
    ckpt: Any, *, runtime: str, device: str | torch.device, dtype: torch.dtype, policy: Any, **_: Any
) -> Any:
    """The drafter of a `registry.DrafterPlan` of this kind, from the config already read: the PyTorch one
    on `device`, or (`runtime` "mlx") the MLX one beside an MLX verifier."""
    if runtime == "mlx":
        from specdec.drafting.dflash.mlx import MLXDFlashDrafter

        name = str(dtype).removeprefix("torch.")
        drafter = MLXDFlashDrafter.from_pretrained(ckpt.folder, dtype=name, policy=policy, config=ckpt.header)
    else:
        from specdec.drafting.dflash.torch import DFlashDrafter

        drafter = DFlashDrafter.from_pretrained(
            ckpt.folder, device=device, dtype=dtype, policy=policy, config=ckpt.header
        )
    drafter.name = ckpt.name
    return drafter


DFLASH_KIND = DrafterKind(
    name="dflash",
    summary="DFlash, DFlash2 and DSpark block drafters (z-lab's public format, vLLM / SGLang; speculators')",
    formats=frozenset(READERS),
    needs="hidden states of the target layers it names, the verifier's embedding and LM head",
    runtimes=("torch", "mlx"),
    trees=True,
    loop="block",
    read=lambda folder, raw, fmt: READERS[fmt.family, fmt.dialect](folder, raw),
    fits=lambda cfg, target, name, _folder: check_target(cfg, target, name=name),
    load=_load,
    describe=lambda cfg: {
        "architecture": cfg.architecture,
        "reads target layers": list(cfg.target_layer_ids),
        "target": f"{cfg.num_target_layers} layers, hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}",
        "block size": cfg.block_size,
        "draft layers": cfg.num_hidden_layers,
        **({"dspark": cfg.dspark} if cfg.dspark is not None else {}),
    },
)
