"""The one table of drafter kinds (`KINDS`), and the `--drafter` grammar it drives.

    none                      the autoregressive baseline (no drafter)
    prompt-lookup             what followed the last match of the recent tokens in the text so far
    model:<folder|name|id>    a small causal LM of the verifier's tokenizer, drafting token by token
    mtp                       the verifier's own multi-token-prediction layers
    <checkpoint>              a drafter checkpoint: bundled:<model>, a folder, or a hub repo id; its kind
                              comes from its config.json (`specdec.formats`)
    any drafting kind + "+lookup": prompt lookup where the text repeats, that drafter elsewhere

A value is parsed once (`DrafterSpec.parse`, at the API's edge) and planned once (`plan`: its kind, and a
checkpoint's config and weights header, read before anything loads); everything downstream takes the
`DrafterPlan`. A word's kind is found by its word, a checkpoint's by its format; each kind names the loop
that drafts with it (`kind.LOOPS`), so a variant of a family (DSpark, PARD) is data of its kind's entry.

Adding a kind: its folder with its drafter(s) and its entry, the entry in `KINDS`, and its tests
(`docs/architecture.md`, "Adding a drafter kind").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specdec import formats
from specdec.drafting.dflash.entry import DFLASH_KIND
from specdec.drafting.draft_model.entry import MODEL_KIND
from specdec.drafting.eagle3.entry import EAGLE3_KIND
from specdec.drafting.gemma4_assistant.entry import GEMMA4_ASSISTANT_KIND
from specdec.drafting.kind import DrafterKind
from specdec.drafting.lookup.entry import PROMPT_LOOKUP_KIND
from specdec.drafting.medusa.entry import MEDUSA_KIND
from specdec.drafting.mtp.entry import MTP_KIND, MTP_SPLIT_KIND
from specdec.formats import refuse_as_drafter

__all__ = [
    "KINDS",
    "READABLE",
    "Checkpoint",
    "DrafterKind",
    "DrafterPlan",
    "DrafterSpec",
    "inspect_checkpoint",
    "kind_for",
    "kinds_help",
    "plan",
    "read_checkpoint",
    "refuse_as_model",
]

LOOKUP_SUFFIX = "+lookup"

NONE_KIND = DrafterKind(
    name="none",
    summary="no drafter: the autoregressive baseline (the same loop, one token a step)",
    loop="none",
    needs="nothing",
    runtimes=("torch", "mlx"),
    word="none",
    mixes=False,
    cuts=False,
    load=lambda plan, **_: None,
)

#: every kind, the grammar's words first; `specdec --help` lists the checkpoint kinds in this order
KINDS: tuple[DrafterKind, ...] = (
    NONE_KIND,
    PROMPT_LOOKUP_KIND,
    MODEL_KIND,
    MTP_KIND,
    DFLASH_KIND,
    EAGLE3_KIND,
    GEMMA4_ASSISTANT_KIND,
    MTP_SPLIT_KIND,
    MEDUSA_KIND,
)
#: the checkpoint formats, (`formats.Format.family`, dialect), some kind reads
READABLE = frozenset().union(*(k.formats for k in KINDS))


@dataclass(frozen=True)
class DrafterSpec:
    """A `--drafter` value as given (`text`), parsed: `word` the grammar word of its kind ("" for a
    checkpoint), `source` what follows "model:" or the checkpoint as given, `lookup` its "+lookup" mix."""

    text: str
    word: str
    source: str = ""
    lookup: bool = False
    #: this spec without its "+lookup" (itself where it has none), made once
    base: DrafterSpec = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        base = (
            replace(self, text=self.text.removesuffix(LOOKUP_SUFFIX), lookup=False) if self.lookup else self
        )
        object.__setattr__(self, "base", base)

    @classmethod
    def parse(cls, text: str | DrafterSpec | None) -> DrafterSpec:
        """The spec of a `--drafter` value (None: "none"); ValueError, one line, where it is malformed."""
        if isinstance(text, DrafterSpec):
            return text
        text = "none" if text is None else str(text)
        base = text.removesuffix(LOOKUP_SUFFIX)
        lookup = base != text
        if not base.strip():
            raise ValueError(
                f"drafter {text!r}: empty; give none, prompt-lookup, model:<...> or a checkpoint"
            )
        for k in KINDS:
            prefix = k.word.endswith(":")
            if not k.word or not (base == k.word or (prefix and base.startswith(k.word))):
                continue
            if lookup and not k.mixes:
                raise ValueError(
                    f"drafter {text!r}: '+lookup' goes after a drafter checkpoint or a draft model"
                )
            if prefix and base == k.word:
                raise ValueError(f"drafter {text!r}: give a {k.name} after {k.word!r} ({k.takes})")
            return cls(text, k.word.removesuffix(":"), base.removeprefix(k.word) if prefix else "", lookup)
        return cls(text, "", base, lookup)

    @property
    def kind(self) -> str:
        """Deprecated: the word, or "checkpoint" (the kind itself is `plan(spec).kind`)."""
        warnings.warn("DrafterSpec.kind is deprecated: use .word, or plan(spec).kind", DeprecationWarning, 2)
        return self.word or "checkpoint"

    @property
    def autoregressive(self) -> bool:
        """No drafter: the baseline (the same loop with block size 1)."""
        return self.word == "none"

    @property
    def bundled(self) -> str | None:
        """The model of a "bundled:<model>" checkpoint, else None."""
        return self.source.removeprefix("bundled:") if self._is_bundled else None

    @property
    def _is_bundled(self) -> bool:
        return not self.word and self.source.startswith("bundled:")

    def folder(self) -> Path:
        """A checkpoint's folder: bundled, local, or fetched from the hub into its cache (config.json and
        *.safetensors only)."""
        if self.word:
            raise ValueError(f"drafter {self.text!r} has no checkpoint folder")
        if self._is_bundled:
            from specdec.bundled import bundled_drafter

            return bundled_drafter(self.source.removeprefix("bundled:"))
        from specdec.models import resolve_drafter

        return resolve_drafter(self.source)  # a local folder as it is; a hub repo id from the hub cache

    def drafter_name(self, folder: Path) -> str:
        """How the result JSON names a checkpoint's drafter: "<model>-dflash" when bundled (every bundled
        drafter is a DFlash one), the repo id for a hub checkpoint, the folder's name for a local one."""
        if self._is_bundled:
            return f"{self.source.removeprefix('bundled:')}-dflash"
        return folder.name if str(folder) == self.source else self.source


@dataclass(frozen=True)
class DrafterPlan:
    """A `--drafter` value checked before anything loads: its spec, its kind, what the kind's check or read
    returned (`header`: for DFlash the `DFlashConfig`, checked against the weights' header), and a
    checkpoint's folder; everything downstream of the API's edge takes it."""

    spec: DrafterSpec
    kind: DrafterKind
    header: Any = None
    folder: Path | None = None
    #: how the result JSON and messages name the drafter (`DrafterSpec.drafter_name` for a checkpoint)
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            name = self.spec.drafter_name(self.folder) if self.folder is not None else self.spec.base.text
            object.__setattr__(self, "name", name)

    @property
    def block_size(self) -> int | None:
        """A checkpoint's block size (its header's), else None."""
        return getattr(self.header, "block_size", None) if self.folder is not None else None

    @property
    def trees(self) -> bool:
        """It can propose trees (`--tree`)."""
        return self.kind.trees

    @property
    def checkpoint(self) -> DrafterPlan | None:
        """Deprecated: a checkpoint's plan is the checkpoint (None: not a checkpoint)."""
        warnings.warn(
            "DrafterPlan.checkpoint is deprecated: the plan has .kind, .header, .folder",
            DeprecationWarning,
            2,
        )
        return self if self.folder is not None else None


#: deprecated: a checkpoint as read is its `DrafterPlan`
Checkpoint = DrafterPlan


def kind_for(fmt: formats.Format) -> DrafterKind | None:
    """The kind that reads checkpoints of format `fmt`, or None."""
    return next((k for k in KINDS if (fmt.family, fmt.dialect) in k.formats), None)


def plan(spec: str | DrafterSpec | DrafterPlan | None) -> DrafterPlan:
    """A `--drafter` value checked before any model loads: its grammar, its kind, a checkpoint's format,
    config and weights header (a hub repo id is fetched into its cache), a draft model's name."""
    if isinstance(spec, DrafterPlan):
        return spec
    spec = spec if isinstance(spec, DrafterSpec) else DrafterSpec.parse(spec)
    if not spec.base.word:
        return read_checkpoint(spec)
    kind = next(k for k in KINDS if k.word.removesuffix(":") == spec.base.word)
    return DrafterPlan(spec, kind, kind.check(spec.base.source) if kind.check else None)


def read_checkpoint(spec: DrafterSpec | str) -> DrafterPlan:
    """Find and read the checkpoint a spec names (bundled, local, or fetched from the hub into its cache):
    its format from config.json (another format is named, `formats.refuse_as_drafter`), then its kind's
    `read`. One line of ValueError / FileNotFoundError where it is not a checkpoint specdec reads."""
    from specdec.models import read_config

    spec = DrafterSpec.parse(spec)
    folder = spec.base.folder()
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"drafter {spec.base.text!r}: expected 'none', 'prompt-lookup', 'model:<draft model>' or a "
            f"drafter checkpoint folder (with config.json); {str(folder)!r} is none of them"
        )
    raw = read_config(folder)
    if raw is None:
        raise ValueError(f"drafter {spec.base.text!r}: {str(folder / 'config.json')!r} is not a JSON object")
    fmt = refuse_as_drafter(folder, raw, name=spec.base.text, readable=READABLE)  # others are named here
    kind = kind_for(fmt)
    assert kind is not None and kind.read is not None, f"format {fmt} is readable but no kind reads it"
    return DrafterPlan(spec, kind, kind.read(folder, raw, fmt), folder)


def refuse_as_model(folder: str | Path, raw: dict[str, Any]) -> None:
    """A one-line ValueError where the model folder `folder` (config `raw`) holds a drafter, not a model."""
    formats.refuse_as_model(folder, raw, readable=READABLE)


def kinds_help() -> str:
    """The checkpoint kinds, one line each, for `specdec --help`."""
    return "; ".join(f"{k.name}: {k.summary} ({', '.join(k.runtimes)})" for k in KINDS if k.formats)


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
        assert kind is not None and kind.read is not None and kind.fits is not None
        header = kind.read(folder, raw, fmt)
        lines.append(f"reads it: specdec, as --drafter {spec.text} ({kind.name}; {', '.join(kind.runtimes)})")
        lines += [f"{k}: {v}" for k, v in (kind.describe(header) if kind.describe else {}).items()]
        if target is not None:
            kind.fits(header, target, spec.text, None)
            lines.append(
                f"fits {target.model_name}: yes ({target.num_layers} layers, hidden {target.hidden_size})"
            )
    except (ValueError, FileNotFoundError) as e:
        return lines, str(e)
    return lines, None
