#!/usr/bin/env bash
# forerun's server against llama.cpp's own llama-server (built from the source llama-cpp-python
# vendors: bench/llama_cpp_tools.sh), each server alone on the machine, one report.
#
# Usage: bench/vs_llama_server.sh MODEL ENDPOINT OUT_DIR [CONCURRENCY]
#   MODEL: smollm2 | bundled | a .gguf file. ENDPOINT: completions (prompts sent raw) or chat (one
#   user message each, the model's chat template; SmolLM2 has one). Spec-Bench prompts, greedy, 64
#   new tokens, 1, 4 and 16 streaming clients (`forerun loadtest`), 2 threads everywhere.
#   Serves one after another:
#     llama-server                 plain decoding, 16 slots, 32,768 positions (2,048 a slot)
#     llama-server-ngram-simple    --spec-type ngram-simple, lookup 3 tokens, drafts up to 8
#     llama-server-ngram-map-k     --spec-type ngram-map-k, lookup 3, drafts up to 8
#     llama-server-ngram-mod       --spec-type ngram-mod, match 4, drafts 1 to 8
#     llama-server-ngram-cache     --spec-type ngram-cache (its defaults)
#     forerun-none, forerun-suffix forerun serve, plain decoding and the suffix drafter, batches of 16
#   (llama-server's n-gram defaults look up 12-24 tokens and draft 48-64: made for long repeated
#   edits; these short answers repeat little, so the shorter settings above suit them better.)
#   Merges the reports into OUT_DIR/vs-llama-server.json (+ .png) with one table; SERVERS="..."
#   reruns only those, merging the others' reports already in OUT_DIR.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
model=${1:?model: smollm2, bundled or a .gguf file}
endpoint=${2:?endpoint: completions or chat}
out=${3:?output folder}
levels=${4:-1,4,16}
prompts="${PROMPTS:-$here/../shared/data/spec_bench/question.jsonl}"
tools=$("$here/bench/llama_cpp_tools.sh")
file=$(python -c "from forerun.models import resolve_source; print(resolve_source('$model')[1])")
mkdir -p "$out"
port=8012

LOADTEST_ARGS=(--endpoint "$endpoint")
. "$here/bench/serve_one.sh"

ls_args=(-m "$file" -t 2 -tb 2 -np 16 -c 32768 --host 127.0.0.1 --port "$port")
all="llama-server llama-server-ngram-simple llama-server-ngram-map-k llama-server-ngram-mod llama-server-ngram-cache forerun-none forerun-suffix"
for name in ${SERVERS:-$all}; do
    case $name in
    llama-server) run_one "$name" "$tools/llama-server" "${ls_args[@]}" ;;
    llama-server-ngram-simple) run_one "$name" "$tools/llama-server" "${ls_args[@]}" --spec-type ngram-simple \
        --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8 ;;
    llama-server-ngram-map-k) run_one "$name" "$tools/llama-server" "${ls_args[@]}" --spec-type ngram-map-k \
        --spec-ngram-map-k-size-n 3 --spec-ngram-map-k-size-m 8 ;;
    llama-server-ngram-mod) run_one "$name" "$tools/llama-server" "${ls_args[@]}" --spec-type ngram-mod \
        --spec-ngram-mod-n-match 4 --spec-ngram-mod-n-min 1 --spec-ngram-mod-n-max 8 ;;
    llama-server-ngram-cache) run_one "$name" "$tools/llama-server" "${ls_args[@]}" --spec-type ngram-cache ;;
    forerun-none) run_one "$name" forerun serve --model "$model" --method none --port "$port" --max-batch 16 --threads 2 ;;
    forerun-suffix) run_one "$name" forerun serve --model "$model" --method suffix --port "$port" --max-batch 16 --threads 2 ;;
    *) echo "unknown server $name" >&2; exit 2 ;;
    esac
done
reports=()
for name in $all; do [ -f "$out/$name.json" ] && reports+=("$out/$name.json"); done
python "$here/bench/merge_loadtests.py" --out "$out/vs-llama-server.json" "${reports[@]}"
