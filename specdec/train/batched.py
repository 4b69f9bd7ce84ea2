"""Moved to `specdec.verifiers.hf_generate` (the verifiers sit below training); this name warns and goes in
the next release."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from specdec.verifiers import hf_generate

    if not hasattr(hf_generate, name) or name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} moved to specdec.verifiers.hf_generate", DeprecationWarning, 2)
    return getattr(hf_generate, name)
