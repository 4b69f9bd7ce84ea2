"""Deprecated: the `--drafter` grammar is the registry's table (`specdec.drafting.registry.DrafterSpec`);
this name warns and goes in the next release."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    if name not in ("DrafterSpec", "LOOKUP_SUFFIX"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from specdec.drafting import registry

    warnings.warn(f"{__name__}.{name} moved to {registry.__name__}", DeprecationWarning, 2)
    return getattr(registry, name)
