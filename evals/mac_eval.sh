#!/usr/bin/env bash
# Apple Silicon: an mlx-community verifier + a public z-lab DFlash drafter, evaluated on HumanEval and
# MT-Bench with the same report as everywhere else. One interleaved run holds, on every prompt, the AR
# baseline, the drafter in PyTorch on MPS (the cross-runtime path: features cross the bridge) and the same
# checkpoint run in MLX (nothing crosses), side by side in report.md, so you see which is faster here.
#
#   bash evals/mac_eval.sh                          # Llama-3.1-8B-Instruct (4-bit MLX) + its DFlash drafter
#   LIMIT=80 DATASETS="mtbench" bash evals/mac_eval.sh
#   RUNTIMES="mlx" bash evals/mac_eval.sh           # the MLX drafter only
#
# Needs: macOS on Apple Silicon, ~8 GB free memory, internet for the first download (Hugging Face hub).
# Everything it calls is tested on Linux with small models: MLXVerifier with 4-bit models
# (tests/test_mlx_verifier.py), public-format drafter folders (tests/test_checkpoint.py), the eval runner
# and report (tests/test_evals.py). bf16 on MPS: exactness is checked in fp32; bf16 reports a match rate.
set -euo pipefail
MODEL=${MODEL:-mlx-community/Meta-Llama-3.1-8B-Instruct-4bit}
DRAFTER_REPO=${DRAFTER_REPO:-z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat}
DATASETS=${DATASETS:-"humaneval mtbench"}
LIMIT=${LIMIT:-20}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
BLOCK_SIZE=${BLOCK_SIZE:-16}
RUNTIMES=${RUNTIMES:-"torch mlx"}  # the first is the main drafter, the others run beside it as peers
OUT=${OUT:-runs/mac-$(basename "$MODEL")}

if [[ "$(uname -s)/$(uname -m)" != "Darwin/arm64" ]]; then
  echo "error: this script is for Apple Silicon (MLX verifier + MPS drafter); on Linux use specdec eval" >&2
  exit 2
fi
python3 -m venv .venv
.venv/bin/pip install -q -e ".[mlx,hf,eval]"
# --drafter owner/name: only config.json + *.safetensors are downloaded (the public DFlash format; no
# custom code is run), into the Hugging Face cache, so later runs work offline
read -r MAIN OTHERS <<<"$RUNTIMES"
ALSO=()
if [[ -n "${OTHERS:-}" ]]; then read -r -a ALSO <<<"--also-drafter-runtime $OTHERS"; fi
# shellcheck disable=SC2086
.venv/bin/specdec eval --verifier mlx --model "$MODEL" --drafter "$DRAFTER_REPO" --device mps \
  --drafter-runtime "$MAIN" ${ALSO[@]+"${ALSO[@]}"} \
  --dtype bfloat16 --dataset $DATASETS --limit "$LIMIT" --max-new-tokens "$MAX_NEW_TOKENS" \
  --block-size "$BLOCK_SIZE" --out "$OUT"
echo "report: $OUT/report.md"
