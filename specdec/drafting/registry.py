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
from specdec.drafting.eagle3_kind import EAGLE3_KIND
from specdec.drafting.formats import refuse_as_drafter
from specdec.drafting.gemma4_assistant_kind import GEMMA4_ASSISTANT_KIND
from specdec.drafting.kind import DrafterKind
from specdec.drafting.mtp_kind import MTP_SPLIT_KIND
from specdec.drafting.spec import DrafterSpec

__all__ = [
    "KINDS",
    "READABLE",
    "Checkpoint",
    "DrafterKind",
    "inspect_checkpoint",
    "kind_for",
    "kinds_help",
    "read_checkpoint",
    "refuse_as_model",
]


#: every kind specdec reads, in the order `specdec --help` lists them
KINDS: tuple[DrafterKind, ...] = (DFLASH_KIND, EAGLE3_KIND, GEMMA4_ASSISTANT_KIND, MTP_SPLIT_KIND)
#: the checkpoint formats, (`formats.Format.kind`, dialect), some kind reads
READABLE = frozenset().union(*(k.formats for k in KINDS))


def kind_for(fmt: formats.Format) -> DrafterKind | None:
    """The kind that reads checkpoints of format `fmt`, or None."""
    return next((k for k in KINDS if (fmt.kind, fmt.dialect) in k.formats), None)


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
    kind = kind_for(fmt)
    assert kind is not None, f"format {fmt} is readable but no kind reads it"
    return Checkpoint(spec, folder, kind, kind.read(folder, raw, fmt))


def refuse_as_model(folder: str | Path, raw: dict[str, Any]) -> None:
    """A one-line ValueError where the model folder `folder` (config `raw`) holds a drafter, not a model."""
    formats.refuse_as_model(folder, raw, readable=READABLE)


def kinds_help() -> str:
    """The kinds, one line each, for `specdec --help`."""
    return "; ".join(f"{k.name}: {k.summary} ({', '.join(k.runtimes)})" for k in KINDS)


def inspect_checkpoint(spec: str | DrafterSpec, target: Any = None) -> tuple[list[str], str | None]:
    """What a drafter checkpoint folder is, before any weights load, as "name: value" lines: its format and
    dialect; where specdec reads it, its kind's account (the target it was made for, the layers it reads,
    ...) and, with `target` (`specdec.models.model_shape`), whether it fits that model. Also the one-line
    reason it cannot be used (None: it can): another format (named), a broken checkpoint, a misfit."""
    from specdec.models import read_config

    spec = DrafterSpec.parse(spec).base
    folder = spec.folder()
    raw = read_config(folder) if (folder / "config.json").is_file() else None
    if raw is None:
        return [f"folder: {folder}"], f"{spec.text!r}: no readable config.json; not a checkpoint folder"
    fmt = formats.identify(raw, {p.name for p in folder.iterdir()})
    lines = [f"folder: {folder}", f"format: {fmt.describe()}"]
    kind = kind_for(fmt) if fmt.readable(READABLE) else None
    try:
        if kind is None:
            refuse_as_drafter(folder, raw, name=spec.text, readable=READABLE)
        assert kind is not None
        header = kind.read(folder, raw, fmt)
        lines.append(f"reads it: specdec, as --drafter {spec.text} ({kind.name}; {', '.join(kind.runtimes)})")
        lines += [f"{k}: {v}" for k, v in kind.describe(header).items()]
        if target is not None:
            kind.fits(header, target, spec.text)
            lines.append(
                f"fits {target.model_name}: yes ({target.num_layers} layers, hidden {target.hidden_size})"
            )
    except (ValueError, FileNotFoundError) as e:
        return lines, str(e)
    return lines, None
