"""The DFlash kind's registry entry (`registry.KINDS`): DFlash and DFlash2 checkpoints in the public
format, read by `specdec.drafting.checkpoint`, run by `specdec.drafting.dflash` (torch) and
`specdec.drafting.dflash_mlx` (MLX)."""

from __future__ import annotations

from typing import Any

import torch

from specdec.drafting.checkpoint import DFLASH_FORMATS, check_checkpoint, check_target
from specdec.drafting.dspark import read_dspark
from specdec.drafting.kind import DrafterKind
from specdec.drafting.speculators import read_speculators_dflash

__all__ = ["DFLASH_KIND"]


def _load(
    ckpt: Any, *, runtime: str, device: str | torch.device, dtype: torch.dtype, policy: Any, block_size: Any
) -> Any:
    """The drafter of a `registry.Checkpoint` of this kind, from the config already read: the PyTorch one
    on `device`, or (`runtime` "mlx") the MLX one beside an MLX verifier."""
    if runtime == "mlx":
        from specdec.drafting.dflash_mlx import MLXDFlashDrafter

        name = str(dtype).removeprefix("torch.")
        drafter = MLXDFlashDrafter.from_pretrained(ckpt.folder, dtype=name, policy=policy, config=ckpt.header)
    else:
        from specdec.drafting.dflash import DFlashDrafter

        drafter = DFlashDrafter.from_pretrained(
            ckpt.folder, device=device, dtype=dtype, policy=policy, config=ckpt.header
        )
    drafter.name = ckpt.name
    return drafter


DFLASH_KIND = DrafterKind(
    name="dflash",
    summary="DFlash, DFlash2 and DSpark block drafters (z-lab's public format, vLLM / SGLang; speculators')",
    formats=DFLASH_FORMATS,
    needs="hidden states of the target layers it names, the verifier's embedding and LM head",
    runtimes=("torch", "mlx"),
    trees=True,
    read=lambda folder, raw, fmt: (
        read_speculators_dflash(folder, raw) if fmt.dialect == "speculators"
        else read_dspark(folder, raw) if fmt.kind == "dspark"
        else check_checkpoint(folder)
    ),
    fits=lambda cfg, target, name: check_target(cfg, target, name=name),
    load=_load,
    describe=lambda cfg: {
        "architecture": cfg.architecture, "reads target layers": list(cfg.target_layer_ids),
        "target": f"{cfg.num_target_layers} layers, hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}",
        "block size": cfg.block_size, "draft layers": cfg.num_hidden_layers,
        **({"dspark": cfg.dspark} if cfg.dspark is not None else {}),
    },
)  # fmt: skip
