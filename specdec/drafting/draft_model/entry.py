"""The draft model's registry entry (`registry.KINDS`): `--drafter model:<folder|name|id>`, any causal LM
of the verifier's tokenizer on any verifier runtime; a PARD model drafts a block per forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.drafting.draft_model.drafter import (
    MODEL_BLOCK_SIZE,
    check_draft_model,
    check_draft_model_fits,
    load_draft_model,
)
from specdec.drafting.kind import DrafterKind

__all__ = ["MODEL_KIND"]


def _load(
    plan: Any, *, verifier: Any, runtime: str, device: str, dtype: Any, policy: Any, block_size: int | None
) -> Any:
    return load_draft_model(
        plan.spec.base.source,
        verifier=verifier,
        runtime=runtime,
        device=device,
        policy=policy,
        dtype=str(dtype).removeprefix("torch."),
        block_size=block_size or MODEL_BLOCK_SIZE,
    )


def _check(source: str) -> str:
    check_draft_model(source)
    return source  # the header: what follows "model:"


def _fits(source: str, target: Any, name: str, target_folder: Path | None) -> None:
    check_draft_model_fits(source, target, folder=target_folder)


MODEL_KIND = DrafterKind(
    name="model",
    summary="a small causal LM of the verifier's tokenizer, drafting token by token (PARD: a block)",
    loop="model",
    needs="the verifier's tokenizer (compared token by token)",
    runtimes=("torch", "mlx"),
    word="model:",
    takes="a folder, a known name, or stub",
    check=_check,
    fits=_fits,
    load=_load,
)
