#!/usr/bin/env bash
# The README's results table: both named models on the torch backend (for these GGUF files: the
# integer path, what --backend auto picks), each against llama.cpp's own plain decoding (default
# settings) and transformers' generate() in the same run, then the table itself.
# Spec-Bench prompts, one per category (13), greedy, 128 new tokens, 2 threads, one run each
# (about 10-25 minutes on 2 cores).
# Usage: bench/users_models.sh OUT_DIR   (Spec-Bench at ../shared/data/spec_bench/question.jsonl,
#        or PROMPTS=FILE)
set -euo pipefail
out=${1:?output folder}
q=${PROMPTS:-../shared/data/spec_bench/question.jsonl}
common=(--prompts "$q" --limit-per-category 1 --max-new-tokens 128 --threads 2 --peers llama.cpp,hf)

forerun bench --model smollm2 --backend torch --methods none,ngram:auto,suffix:auto,eagle:auto,eagle-tree+lookup:8 \
    --tree-nodes 4 --tree-depth 3 "${common[@]}" --out "$out/smollm2"
forerun bench --model bundled --backend torch --methods none,ngram:auto,suffix:auto,eagle:auto,eagle-tree+lookup:10,eagle-tree+suffix-auto:16 \
    --tree-nodes 1 --tree-depth 1 "${common[@]}" --out "$out/bundled"

python "$(dirname "$0")/summary.py" "$out/smollm2" "$out/bundled" | tee "$out/summary.md"
