"""Where the modules of the flat drafting room went (one folder per drafter kind, Dec 2026). The old
names still import, with a DeprecationWarning, for one release: `import specdec.drafting.checkpoint`
is `specdec.drafting.dflash.config`; where an old module's name is now its kind's folder
(`specdec.drafting.dflash`), the folder hands out the old module's names (`from specdec.drafting.dflash
import DFlashDrafter`) the same way."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "install", "moved_attribute"]

#: old module -> its new home
MOVED = {
    f"specdec.drafting.{old}": f"specdec.drafting.{new}"
    for old, new in {
        "checkpoint": "dflash.config",
        "dflash": "dflash.torch",
        "dflash2": "dflash.dflash2",
        "dflash_kind": "dflash.entry",
        "dflash_mlx": "dflash.mlx",
        "dflash_model": "dflash.model",
        "dspark": "dflash.dspark",
        "speculators": "dflash.speculators",
        "eagle3": "eagle3.torch",
        "eagle3_config": "eagle3.config",
        "eagle3_kind": "eagle3.entry",
        "eagle3_mlx": "eagle3.mlx",
        "gemma4_assistant": "gemma4_assistant.torch",
        "gemma4_assistant_config": "gemma4_assistant.config",
        "gemma4_assistant_kind": "gemma4_assistant.entry",
        "gemma4_assistant_mlx": "gemma4_assistant.mlx",
        "mtp": "mtp.torch",
        "mtp_kind": "mtp.entry",
        "mtp_mlx": "mtp.mlx",
        "model": "draft_model.drafter",
        "lookup": "lookup.prompt",
        "ngrams": "lookup.ngrams",
    }.items()
}
MOVED["specdec.drafting.formats"] = "specdec.formats"  # the verifiers read it too: it sits below them


def _warn(old: str, new: str, level: int) -> None:
    warnings.warn(f"{old} moved to {new}; the old name goes in the next release", DeprecationWarning, level)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name as its new module (the same module object, so state is shared)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED or fullname.removeprefix("specdec.drafting.") in _FOLDERS:
            return None  # a folder's own name imports the folder
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        _warn(spec.name, MOVED[spec.name], 3)  # importlib's own frames are skipped
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass


_FOLDERS = frozenset(("dflash", "eagle3", "gemma4_assistant", "mtp", "lookup"))


def install() -> None:
    """Put the finder on `sys.meta_path` (once; `specdec.drafting` does it on import)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())


def moved_attribute(folder: str, name: str) -> Any:
    """`name` of the old module that had the folder's name (`specdec.drafting.dflash.DFlashDrafter`)."""
    if importlib.util.find_spec(f"{folder}.{name}") is not None:  # the folder's own module
        return importlib.import_module(f"{folder}.{name}")
    new = MOVED[folder]
    module = importlib.import_module(new)
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {folder!r} has no attribute {name!r}")
    _warn(f"{folder}.{name}", f"{new}.{name}", 4)  # the caller of the folder's __getattr__
    return getattr(module, name)
