#!/usr/bin/env bash
# The checks only a CUDA GPU can make, in one device call (no model weights travel; about 3-6 minutes on an
# H200): the CUDA tests, the per-step peak-memory paths on CUDA (allocator peak, reset before each phase),
# and the training-step benchmark at the full preset (H 5120, 5 target layers, block 32, 1024 anchors, 8000
# positions, bf16). Writes gpu_check.json and gpu_check.md (plus the raw files) to $OUT (default
# runs/gpu_check); commit the table as docs/gpu_check.md.
#
#   bash evals/gpu_check.sh                                   # on the lent GPU, from the repo root
#   PYTHON=.venv/bin/python PRESET=cpu bash evals/gpu_check.sh  # rehearsal on a CPU: same steps, small preset
#   (TESTS="tests/test_cuda.py tests/test_memory.py" runs fewer test files)
#
# It uses the machine's own torch and installs nothing (the device machine reaches no registry): specdec is
# put on PYTHONPATH through a folder of links laid out as the installed package is (pyproject's package-dir).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_check}
PRESET=${PRESET:-full}
ITERS=${ITERS:-3}
# the test files it runs (a rehearsal may name fewer: the suite runs them all anyway)
TESTS=${TESTS:-tests/test_cuda.py tests/test_memory.py tests/test_engine.py tests/test_dflash.py}
mkdir -p "$OUT"
DEVICE=cuda
[ "$PRESET" = cpu ] && DEVICE=cpu

SITE=$(mktemp -d)
mkdir -p "$SITE/specdec"
for f in specdec/*; do ln -s "$PWD/$f" "$SITE/specdec/"; done
for d in verifiers bridges evals; do ln -s "$PWD/$d" "$SITE/specdec/$d"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 SPECDEC_HOME="$SITE/home"

echo "== environment" | tee "$OUT/log.txt"
(nvidia-smi -L 2>&1 || true; "$PY" -c 'import torch, specdec; print("torch", torch.__version__, "cuda", torch.cuda.is_available())') 2>&1 | tee -a "$OUT/log.txt"

echo "== CUDA tests" | tee -a "$OUT/log.txt"
# shellcheck disable=SC2086  # TESTS: several paths
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" --junitxml="$OUT/tests.xml" \
    $TESTS 2>&1 | tail -n 15 | tee -a "$OUT/log.txt"

echo "== per-step peak memory ($DEVICE)" | tee -a "$OUT/log.txt"
"$PY" - "$SITE/llama" <<'EOF' 2>&1 | tail -n 3 | tee -a "$OUT/log.txt"
import sys
sys.path.insert(0, "tests")
import tinymodels
tinymodels.tiny_tokenizer(tinymodels.tiny_llama(__import__("pathlib").Path(sys.argv[1])))
EOF
"$PY" -m specdec.cli generate --verifier hf --model "$SITE/llama" --device "$DEVICE" --dtype float32 \
    --drafter prompt-lookup --block-size 8 --max-new-tokens 64 --prompt "abc abc abc abc abc abc abc" \
    --out "$OUT/generate.json" 2>&1 | tail -n 3 | tee -a "$OUT/log.txt"

echo "== training-step benchmark (preset $PRESET)" | tee -a "$OUT/log.txt"
"$PY" -m specdec.evals.bench_train --preset "$PRESET" --device "$DEVICE" --iters "$ITERS" \
    --out "$OUT/bench_train.json" 2>&1 | tail -n 12 | tee -a "$OUT/log.txt"

"$PY" -m specdec.evals.gpu_check "$OUT" 2>&1 | tee -a "$OUT/log.txt"
