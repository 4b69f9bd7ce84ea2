"""What ships with specdec, per model: `<model>/drafter`, a DFlash checkpoint in the public format, and
`<model>/corpus`, the verifier's own greedy answers (token ids, a `specdec.corpus` folder) its drafter was
trained on, whose n-grams `--corpus` drafts by. Data only, plus where to find it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["BUNDLED", "BUNDLED_DIR", "bundled_corpus", "bundled_drafter", "corpus_path"]

BUNDLED_DIR = Path(__file__).parent
#: the models something is bundled for (short names, as `specdec.models.MODELS`)
BUNDLED = ("gemma3-270m", "smollm2-135m")


def bundled_drafter(model: str) -> Path:
    """The folder of the drafter shipped for a bundled model name (e.g. "smollm2-135m")."""
    path = BUNDLED_DIR / model / "drafter"
    if model not in BUNDLED or not (path / "config.json").is_file():
        raise ValueError(f"no bundled drafter for {model!r}; bundled drafters exist for {list(BUNDLED)}")
    return path


def bundled_corpus(model: str) -> Path | None:
    """The folder of the corpus shipped for a bundled model name, or None where none is."""
    path = BUNDLED_DIR / model / "corpus"
    return path if model in BUNDLED and (path / "corpus.json").is_file() else None


def corpus_path(spec: str | os.PathLike[str]) -> Path:
    """A corpus folder from a `--corpus` value: a path, or "bundled:<model>" (`bundled_corpus`)."""
    text = str(spec)
    if not text.startswith("bundled:"):
        return Path(text).expanduser()
    model = text.removeprefix("bundled:")
    path = bundled_corpus(model)
    if path is None:
        raise ValueError(f"no bundled corpus for {model!r}; there are corpora for {list(BUNDLED)}")
    return path
