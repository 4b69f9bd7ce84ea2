"""DFlash, DFlash2 and DSpark: block drafters that propose a whole block in one forward, conditioned on
hidden states of several verifier layers (one backbone; DFlash2 and DSpark are variants of it).

    config.py       the public checkpoint format (config.json + model.safetensors), its checks
    model.py        the PyTorch network (`DFlashDraftModel`) and its context cache
    dflash2.py      what DFlash2 adds to the backbone: dynamic convolutions, the candidate selector
    dspark.py       what DSpark adds: its Markov head, read from its own layouts
    speculators.py  speculators' DFlash layout, read as the public one
    torch.py        the `Drafter` in PyTorch
    mlx.py          the same drafter in MLX, beside an MLX verifier
    entry.py        its registry entry (`DFLASH_KIND`)
"""

from __future__ import annotations

from typing import Any

from specdec.drafting.moved import moved_attribute


def __getattr__(name: str) -> Any:  # the old module of this name (deprecated)
    return moved_attribute(__name__, name)
