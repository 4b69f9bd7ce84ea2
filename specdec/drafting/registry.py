"""The drafter kinds specdec reads from checkpoint folders, and the one reading of a folder per run.

A kind is one `DrafterKind` entry: which checkpoint formats it reads (`specdec.drafting.formats`
recognises them from config.json), what it needs from a verifier, the drafter runtimes it loads in, and
three functions: `read` (the folder's config and weights header, checked, before anything loads), `fits`
(that header against the verifier's model, before or after it loads) and `load` (the drafter, from the
header already read). `read_checkpoint` identifies a folder and reads it once; `load` reuses that.

Adding a kind: a module with its drafter(s) and its entry, the entry in `KINDS`, and its tests
(`docs/architecture.md`, "Adding a drafter kind").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.drafting import formats
from specdec.drafting.dflash_kind import DFLASH_KIND
from specdec.drafting.formats import refuse_as_drafter
from specdec.drafting.kind import DrafterKind
from specdec.drafting.spec import DrafterSpec

__all__ = [
    "KINDS",
    "READABLE",
    "Checkpoint",
    "DrafterKind",
    "kind_for",
    "kinds_help",
    "read_checkpoint",
    "refuse_as_model",
]


#: every kind specdec reads, in the order `specdec --help` lists them
KINDS: tuple[DrafterKind, ...] = (DFLASH_KIND,)
#: the checkpoint formats (`formats.Format.kind`, public dialect) some kind reads
READABLE = frozenset().union(*(k.formats for k in KINDS))


def kind_for(format_kind: str) -> DrafterKind | None:
    """The kind that reads checkpoints of `formats.Format.kind` `format_kind`, or None."""
    return next((k for k in KINDS if format_kind in k.formats), None)


@dataclass(frozen=True)
class Checkpoint:
    """A drafter checkpoint as read once per run: the spec that named it, its folder, its kind and the
    header `kind.read` returned (for DFlash: the `DFlashConfig`, checked against the weights' header)."""

    spec: DrafterSpec
    folder: Path
    kind: DrafterKind
    header: Any

    @property
    def name(self) -> str:
        return self.spec.drafter_name(self.folder)


def read_checkpoint(spec: str | DrafterSpec) -> Checkpoint:
    """Find and read the checkpoint a spec names (bundled, local, or fetched from the hub into its cache):
    its format from config.json (another format is named, `formats.refuse_as_drafter`), then its kind's
    `read`. One line of ValueError / FileNotFoundError where it is not a checkpoint specdec reads."""
    from specdec.models import read_config

    spec = DrafterSpec.parse(spec).base
    folder = spec.folder()
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"drafter {spec.text!r}: expected 'none', 'prompt-lookup', 'model:<draft model>' or a drafter "
            f"checkpoint folder (with config.json); {str(folder)!r} is none of them"
        )
    raw = read_config(folder)
    if raw is None:
        raise ValueError(f"drafter {spec.text!r}: {str(folder / 'config.json')!r} is not a JSON object")
    fmt = refuse_as_drafter(folder, raw, name=spec.text, readable=READABLE)  # others are named here
    kind = kind_for(fmt.kind)
    assert kind is not None, f"format {fmt.kind!r} is readable but no kind reads it"
    return Checkpoint(spec, folder, kind, kind.read(folder))


def refuse_as_model(folder: str | Path, raw: dict[str, Any]) -> None:
    """A one-line ValueError where the model folder `folder` (config `raw`) holds a drafter, not a model."""
    formats.refuse_as_model(folder, raw, readable=READABLE)


def kinds_help() -> str:
    """The kinds, one line each, for `specdec --help`."""
    return "; ".join(f"{k.name}: {k.summary} ({', '.join(k.runtimes)})" for k in KINDS)
