"""The EAGLE-3 kind's registry entry (`registry.KINDS`): checkpoints in the speculators, yuhuili and SGLang
dialects, read by `specdec.drafting.eagle3.config`, run by `specdec.drafting.eagle3.torch` (torch) and
`specdec.drafting.eagle3.mlx` (MLX)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specdec.drafting.eagle3.config import Eagle3Config, check_eagle3, read_eagle3
from specdec.drafting.kind import DrafterKind

__all__ = ["EAGLE3_DIALECTS", "EAGLE3_KIND"]

#: the config dialects read (`formats.identify` names them)
EAGLE3_DIALECTS = ("speculators", "yuhuili", "SGLang", "mlx-vlm")


def _load(
    ckpt: Any,
    *,
    runtime: str,
    device: str | torch.device,
    dtype: torch.dtype,
    policy: Any,
    block_size: Any,
    **_: Any,
) -> Any:
    """The drafter of a `registry.DrafterPlan` of this kind: the PyTorch one on `device`, or (`runtime`
    "mlx") the MLX one beside an MLX verifier; `block_size` None: the checkpoint's drafts per step + 1."""
    parallel = ckpt.header.parallel_mask_token_id is not None
    if runtime == "mlx":
        from specdec.drafting.eagle3.mlx import MLXEagle3Drafter, MLXPEagleDrafter

        name = str(dtype).removeprefix("torch.")
        drafter = (MLXPEagleDrafter if parallel else MLXEagle3Drafter).from_pretrained(
            ckpt.folder, ckpt.header, dtype=name, policy=policy, block_size=block_size
        )
    else:
        from specdec.drafting.eagle3.torch import Eagle3Drafter, PEagleDrafter

        drafter = (PEagleDrafter if parallel else Eagle3Drafter).from_pretrained(
            ckpt.folder, ckpt.header, device=device, dtype=dtype, policy=policy, block_size=block_size
        )
    drafter.name = ckpt.name
    return drafter


def _describe(cfg: Eagle3Config) -> dict[str, Any]:
    aux = list(cfg.aux_layer_ids) if cfg.aux_layer_ids else "[2, N//2, N-3] of a target of N layers"
    norms = [
        f for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if getattr(cfg, f)
    ]
    return {
        "made for": cfg.target_model or "(the config does not name its target)",
        "reads": f"aux hidden states {aux} (the input of those decoder layers: specdec's layers id - 1)",
        "target": f"hidden size {cfg.target_hidden_size}, vocabulary {cfg.vocab_size}",
        "draft layers": f"{cfg.num_layers} x hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads"
        + (", q/k norms" if cfg.qk_norm else ""),
        "draft vocabulary": cfg.draft_vocab_size,
        "embeddings": "its own" if cfg.has_embed else "the verifier's",
        "drafts per step": cfg.block_size - 1,
        "flags": ", ".join(norms) or "none",
        "parallel (P-EAGLE)": "no"
        if cfg.parallel_mask_token_id is None
        else f"mask token {cfg.parallel_mask_token_id}",
        "weights": cfg.weights_file,
    }


EAGLE3_KIND = DrafterKind(
    name="eagle3",
    summary="EAGLE-3 chain drafters (speculators, yuhuili's, SGLang's) and P-EAGLE (speculators)",
    formats=frozenset({*(("eagle3", d) for d in EAGLE3_DIALECTS), ("peagle", "speculators")}),
    needs="three aux hidden states of the target (the input of the layers it names), its embeddings",
    runtimes=("torch", "mlx"),
    trees=True,
    read=lambda folder, raw, fmt: read_eagle3(Path(folder), raw, dialect=fmt.dialect),
    loop="chain",
    fits=lambda cfg, target, name, _folder: check_eagle3(cfg, target, name=name) and None,
    load=_load,
    describe=_describe,
)
