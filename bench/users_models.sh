#!/usr/bin/env bash
# The users'-models tables (docs/benchmarks-users-models.md): SmolLM2-135M-Instruct on both
# backends against llama.cpp's and transformers' own plain decoding, and the bundled model.
# Spec-Bench prompts, one per category (13), greedy, 128 new tokens, 2 threads, one run each.
# Usage: bench/users_models.sh OUT_DIR   (Spec-Bench at ../shared/data/spec_bench/question.jsonl)
set -euo pipefail
out=${1:?output folder}
q=${PROMPTS:-../shared/data/spec_bench/question.jsonl}
common=(--prompts "$q" --limit-per-category 1 --max-new-tokens 128 --threads 2)

# SmolLM2 on llama.cpp: plain decoding, n-grams and the shipped eagle head (chains), llama.cpp's own decoding as the peer
forerun bench --model smollm2 --backend llama.cpp --methods none,ngram,ngram:auto,eagle:3,eagle:auto \
    --peers llama.cpp "${common[@]}" --out "$out/smollm2-llamacpp"
# SmolLM2 on the torch backend (native Llama forward): every method, transformers generate() as the peer
forerun bench --model smollm2 --backend torch --methods none,ngram:auto,layerskip:auto,eagle:auto,eagle-tree+lookup:8 \
    --tree-nodes 4 --tree-depth 3 --peers hf,hf-lookup "${common[@]}" --out "$out/smollm2-torch"
# The bundled model, the same methods as before this change (torch, then llama.cpp)
forerun bench --model bundled --backend torch --methods none,ngram:auto,eagle:auto,eagle-tree+lookup:10 \
    --tree-nodes 1 --tree-depth 1 --peers hf "${common[@]}" --out "$out/bundled-torch"
forerun bench --model bundled --backend llama.cpp --methods none,ngram:auto,eagle:auto --peers llama.cpp \
    "${common[@]}" --out "$out/bundled-llamacpp"
