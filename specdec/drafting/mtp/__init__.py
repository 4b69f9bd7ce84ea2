"""The verifier's own multi-token-prediction layers as its drafter (`--drafter mtp`), and mlx-vlm's MTP
layers split into a folder of their own.

    torch.py    the layers beside the HF verifier; reading split folders
    mlx.py      the same beside an MLX verifier
    entry.py    the registry entries (`MTP_KIND`: `--drafter mtp`; `MTP_SPLIT_KIND`: a split folder)
"""

from __future__ import annotations

from typing import Any

from specdec.drafting.moved import moved_attribute


def __getattr__(name: str) -> Any:  # the old module of this name (deprecated)
    return moved_attribute(__name__, name)
