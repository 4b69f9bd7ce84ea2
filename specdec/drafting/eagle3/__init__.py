"""EAGLE-3 and P-EAGLE: one (or a few) decoder layers drafting a chain from three of the verifier's hidden
states (P-EAGLE: the whole chain in one forward).

    config.py   the config and weights of the four dialects (speculators, yuhuili's, SGLang's, mlx-vlm's)
    torch.py    the drafters in PyTorch
    mlx.py      the same in MLX, beside an MLX verifier
    entry.py    its registry entry (`EAGLE3_KIND`)
"""

from __future__ import annotations

from typing import Any

from specdec.drafting.moved import moved_attribute


def __getattr__(name: str) -> Any:  # the old module of this name (deprecated)
    return moved_attribute(__name__, name)
