"""Medusa's registry entry (`registry.KINDS`): heads in vLLM's layout, read by `config.py`, run by
`torch.py` beside the HF verifier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.drafting.kind import DrafterKind
from specdec.drafting.medusa.config import MedusaConfig, check_medusa_fits, read_medusa

__all__ = ["MEDUSA_KIND"]


def _load(plan: Any, *, device: Any, dtype: Any, block_size: int | None, **_: Any) -> Any:
    from specdec.drafting.medusa.torch import MedusaDrafter

    return MedusaDrafter.from_pretrained(
        plan.folder, plan.header, name=plan.name, block_size=block_size, device=device, dtype=dtype
    )


def _describe(c: MedusaConfig) -> dict[str, Any]:
    return {
        "reads": "the verifier's last hidden state (after its final norm); no drafts feed back",
        "target": f"hidden size {c.hidden_size}, vocabulary {c.vocab_size}",
        "heads": f"{c.num_heads} x {c.num_layers} residual layers, "
        + ("one shared LM head" if c.shared_head else "an LM head each")
        + (f", draft vocabulary {c.draft_vocab_size}" if c.draft_vocab_size < c.vocab_size else ""),
        "drafts per step": c.num_heads,
    }


MEDUSA_KIND = DrafterKind(
    name="medusa",
    summary="Medusa heads over the verifier's last hidden state (vLLM's layout)",
    loop="block",
    needs="the last hidden state and final norm of a verifier that hands it (`FinalNorm`: HF, stub)",
    runtimes=("torch",),
    formats=frozenset({("medusa", "")}),
    cuts=False,
    read=lambda folder, raw, fmt: read_medusa(Path(folder), raw),
    fits=lambda cfg, target, name, _folder: check_medusa_fits(cfg, target, name),
    load=_load,
    describe=_describe,
)
