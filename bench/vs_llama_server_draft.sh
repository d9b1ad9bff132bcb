#!/usr/bin/env bash
# The Qwen2.5-Coder pair served: forerun serve against llama.cpp's own llama-server, its
# draft-model speculation included (built from the source llama-cpp-python vendors:
# bench/llama_cpp_tools.sh), each server alone on the machine, one report.
#
# Usage: bench/vs_llama_server_draft.sh OUT_DIR [CONCURRENCY] [REQUESTS]   (e.g. OUT 1,4,16 16)
#   The twelve code completions of bench/data/code_completions.jsonl (PROMPTS=... for others),
#   sent raw to /v1/completions, greedy, 128 new tokens, 2 threads everywhere, `forerun loadtest`
#   at CONCURRENCY (default 1) with REQUESTS per level (default 12). Serves one after another:
#     llama-server              plain decoding
#     llama-server-draft        --spec-type draft-simple -md 0.5B (its defaults: n-max 3, p-min 0)
#     llama-server-draft-8      the same, --spec-draft-n-max 8 --spec-draft-p-min 0.6
#     forerun-none, forerun-draft, forerun-suffix   forerun serve, --max-batch 16
#     forerun-draft-suffix      forerun serve --method draft --draft-lookup suffix
#   SERVERS="..." reruns only those, merging the others' reports already in OUT_DIR into
#   OUT_DIR/vs-llama-server.json (+ .png). FRESH=1 starts a fresh server for every level (reports
#   NAME@cN): the suffix drafter remembers earlier outputs, so a level after another on the same
#   server meets prompts it has already answered.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?output folder}
levels=${2:-1}
requests=${3:-12}
model=qwen2.5-coder-1.5b
prompts="${PROMPTS:-$here/bench/data/code_completions.jsonl}"
tools=$("$here/bench/llama_cpp_tools.sh")
file=$(python -c "from forerun.models import resolve_source; print(resolve_source('$model')[1])")
draft=$(python -c "from forerun.models import resolve_source; print(resolve_source('qwen2.5-coder-0.5b')[1])")
mkdir -p "$out"
port=8013

LOADTEST_ARGS=(--endpoint completions --max-tokens 128 --requests "$requests")
. "$here/bench/serve_one.sh"

ls_args=(-m "$file" -t 2 -tb 2 -np 16 -c 32768 --host 127.0.0.1 --port "$port")
ls_draft=(--spec-type draft-simple -md "$draft" -td 2 -tbd 2)
all="llama-server llama-server-draft llama-server-draft-8 forerun-none forerun-draft forerun-suffix forerun-draft-suffix"
serve() {  # NAME: that server at the current levels
    local name=$1
    case ${name%@*} in
    llama-server) run_one "$name" "$tools/llama-server" "${ls_args[@]}" ;;
    llama-server-draft) run_one "$name" "$tools/llama-server" "${ls_args[@]}" "${ls_draft[@]}" ;;
    llama-server-draft-8) run_one "$name" "$tools/llama-server" "${ls_args[@]}" "${ls_draft[@]}" \
        --spec-draft-n-max 8 --spec-draft-p-min 0.6 ;;
    forerun-none) run_one "$name" forerun serve --model "$model" --method none --port "$port" --max-batch 16 --threads 2 ;;
    forerun-draft) run_one "$name" forerun serve --model "$model" --method draft --port "$port" --max-batch 16 --threads 2 ;;
    forerun-suffix) run_one "$name" forerun serve --model "$model" --method suffix --port "$port" --max-batch 16 --threads 2 ;;
    forerun-draft-suffix) run_one "$name" forerun serve --model "$model" --method draft --draft-lookup suffix \
        --port "$port" --max-batch 16 --threads 2 ;;
    *) echo "unknown server $name" >&2; exit 2 ;;
    esac
}
all_levels=$levels
for name in ${SERVERS:-$all}; do
    if [ "${FRESH:-0}" = 1 ]; then
        for levels in ${all_levels//,/ }; do serve "$name@c$levels"; done
        levels=$all_levels
    else
        serve "$name"
    fi
done
reports=()
for f in "$out"/*.json; do [ "$(basename "$f")" != vs-llama-server.json ] && reports+=("$f"); done
python "$here/bench/merge_loadtests.py" --out "$out/vs-llama-server.json" "${reports[@]}"
