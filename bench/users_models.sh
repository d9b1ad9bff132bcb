#!/usr/bin/env bash
# The README's results table: both named models on both backends, each against its peer's plain
# decoding (llama.cpp's own, transformers' generate()), then the table itself.
# Spec-Bench prompts, one per category (13), greedy, 128 new tokens, 2 threads, one run each
# (about 40 minutes on 2 cores).
# Usage: bench/users_models.sh OUT_DIR   (Spec-Bench at ../shared/data/spec_bench/question.jsonl,
#        or PROMPTS=FILE)
set -euo pipefail
out=${1:?output folder}
q=${PROMPTS:-../shared/data/spec_bench/question.jsonl}
common=(--prompts "$q" --limit-per-category 1 --max-new-tokens 128 --threads 2)

# SmolLM2 on llama.cpp: plain decoding, n-grams and the shipped eagle head (chains), llama.cpp's own decoding as the peer
forerun bench --model smollm2 --backend llama.cpp --methods none,ngram,ngram:auto,eagle:3,eagle:auto \
    --peers llama.cpp "${common[@]}" --out "$out/smollm2-llamacpp"
# SmolLM2 on the torch backend (native Llama forward), transformers generate() as the peer
forerun bench --model smollm2 --backend torch --methods none,ngram:auto,eagle:auto,eagle-tree+lookup:8 \
    --tree-nodes 4 --tree-depth 3 --peers hf,hf-lookup "${common[@]}" --out "$out/smollm2-torch"
# The bundled model on both backends
forerun bench --model bundled --backend torch --methods none,ngram:auto,eagle:auto,eagle-tree+lookup:10 \
    --tree-nodes 1 --tree-depth 1 --peers hf "${common[@]}" --out "$out/bundled-torch"
forerun bench --model bundled --backend llama.cpp --methods none,ngram:auto,eagle:auto --peers llama.cpp \
    "${common[@]}" --out "$out/bundled-llamacpp"

python "$(dirname "$0")/summary.py" "$out/smollm2-llamacpp" "$out/smollm2-torch" "$out/bundled-torch" \
    "$out/bundled-llamacpp" | tee "$out/summary.md"
