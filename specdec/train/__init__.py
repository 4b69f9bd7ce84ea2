"""Drafter training: a corpus of the verifier's own responses, then a DFlash drafter trained on it.

1. A corpus (`specdec.train.corpus`): token ids only, built in resumable chunks (`python -m
   specdec.train.corpus` for the bundled drafters' three stages, or `specdec train --prompts FILE`).
2. `train(verifier, corpus_dir, cfg)` (`specdec.train.loop`): every batch's teacher-forced features come from
   the verifier itself (`specdec.train.features`; stored features would not fit a corpus at scale), the loss
   runs every anchor block of the batch with the block-sparse mask through `DFlashDraftModel.anchor_blocks`
   (`specdec.train.loss`), anchors and batches are seeded and length-grouped (`specdec.train.data`), data
   parallel through torch's DDP under torchrun, checkpoints in the public format, resumed exactly.
"""

from specdec.train.cli import add_train_args, cmd_train, main
from specdec.train.corpus import (
    Corpus,
    TrainSequence,
    build_default,
    build_from_prompts,
    build_stage,
    load_prompts,
)
from specdec.train.data import Batch, TrainData, anchor_range, collate, draft_vocabulary, sample_anchors
from specdec.train.features import TargetFeatures
from specdec.train.loop import TrainConfig, acceptance_length, drafter_config, train
from specdec.train.loss import block_loss, default_gamma, position_weights

__all__ = [
    "Batch",
    "Corpus",
    "TargetFeatures",
    "TrainConfig",
    "TrainData",
    "TrainSequence",
    "acceptance_length",
    "add_train_args",
    "anchor_range",
    "block_loss",
    "build_default",
    "build_from_prompts",
    "build_stage",
    "cmd_train",
    "collate",
    "default_gamma",
    "draft_vocabulary",
    "drafter_config",
    "load_prompts",
    "main",
    "position_weights",
    "sample_anchors",
    "train",
]
