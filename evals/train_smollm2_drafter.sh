#!/usr/bin/env bash
# Reproduces the bundled drafter specdec/drafters/smollm2-135m-dflash on CPU (a GPU is faster: add
# --device cuda to SHAPE below). Data (specdec.trainsets, seed 0; nothing from HumanEval or MT-Bench):
#   set 1: 240 stdlib function signatures + docstrings and 160 templated chat instructions;
#   set 2: 1132 more in a seeded mix: the other 232 stdlib functions, 400 stdlib methods and 500 chat
#          instructions (more templates: arithmetic, extraction, reasoning, short code).
# Both are answered greedily by SmolLM2-135M-Instruct itself (fp32, up to 192 new tokens) and its
# layers 1,7,14,20,27,29 are captured teacher-forced, into one dataset folder (resumable).
# Training runs in two stages: 2200 steps from scratch, then a warm restart (--init-from: same weights,
# fresh optimizer, new warmup + cosine at a lower peak lr) for STEPS2 more.
#   bash evals/train_smollm2_drafter.sh [WORK_DIR]     (from the repo root; STEPS=... / STEPS2=... change
#   the stage lengths; STEPS2=0 stops after stage 1)
set -euo pipefail
W=${1:-runs/train-smollm2}
STEPS=${STEPS:-2200}
STEPS2=${STEPS2:-2000}
mkdir -p "$W"
python - "$W" <<'PY'
import sys
from specdec.trainsets import write_more_prompts, write_prompts
w = sys.argv[1]
write_prompts(f"{w}/prompts.jsonl", n_code=240, n_chat=160)
write_more_prompts(f"{w}/prompts-more.jsonl", after_code=240, after_chat=160, n_method=400, n_chat=500)
PY
DATA=(--verifier hf --model smollm2-135m --verifier-dtype float32 --max-new-tokens 192 --max-seq-len 640
  --data-layer-ids 1,7,14,20,27,29 --data "$W/data" --out "$W/run")
specdec train "${DATA[@]}" --prompts "$W/prompts.jsonl" --gen-batch-size 24 --build-only
specdec train "${DATA[@]}" --prompts "$W/prompts-more.jsonl" --gen-batch-size 48 --build-only
SHAPE=(--num-layers 2 --heads 9 --kv-heads 3 --head-dim 64 --intermediate-size 1536 --block-size 8
  --draft-vocab 8192 --batch-size 4 --max-anchors 48 --holdout 16 --seed 0 --save-every 250)
specdec train "${DATA[@]}" "${SHAPE[@]}" --steps "$STEPS" --lr 1.5e-3 --eval-every 550
RUN="$W/run"
if [ "$STEPS2" -gt 0 ]; then
  DATA[-1]="$W/run2"  # --out of stage 2
  specdec train "${DATA[@]}" "${SHAPE[@]}" --steps "$STEPS2" --lr 1e-3 --eval-every 500 \
    --init-from "$W/run/checkpoint-$(printf %06d "$STEPS")"
  RUN="$W/run2"
fi
# ship in bf16, public DFlash format (CKPT=N exports checkpoint-N; default: the last one)
python - "$RUN" "${CKPT:-}" <<'PY'
import sys, torch
from pathlib import Path
from specdec.dflash import DFlashDrafter
from specdec.api import BUNDLED_DIR
run, step = Path(sys.argv[1]), sys.argv[2]
ckpt = run / f"checkpoint-{int(step):06d}" if step else sorted(run.glob("checkpoint-*"))[-1]
d = DFlashDrafter.from_pretrained(ckpt, dtype=torch.bfloat16)
print(d.save_pretrained(BUNDLED_DIR / "smollm2-135m-dflash"))
PY
