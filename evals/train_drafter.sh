#!/usr/bin/env bash
# The data-at-scale recipe of a bundled drafter: corpus, training, export, one command per verifier:
#   bash evals/train_drafter.sh smollm2-135m [WORK_DIR]     (from the repo root; default runs/train-MODEL)
#   bash evals/train_drafter.sh gemma3-270m [WORK_DIR]
# Every step resumes where it stopped, so the script can be killed at any moment and run again (on another
# machine too: the corpus is committed; only the training checkpoints in WORK_DIR are local).
# Environment: MAX_CHUNKS=N generates at most N more corpus chunks and stops (0: train on what is there);
# STEPS=N trains N steps (default: one epoch over the corpus); STAGES=a,b trains on those corpus stages
# only (default all); INIT=... the checkpoint to warm-start from (SmolLM2 default: the bundled weights as
# released in commit 97b2c4b, read from git history; Gemma 3 and INIT=none start from scratch); LAYERS=N
# drafter layers (default 2; a deeper drafter grows from a shallower INIT). On a GPU add DEVICE=cuda.
#
# 1. Corpus (specdec.train.corpus, specdec.train.prompts; nothing from HumanEval or MT-Bench, checked by word
#    8-grams) in specdec/bundled/MODEL/corpus: the verifier answers greedily (fp32, continuous batching) 3000
#    self-instruct requests ("questions", 64 new tokens), then 18565 turn-1 prompts (10126 code prompts
#    from the standard library and 43 installed packages, 8439 chat instructions incl. its own questions;
#    256), then 3000 follow-up turns to its chat answers ("turn2", 256).
# 2. Training: features online from the verifier, 2 layers, block 8, a draft vocabulary (8192 for
#    SmolLM2's 49k, 16384 for Gemma 3's 262k), AdamW lr 1e-3, 4% warmup then cosine, batch 8 x 96 anchors
#    (in chunks of 24, kept for the backward: the verifier's forward for the features is most of a step,
#    so more anchors per sequence cost little), 64 sequences held out (evaluated every 125 steps), seed 0.
#    The SmolLM2 shape is the bundled one, so the bundled weights warm-start it.
# 3. Export: the last checkpoint in bf16, public DFlash format, into WORK_DIR/export. It replaces the
#    bundled weights only once it beats them on the benchmarks: compare both with
#    `python -m specdec.evals.replay --drafter bundled:MODEL WORK_DIR/export` (same answers for both).
#    (The SmolLM2 bundled weights came from the two-stage recipe of commit 97b2c4b:
#    `git show 97b2c4b:evals/train_smollm2_drafter.sh`.)
set -euo pipefail
MODEL=${1:?usage: bash evals/train_drafter.sh smollm2-135m|gemma3-270m [WORK_DIR]}
W=${2:-runs/train-$MODEL}
case "$MODEL" in
  smollm2-135m)
    SHAPE=(--heads 9 --kv-heads 3 --head-dim 64 --intermediate-size 1536
      --target-layer-ids 1,7,14,20,27,29 --draft-vocab 8192)
    RELEASED=97b2c4b:specdec/drafters/smollm2-135m-dflash ;;
  gemma3-270m)
    SHAPE=(--heads 10 --kv-heads 2 --head-dim 64 --intermediate-size 1920
      --target-layer-ids 1,4,8,11,15,17 --draft-vocab 16384)
    RELEASED= ;;
  *) echo "train_drafter.sh: no recipe for $MODEL (smollm2-135m, gemma3-270m)" >&2; exit 2 ;;
esac
CORPUS=specdec/bundled/$MODEL/corpus
mkdir -p "$W"
if [ "${MAX_CHUNKS:-}" != "0" ]; then
  python -m specdec.train.corpus --model "$MODEL" --out "$CORPUS" ${MAX_CHUNKS:+--max-chunks "$MAX_CHUNKS"}
fi
INIT=${INIT:-${RELEASED:+$W/init}}
INIT=${INIT:-none}
if [ "$INIT" = "$W/init" ] && [ ! -d "$W/init" ]; then
  mkdir -p "$W/init.tmp"  # the warm start: the bundled weights as released, whatever the folder holds now
  for f in config.json model.safetensors; do git show "$RELEASED/$f" >"$W/init.tmp/$f"; done
  mv "$W/init.tmp" "$W/init"
fi
ARGS=(--verifier hf --model "$MODEL" --data "$CORPUS" --out "$W/run" --num-layers "${LAYERS:-2}" --block-size 8
  "${SHAPE[@]}" --batch-size 8 --max-anchors 96 --attn-chunk 24 --lr 1e-3 --holdout 64 --seed 0
  --save-every 20 --eval-every 125 ${STEPS:+--steps "$STEPS"} ${STAGES:+--stages "$STAGES"} ${DEVICE:+--device "$DEVICE"})
[ "$INIT" != "none" ] && ARGS+=(--init-from "$INIT")
specdec train "${ARGS[@]}"
python - "$W/run" "$W/export" <<'PY'
import sys
from pathlib import Path

import torch

from specdec.drafting.dflash.torch import DFlashDrafter

run, dest = Path(sys.argv[1]), Path(sys.argv[2])
ckpt = sorted(run.glob("checkpoint-*"))[-1]
print(DFlashDrafter.from_pretrained(ckpt, dtype=torch.bfloat16).save_pretrained(dest))
PY
