"""specdec: exact speculative decoding with a PyTorch DFlash drafter across MLX and transformers verifiers.

Importing this package loads nothing heavy: the names below load `specdec.protocols` (torch) on first use,
and mlx and transformers load inside the verifier and bridge modules that need them. So the `specdec`
command can answer Ctrl-C while torch is still importing (`specdec.console`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.protocols import Drafter, MemoryProbe, Verifier, check_compatible

__version__ = "0.1.0"
__all__ = ["Drafter", "MemoryProbe", "Verifier", "__version__", "check_compatible"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from specdec import protocols

        return getattr(protocols, name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
