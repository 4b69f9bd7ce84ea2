"""Drafter training: a corpus of the verifier's own responses, then a DFlash drafter trained on it.

1. A corpus (`specdec.train.corpus`): token ids only, built in resumable chunks (`python -m
   specdec.train.corpus` for the bundled drafters' three stages, or `specdec train --prompts FILE`).
2. `train(verifier, corpus_dir, cfg)` (`specdec.train.loop`): every batch's teacher-forced features come from
   the verifier itself (`specdec.train.features`; stored features would not fit a corpus at scale), the loss
   runs every anchor block of the batch with the block-sparse mask through `DFlashDraftModel.anchor_blocks`
   (`specdec.train.loss`), anchors and batches are seeded and length-grouped (`specdec.train.data`), data
   parallel through torch's DDP under torchrun, checkpoints in the public format, resumed exactly.
"""

import importlib
from typing import Any

# Names load on first use (PEP 562), so `python -m specdec.train.corpus` does not import the corpus module
# twice (once through this package, once as __main__: runpy warns and its classes would exist twice).
_HOME = {
    "add_train_args": "cli",
    "cmd_train": "cli",
    "main": "cli",
    "Corpus": "corpus",
    "TrainSequence": "corpus",
    "build_default": "corpus",
    "build_from_prompts": "corpus",
    "build_stage": "corpus",
    "load_prompts": "corpus",
    "Batch": "data",
    "TrainData": "data",
    "anchor_range": "data",
    "collate": "data",
    "draft_vocabulary": "data",
    "sample_anchors": "data",
    "TargetFeatures": "features",
    "TrainConfig": "config",
    "acceptance_length": "loop",
    "drafter_config": "config",
    "grow_layers": "loop",
    "train": "loop",
    "block_loss": "loss",
    "default_gamma": "loss",
    "position_weights": "loss",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


__all__ = sorted(_HOME)
