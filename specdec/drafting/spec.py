"""The `--drafter` value, parsed once into a typed value that every caller uses.

none                      the autoregressive baseline (no drafter)
prompt-lookup             drafts what follows the last match of the recent tokens in the text so far
model:<folder|name|id>    a small causal LM of the verifier's tokenizer, drafting token by token
mtp                       the verifier's own multi-token-prediction layers (`specdec.drafting.mtp`)
<checkpoint>              a drafter checkpoint: bundled:<model>, a folder, or a hub repo id; what it is
                          comes from its config.json (`specdec.drafting.registry`)
any of the last two + "+lookup": prompt lookup where the text repeats, that drafter elsewhere
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["DrafterSpec"]

LOOKUP_SUFFIX = "+lookup"
KINDS = ("none", "prompt-lookup", "model", "mtp", "checkpoint")


@dataclass(frozen=True)
class DrafterSpec:
    """`text` as given; `kind` one of `KINDS`; `source` what follows "model:" or the checkpoint's name as
    given; `lookup`: the "+lookup" mix around it."""

    text: str
    kind: str
    source: str = ""
    lookup: bool = False

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
        if base in ("none", "prompt-lookup"):
            if lookup:
                raise ValueError(
                    f"drafter {text!r}: '+lookup' goes after a drafter checkpoint or a draft model"
                )
            return cls(text, base)
        if base == "mtp":
            return cls(text, "mtp", "", lookup)
        if base.startswith("model:"):
            if not base.removeprefix("model:"):
                raise ValueError(
                    f"drafter {text!r}: give a model after 'model:' (a folder, a known name, or stub)"
                )
            return cls(text, "model", base.removeprefix("model:"), lookup)
        return cls(text, "checkpoint", base, lookup)

    @property
    def autoregressive(self) -> bool:
        """No drafter: the baseline (the same loop with block size 1)."""
        return self.kind == "none"

    @property
    def base(self) -> DrafterSpec:
        """This spec without its "+lookup"."""
        return DrafterSpec.parse(self.text.removesuffix(LOOKUP_SUFFIX)) if self.lookup else self

    @property
    def bundled(self) -> str | None:
        """The model of a "bundled:<model>" checkpoint, else None."""
        return (
            self.source.removeprefix("bundled:") if self.kind == "checkpoint" and self._is_bundled else None
        )

    @property
    def _is_bundled(self) -> bool:
        return self.source.startswith("bundled:")

    def folder(self) -> Path:
        """A checkpoint's folder: bundled, local, or fetched from the hub into its cache (config.json and
        *.safetensors only)."""
        if self.kind != "checkpoint":
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
