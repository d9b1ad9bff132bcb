#!/usr/bin/env bash
# The README's results table in one command: the users' bench against llama-bench and the
# in-process llama.cpp peer on five files (bench/vs_llama_cpp.sh, about 6 minutes on 2 cores), then
# forerun serve against llama-server on SmolLM2 (completions and chat) and the bundled model
# (bench/vs_llama_server.sh, about 12 minutes each), then the table (bench/headline.py).
# Builds llama.cpp's tools first if needed (bench/llama_cpp_tools.sh, a few minutes once).
# Usage: bench/headline.sh OUT_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?output folder}
"$here/vs_llama_cpp.sh" "$out/vs-llama-cpp"
"$here/vs_llama_server.sh" smollm2 completions "$out/llama-server/smollm2"
"$here/vs_llama_server.sh" smollm2 chat "$out/llama-server/smollm2-chat"
"$here/vs_llama_server.sh" bundled completions "$out/llama-server/bundled"
python "$here/headline.py" "$out" | tee "$out/headline.md"
