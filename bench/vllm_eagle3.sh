#!/usr/bin/env bash
# A forerun head in vLLM: export it (forerun export-draft --format speculators), then run the same
# prompts greedy through forerun and through vLLM's CPU build without and with it (bench/eagle3_check.py).
#
# Usage: bench/vllm_eagle3.sh OUT_DIR [HEAD]
#   Needs forerun's environment active and `bench/vllm_cpu.sh setup` done once. HEAD: an eagle head
#   folder (default: the one shipped for SmolLM2). MODEL (default smollm2), K (4), LIMIT (3 prompts
#   per Spec-Bench category), MAX_TOKENS (128), FORMAT (speculators, or eagle3: the original EAGLE-3
#   layout, for heads trained with --shape eagle3) from the environment. REUSE=1 keeps forerun.json and
#   vllm-plain.json already in OUT_DIR (same prompts and K) and runs only the export and vLLM with it.
#   Writes OUT_DIR/head (the export), forerun.json, vllm-plain.json, vllm-eagle3.json, report.{json,md}.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
env="${VLLM_ENV:-$here/.vllm-env}"
out=${1:?output folder}
head=${2:-}
model=${MODEL:-smollm2}
k=${K:-4}
mkdir -p "$out"
draft=()
[ -n "$head" ] && draft=(--draft "$head")
info=$(forerun export-draft --model "$model" "${draft[@]}" --format "${FORMAT:-speculators}" --k "$k" --out "$out/head")
target=$(python -c "import json,sys; print(json.loads(sys.argv[1])['verifier'])" "$info")
common=(--out "$out" --model "$model" --k "$k" --limit-per-category "${LIMIT:-3}" --max-tokens "${MAX_TOKENS:-128}")
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
if [ "${REUSE:-0}" != 1 ] || [ ! -f "$out/forerun.json" ] || [ ! -f "$out/vllm-plain.json" ]; then
    python "$here/bench/eagle3_check.py" forerun "${common[@]}" ${head:+--head "$head"}
    "$env/bin/python" "$here/bench/eagle3_check.py" vllm --plain --target "$target" "${common[@]}" > "$out/vllm-plain.log" 2>&1
fi
"$env/bin/python" "$here/bench/eagle3_check.py" vllm --target "$target" --head "$out/head" "${common[@]}" > "$out/vllm-eagle3.log" 2>&1
python "$here/bench/eagle3_check.py" report "${common[@]}"
