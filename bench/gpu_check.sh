#!/usr/bin/env bash
# The GPU check, one command on a bare GPU machine (torch, transformers, triton; no network), from
# the project root: the tiny-model tests on CUDA, then bench/gpu_check.py (random-weight models made
# here: step time against the memory floor, verify cost, plain/ngram/suffix against transformers'
# generate(), greedy equality in bfloat16 and float16, a batch of 16 against each request alone).
# Wheels the machine lacks (transformers >= 5.23, gguf) travel in $WHEELS, an ignored folder filled
# on a machine with a network by:  pip download --no-deps -d bench/gpu/wheels "transformers>=5.23" gguf
# Prints one table; writes it with the JSON to $OUT. About 4-5 minutes on an H100.
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
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
el "bench"
timeout 330 python3 bench/gpu_check.py --out "$OUT" "$@" 2>&1 | grep -v -i warning | tee "$OUT/gpu_check.log"
BENCH=${PIPESTATUS[0]}
el "tests on CUDA"
FORERUN_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_fixed_rows.py tests/test_engine.py tests/test_tree.py tests/test_sampling.py tests/test_distribution.py \
  2>&1 | tail -4 | tee "$OUT/tests.log"
TESTS=${PIPESTATUS[0]}
el "end: bench rc $BENCH, tests rc $TESTS"
[ "$BENCH" = 0 ] && [ "$TESTS" = 0 ]
