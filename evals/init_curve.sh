#!/usr/bin/env bash
# Learning curves of the SmolLM2 DFlash drafter from two starts, same data, seed and steps (docs/training.md):
#   bash evals/init_curve.sh random  [WORK_DIR]   # the current start: random layers
#   bash evals/init_curve.sh verifier [WORK_DIR]  # layers copied from SmolLM2's own layers 28, 29 (--init-layers)
#   bash evals/init_curve.sh copy [WORK_DIR]      # random start, 4x loss weight where the answer repeats earlier
#                                                 # text (--repeat-weight 4: what prompt lookup would draft)
#   bash evals/init_curve.sh anchors [WORK_DIR]   # random start, anchors whose next token repeats earlier text
#                                                 # drawn 4x as likely (--repeat-anchors 4)
# The bundled shape (2 layers, block 8, draft vocabulary 8192), the bundled corpus, 64 held-out sequences
# evaluated every EVAL steps (teacher-forced tau and the engine's tau on 4 held-out prompts). Resumable: run
# it again to continue (checkpoints every 15 steps in WORK_DIR/ARM). Environment: STEPS (default 90), EVAL
# (default 30), DEVICE, PYTHON (default python3).
set -euo pipefail
ARM=${1:?usage: bash evals/init_curve.sh random|verifier|copy|anchors [WORK_DIR]}
W=${2:-runs/init-curve}
case "$ARM" in
  random) INIT=() ;;
  verifier) INIT=(--init-layers 28,29) ;;
  copy) INIT=(--repeat-weight 4) ;;
  anchors) INIT=(--repeat-anchors 4) ;;
  *) echo "error: arm must be random, verifier, copy or anchors, got '$ARM'" >&2; exit 2 ;;
esac
"${PYTHON:-python3}" -m specdec.cli train --verifier hf --model smollm2-135m \
  --data specdec/bundled/smollm2-135m/corpus --out "$W/$ARM" \
  --num-layers 2 --block-size 8 --heads 9 --kv-heads 3 --head-dim 64 --intermediate-size 1536 \
  --target-layer-ids 1,7,14,20,27,29 --draft-vocab 8192 --batch-size 8 --max-anchors 96 --attn-chunk 24 \
  --lr 1e-3 --holdout 64 --seed 0 --steps "${STEPS:-90}" --eval-every "${EVAL:-30}" --save-every 15 \
  --no-progress ${DEVICE:+--device "$DEVICE"} "${INIT[@]}"
