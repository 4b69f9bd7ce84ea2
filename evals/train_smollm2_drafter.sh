#!/usr/bin/env bash
# The data-at-scale recipe for the SmolLM2-135M drafter: corpus, warm-start training, export. Every step
# resumes where it stopped, so the script can be killed at any moment and run again (on another machine too:
# the corpus is committed; only the training checkpoints in WORK_DIR are local).
#   bash evals/train_smollm2_drafter.sh [WORK_DIR]      (from the repo root; default runs/train-smollm2)
# Environment: MAX_CHUNKS=N generates at most N more corpus chunks and stops (0: train on what is there);
# STEPS=N trains N steps (default: one epoch over the corpus); INIT=... the checkpoint to warm-start from
# (default: the bundled weights as released in commit 97b2c4b, read from git history; INIT=none starts
# from scratch). On a GPU add DEVICE=cuda.
#
# 1. Corpus (specdec.train.corpus, specdec.trainsets; nothing from HumanEval or MT-Bench, checked by word
#    8-grams): SmolLM2-135M-Instruct answers greedily (fp32, up to 256 new tokens, continuous batching)
#    3000 self-instruct requests ("questions"), then 18565 turn-1 prompts (10126 code prompts from the
#    standard library and 46 installed packages, 8439 chat instructions incl. its own questions), then
#    3000 follow-up turns to its chat answers ("turn2"), into evals/traindata/smollm2-135m.
# 2. Training: features online from the verifier, 2 layers, block 8, draft vocabulary 8192 (the bundled
#    shape, so the bundled weights warm-start it), AdamW lr 1e-3, 4% warmup then cosine, batch 8 x 48
#    anchors, 64 sequences held out (evaluated every 80 steps), seed 0.
# 3. Export: the last checkpoint in bf16, public DFlash format, into WORK_DIR/export. It replaces the
#    bundled weights only once it beats them on the benchmarks: compare both with
#    `python -m specdec.evals.replay --drafter WORK_DIR/export` and `--drafter bundled:smollm2-135m`.
#    (The bundled weights themselves came from the two-stage recipe of commit 97b2c4b:
#    `git show 97b2c4b:evals/train_smollm2_drafter.sh`.)
set -euo pipefail
W=${1:-runs/train-smollm2}
CORPUS=evals/traindata/smollm2-135m
BUNDLED=specdec/drafters/smollm2-135m-dflash
mkdir -p "$W"
if [ "${MAX_CHUNKS:-}" != "0" ]; then
  python -m specdec.train.corpus --model smollm2-135m --out "$CORPUS" ${MAX_CHUNKS:+--max-chunks "$MAX_CHUNKS"}
fi
INIT=${INIT:-$W/init}
if [ "$INIT" = "$W/init" ] && [ ! -d "$W/init" ]; then
  mkdir -p "$W/init.tmp"  # the warm start: the bundled weights as released, whatever the folder holds now
  for f in config.json model.safetensors; do git show "97b2c4b:$BUNDLED/$f" >"$W/init.tmp/$f"; done
  mv "$W/init.tmp" "$W/init"
fi
ARGS=(--verifier hf --model smollm2-135m --data "$CORPUS" --out "$W/run"
  --num-layers 2 --heads 9 --kv-heads 3 --head-dim 64 --intermediate-size 1536 --block-size 8
  --target-layer-ids 1,7,14,20,27,29 --draft-vocab 8192 --batch-size 8 --max-anchors 48 --lr 1e-3
  --holdout 64 --seed 0 --save-every 20 --eval-every 80 ${STEPS:+--steps "$STEPS"} ${DEVICE:+--device "$DEVICE"})
[ "$INIT" != "none" ] && ARGS+=(--init-from "$INIT")
specdec train "${ARGS[@]}"
python - "$W/run" "$W/export" <<'PY'
import sys
from pathlib import Path

import torch

from specdec.dflash import DFlashDrafter

run, dest = Path(sys.argv[1]), Path(sys.argv[2])
ckpt = sorted(run.glob("checkpoint-*"))[-1]
print(DFlashDrafter.from_pretrained(ckpt, dtype=torch.bfloat16).save_pretrained(dest))
PY
