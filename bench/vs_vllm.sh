#!/usr/bin/env bash
# forerun's server against vLLM's CPU build, each server alone on the machine, one report.
#
# Usage: bench/vs_vllm.sh MODEL OUT_DIR [CONCURRENCY]
#   MODEL: smollm2 | bundled. Needs `bench/vllm_cpu.sh setup` once and forerun's environment active.
#   Serves, one after another: vLLM plain, vLLM with n-gram speculation, forerun without and with
#   speculation; runs `forerun loadtest` (Spec-Bench prompts, greedy, 64 tokens) against each;
#   merges the four reports into OUT_DIR/vs-vllm.json (+ .png) with one table (bench/merge_loadtests.py).
#   SERVERS="forerun-none forerun-ngram" reruns only those; the others' reports already in OUT_DIR are merged.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
model=${1:?model: smollm2 or bundled}
out=${2:?output folder}
levels=${3:-1,4,16}
prompts="${PROMPTS:-$here/../shared/data/spec_bench/question.jsonl}"
mkdir -p "$out"
port=8011

LOADTEST_ARGS=()
. "$here/bench/serve_one.sh"

servers=${SERVERS:-vllm vllm-ngram forerun-none forerun-ngram}
for name in $servers; do
    case $name in
    vllm) run_one vllm "$here/bench/vllm_cpu.sh" serve "$model" "$port" ;;
    vllm-ngram) run_one vllm-ngram "$here/bench/vllm_cpu.sh" serve "$model" "$port" ngram ;;
    forerun-none) run_one forerun-none forerun serve --model "$model" --method none --port "$port" --max-batch 16 ;;
    forerun-ngram) run_one forerun-ngram forerun serve --model "$model" --method ngram --port "$port" --max-batch 16 ;;
    *) echo "unknown server $name" >&2; exit 2 ;;
    esac
done
python "$here/bench/merge_loadtests.py" --out "$out/vs-vllm.json" \
    "$out/vllm.json" "$out/vllm-ngram.json" "$out/forerun-none.json" "$out/forerun-ngram.json"
