"""Prompt lookup's registry entry (`registry.KINDS`): `--drafter prompt-lookup`, no weights, any verifier.
(Corpus n-grams are not a kind of their own: they draft behind "+lookup", `mix.LookupFirstDrafter`.)"""

from __future__ import annotations

from typing import Any

from specdec.drafting.kind import DrafterKind
from specdec.drafting.lookup.prompt import LOOKUP_BLOCK_SIZE, PromptLookupDrafter

__all__ = ["PROMPT_LOOKUP_KIND"]


def _load(plan: Any, *, block_size: int | None, **_: Any) -> PromptLookupDrafter:
    return PromptLookupDrafter(block_size=block_size or LOOKUP_BLOCK_SIZE)


PROMPT_LOOKUP_KIND = DrafterKind(
    name="prompt-lookup",
    summary="what followed the last match of the recent tokens in the text so far",
    loop="lookup",
    needs="the tokens so far",
    runtimes=("torch", "mlx"),
    word="prompt-lookup",
    mixes=False,
    cuts=False,
    load=_load,
)
