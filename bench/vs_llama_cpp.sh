#!/usr/bin/env bash
# forerun against llama.cpp's own llama-bench and an in-process llama.cpp peer (its own process,
# llama.cpp's defaults), on the models users pick: SmolLM2 as shipped (Q4_1) and re-quantized by
# llama.cpp's own llama-quantize to Q4_0, Q4_K_M and Q8_0, and the bundled Gemma 3 270M (Q4_K_M).
# Spec-Bench, one prompt per category (13), greedy, 128 new tokens, 2 threads; one bench per model,
# then the table (bench/summary.py): decode-only and whole-request ratios side by side.
#
# Usage: bench/vs_llama_cpp.sh OUT_DIR   (MODELS="smollm2-q4_0 bundled" runs only those)
#        ISA=avx2 FORERUN_KERNEL=avx2 bench/vs_llama_cpp.sh OUT_DIR   both sides built for AVX2 only
#        (llama-bench's tools from ISA=avx2 bench/llama_cpp_tools.sh; the in-process peer stays as installed)
# Needs llama.cpp's tools (bench/llama_cpp_tools.sh builds them, a few minutes once).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?output folder}
q=${PROMPTS:-$here/../shared/data/spec_bench/question.jsonl}
tools=$("$here/bench/llama_cpp_tools.sh")
variants="${FORERUN_CACHE:-$HOME/.cache/forerun}/variants"
mkdir -p "$out" "$variants"
src=$(python -c "from forerun.models import resolve_source; print(resolve_source('smollm2')[1])")
for t in Q4_0 Q4_K_M Q8_0; do  # llama.cpp's quantizer, from the shipped file (the only weights we have)
    f="$variants/SmolLM2-135M-Instruct.$t.gguf"
    [ -f "$f" ] || "$tools/llama-quantize" --allow-requantize "$src" "$f" "$t" >/dev/null 2>&1
done
common=(--prompts "$q" --limit-per-category 1 --max-new-tokens 128 --threads 2 --peers llama.cpp,llama-bench
        --llama-tools "$tools")
for m in ${MODELS:-smollm2 smollm2-q4_0 smollm2-q4_k_m smollm2-q8_0 bundled}; do
    case $m in
    smollm2) model=smollm2 ;;
    smollm2-q4_0) model="$variants/SmolLM2-135M-Instruct.Q4_0.gguf" ;;
    smollm2-q4_k_m) model="$variants/SmolLM2-135M-Instruct.Q4_K_M.gguf" ;;
    smollm2-q8_0) model="$variants/SmolLM2-135M-Instruct.Q8_0.gguf" ;;
    bundled) model=bundled ;;
    *) echo "unknown model $m" >&2; exit 2 ;;
    esac
    forerun bench --model "$model" --backend torch --methods none,ngram:auto,suffix:auto "${common[@]}" --out "$out/$m"
done
python "$here/bench/summary.py" --decode "$out"/*/ | tee "$out/summary.md"
