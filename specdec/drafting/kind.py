"""`DrafterKind`: what a kind of drafter checkpoint is to specdec (its registry entry, `registry.KINDS`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DrafterKind"]


@dataclass(frozen=True)
class DrafterKind:
    """A kind of drafter checkpoint. `read(folder, config, format) -> header` (the config.json dict and the
    `formats.Format` it was identified as); `fits(header, target, name)` raises a one-line
    ValueError where the drafter cannot run against `target` (a verifier, or the shape of its model known
    before it loads: `model_name`, `num_layers`, `hidden_size`, `vocab_size`); `load(checkpoint, *,
    runtime, device, dtype, policy, block_size) -> Drafter`, not bound yet; `describe(header)`: what
    `specdec inspect-drafter` prints of it, one "name: value" pair per line."""

    name: str
    summary: str
    formats: frozenset[tuple[str, str]]  # (`formats.Format.kind`, dialect) pairs it reads
    needs: str  # what it takes from the verifier
    runtimes: tuple[str, ...]  # drafter runtimes it loads in
    trees: bool  # proposes trees (`--tree`)
    read: Callable[[Path], Any]
    fits: Callable[[Any, Any, str], None]
    load: Callable[..., Any]
    describe: Callable[[Any], dict[str, Any]]
