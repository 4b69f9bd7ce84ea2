"""Gemma-4 assistants: a few decoder layers that read the verifier's own K/V (`SharedKV`) and draft a
chain from its last hidden state.

    config.py   the checkpoint, checked, and what a step computes
    torch.py    the drafter in PyTorch, beside the HF verifier
    mlx.py      the same in MLX, beside an MLX verifier
    entry.py    its registry entry (`GEMMA4_ASSISTANT_KIND`)
"""

from __future__ import annotations

from typing import Any

from specdec.drafting.moved import moved_attribute


def __getattr__(name: str) -> Any:  # the old module of this name (deprecated)
    return moved_attribute(__name__, name)
