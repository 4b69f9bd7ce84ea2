"""`DrafterKind`: one entry of the registry (`registry.KINDS`), the one table of what a `--drafter` value
can be: a kind named by a word of the grammar (none, prompt-lookup, model:, mtp), or a kind of drafter
checkpoint recognised from its config.json. Each maps to the loop that drafts with it (`LOOPS`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LOOPS", "DrafterKind"]

#: how a kind drafts, whatever its checkpoint's family: no drafts, lookup in the text, a block per forward
#: conditioned on verifier features, a chain of rows over the verifier's hidden states, a chain over the
#: verifier's own K/V, a small LM asked a token at a time (or a block, PARD)
LOOPS = ("none", "lookup", "block", "chain", "assistant", "model")


@dataclass(frozen=True)
class DrafterKind:
    """A kind of drafter.

    `word`: the `--drafter` word that names it ("none", "mtp"; one ending in ":" takes a source, as
    "model:<name>", `takes` saying what), "" for a checkpoint kind, which `formats` names instead ((format
    family, dialect) pairs of `specdec.formats`). Its functions: `check(source) -> header` (a word's kind)
    or `read(folder, config, format) -> header` (a checkpoint's: config.json and the weights' header,
    checked, nothing loaded); `fits(header, target, name, target_folder)`: a one-line ValueError where it
    cannot run against `target` (a verifier, or its model's shape before it loads: `model_name`,
    `num_layers`, `hidden_size`, `vocab_size`; the model's folder where known); `load(plan, *, verifier,
    runtime, device, dtype, policy, block_size)`: the drafter, not bound yet (None: no drafter);
    `describe(header)`: what `specdec inspect-drafter` prints."""

    name: str
    summary: str
    loop: str  # one of LOOPS
    needs: str  # what it takes from the verifier
    runtimes: tuple[str, ...]  # drafter runtimes it loads in
    load: Callable[..., Any]
    word: str = ""
    takes: str = ""
    formats: frozenset[tuple[str, str]] = frozenset()
    trees: bool = False  # proposes trees (`--tree`)
    mixes: bool = True  # "+lookup" may wrap it
    cuts: bool = True  # its drafts can be cut by confidence or verify costs
    check: Callable[[str], Any] | None = None
    read: Callable[[Path, dict[str, Any], Any], Any] | None = None
    fits: Callable[[Any, Any, str, Path | None], None] | None = None
    describe: Callable[[Any], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        assert self.loop in LOOPS, self.loop
        assert bool(self.word) != bool(self.formats), f"{self.name}: a word or checkpoint formats, not both"
