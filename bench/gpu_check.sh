#!/usr/bin/env bash
# The GPU check, one command on a bare GPU machine (its image: torch, transformers, triton, ...; no
# network), from the project root. bench/gpu_check.py runs each part in a process of its own with its
# own time limit, inside one budget (default 330 s; under 6 minutes with the wheels' install): our
# rows (random-weight models: step time against the memory floor, verify cost, decode-only tokens/s,
# greedy equality of every method, trees and a batch of 16, graphs, a profile of the step), then the
# CUDA test subset (bench/gpu/cuda_tests.txt, whole log kept), then transformers' generate() last.
#
# Wheels the image lacks (bench/gpu/carry.txt) travel in bench/gpu/wheels, an ignored folder filled
# on a machine with a package index by bench/gpu/wheels.sh; with the device tool: carry
# ["bench/gpu/wheels"]. Rehearsed on a CPU by bench/gpu/rehearse.py (a test runs it in CI).
# Writes gpu_check.md (the table), gpu_check.json, gpu_check.log and tests.log to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/forerun-gpu}
WHEELS=${WHEELS:-bench/gpu/wheels}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
S=$(date +%s)
el() { echo "[t+$(( $(date +%s) - S ))s] $*"; }
nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/forerun-site \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/forerun-site
else
  echo "no wheels in $WHEELS (bench/gpu/wheels.sh makes them): the image's own packages only"
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
el "check"
python3 bench/gpu_check.py --out "$OUT" --tests --budget "${BUDGET:-330}" "$@" 2>&1 | grep -v -i warning | tee "$OUT/gpu_check.log"
RC=${PIPESTATUS[0]}
el "end: rc $RC"
exit "$RC"
