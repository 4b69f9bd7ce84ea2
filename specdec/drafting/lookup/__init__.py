"""Drafting from text already seen: prompt lookup (`--drafter prompt-lookup`) and the n-grams of a corpus
of the verifier's own answers (behind "+lookup").

    prompt.py   prompt lookup and its measured chances of acceptance
    ngrams.py   corpus n-grams: what the verifier's own answers put after the last few tokens
    entry.py    its registry entry (`LOOKUP_KIND`)
"""

from __future__ import annotations

from typing import Any

from specdec.drafting.moved import moved_attribute


def __getattr__(name: str) -> Any:  # the old module of this name (deprecated)
    return moved_attribute(__name__, name)
