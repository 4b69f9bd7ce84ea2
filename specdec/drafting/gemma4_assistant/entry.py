"""The Gemma-4 assistant kind's registry entry (`registry.KINDS`): checkpoints read by
`config.py`, run by `torch.py` (beside the HF verifier) and `mlx.py` (MLX, beside the MLX verifier)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.drafting.gemma4_assistant.config import AssistantConfig, check_assistant_shape, read_assistant
from specdec.drafting.kind import DrafterKind

__all__ = ["GEMMA4_ASSISTANT_KIND"]


def _load(ckpt: Any, *, runtime: str, device: Any, dtype: Any, policy: Any, block_size: Any, **_: Any) -> Any:
    if runtime == "mlx":
        from specdec.drafting.gemma4_assistant.mlx import MLXAssistantDrafter as cls
    else:
        from specdec.drafting.gemma4_assistant.torch import AssistantDrafter as cls
    drafter = cls.from_pretrained(
        ckpt.folder, ckpt.header, device=device, dtype=dtype, policy=policy, block_size=block_size
    )
    drafter.name = ckpt.name
    return drafter


def _describe(cfg: AssistantConfig) -> dict[str, Any]:
    head = f"centroid-sparse (top {cfg.top_k} of {cfg.num_centroids})" if cfg.ordered else "dense"
    return {
        "made for": f"a Gemma 4 of hidden size {cfg.backbone_hidden_size} (the config does not name it)",
        "reads": "the target's last hidden state and the K/V of its last full and sliding layers",
        "draft layers": f"{len(cfg.layer_types)} x hidden {cfg.hidden_size} ({', '.join(cfg.layer_types)})",
        "sliding window": cfg.sliding_window,
        "head": f"{head} over {cfg.vocab_size}",
        "drafts per step": cfg.block_size - 1,
        "weights": f"{cfg.weights_file} ({cfg.dtype})",
    }


GEMMA4_ASSISTANT_KIND = DrafterKind(
    name="gemma4-assistant",
    summary="Google's Gemma-4 assistant drafters (they attend over the verifier's own K/V)",
    formats=frozenset({("gemma4-assistant", ""), ("gemma4-assistant", "unified")}),
    needs="a Gemma 4 verifier's last hidden state, embeddings, K/V of its last full and sliding layers",
    runtimes=("torch", "mlx"),
    trees=False,
    read=lambda folder, raw, fmt: read_assistant(Path(folder), raw),
    loop="assistant",
    fits=lambda cfg, target, name, _folder: check_assistant_shape(cfg, target, name=name),
    load=_load,
    describe=_describe,
)
