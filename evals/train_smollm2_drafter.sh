#!/usr/bin/env bash
# Reproduces the bundled drafter specdec/drafters/smollm2-135m-dflash (CPU is enough; a GPU is faster:
# add --device cuda). Data: 240 stdlib function prompts + 160 templated chat prompts
# (specdec.trainsets; disjoint from HumanEval / MT-Bench), answered greedily by SmolLM2-135M-Instruct
# itself, features of layers 1,7,14,20,27,29 captured teacher-forced.
#   bash evals/train_smollm2_drafter.sh [WORK_DIR]     (STEPS=... to change the training length)
set -euo pipefail
W=${1:-runs/train-smollm2}
STEPS=${STEPS:-800}
mkdir -p "$W"
python -c "from specdec.trainsets import write_prompts; write_prompts('$W/prompts.jsonl', n_code=240, n_chat=160)"
specdec train --verifier hf --model smollm2-135m --verifier-dtype float32 \
  --prompts "$W/prompts.jsonl" --max-new-tokens 192 --max-seq-len 640 --gen-batch-size 24 \
  --data-layer-ids 1,7,14,20,27,29 --data "$W/data" --out "$W/run" \
  --num-layers 2 --heads 9 --kv-heads 3 --head-dim 64 --intermediate-size 1536 --block-size 8 \
  --steps "$STEPS" --batch-size 2 --max-anchors 32 --lr 1e-3 --holdout 8 --seed 0 --save-every 100
# ship in bf16, public DFlash format
# CKPT=500 exports checkpoint-000500 (the bundled drafter); default: the last checkpoint
python - "$W/run" "${CKPT:-}" <<'PY'
import sys, torch
from pathlib import Path
from specdec.dflash import DFlashDrafter
from specdec.api import BUNDLED_DIR
run, step = Path(sys.argv[1]), sys.argv[2]
ckpt = run / f"checkpoint-{int(step):06d}" if step else sorted(run.glob("checkpoint-*"))[-1]
d = DFlashDrafter.from_pretrained(ckpt, dtype=torch.bfloat16)
print(d.save_pretrained(BUNDLED_DIR / "smollm2-135m-dflash"))
PY
