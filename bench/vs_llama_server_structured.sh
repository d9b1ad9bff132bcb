#!/usr/bin/env bash
# Structured output through the servers: forerun serve against llama-server, every request with
# the same JSON schema (OpenAI's response_format, json_schema; llama-server turns it into its own
# grammar), on the extraction set made from GSM8K problems (bench/data/extraction.jsonl), chat
# turns, greedy, up to 256 new tokens, 1 and 4 streaming clients (`forerun loadtest --extra-body`), 2
# threads everywhere, one server at a time.
#
# Usage: bench/vs_llama_server_structured.sh OUT_DIR [MODEL] [CONCURRENCY]
#   MODEL: smollm2 (default) | bundled | a .gguf file. Serves, one after another:
#     llama-server                plain decoding, 4 slots
#     llama-server-ngram-simple   --spec-type ngram-simple, lookup 3 tokens, drafts up to 8
#     forerun-none, forerun-ngram, forerun-suffix   forerun serve, batches of up to 4
#   Merges the reports into OUT_DIR/vs-llama-server-structured.json (+ .png); each report counts
#   the outputs that parse as JSON (valid_json).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?output folder}
model=${2:-smollm2}
levels=${3:-1,4}
prompts="$here/bench/data/extraction.jsonl"
tools=$("$here/bench/llama_cpp_tools.sh")
file=$(python -c "from forerun.models import resolve_source; print(resolve_source('$model')[1])")
mkdir -p "$out"
port=8013

LOADTEST_ARGS=(--endpoint chat --extra-body "$here/bench/data/extraction_response_format.json" --requests 30)
MAX_TOKENS=256
. "$here/bench/serve_one.sh"

ls_args=(-m "$file" -t 2 -tb 2 -np 4 -c 16384 --host 127.0.0.1 --port "$port")
all="llama-server llama-server-ngram-simple forerun-none forerun-ngram forerun-suffix"
for name in ${SERVERS:-$all}; do
    case $name in
    llama-server) run_one "$name" "$tools/llama-server" "${ls_args[@]}" ;;
    llama-server-ngram-simple) run_one "$name" "$tools/llama-server" "${ls_args[@]}" --spec-type ngram-simple \
        --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8 ;;
    forerun-*) run_one "$name" forerun serve --model "$model" --method "${name#forerun-}" --port "$port" \
        --max-batch 4 --threads 2 --max-tokens 512 ;;
    *) echo "unknown server $name" >&2; exit 2 ;;
    esac
done
reports=()
for name in $all; do [ -f "$out/$name.json" ] && reports+=("$out/$name.json"); done
python "$here/bench/merge_loadtests.py" --out "$out/vs-llama-server-structured.json" "${reports[@]}"
