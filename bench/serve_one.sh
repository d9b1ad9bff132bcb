# Sourced by the server comparisons (bench/vs_vllm.sh, bench/vs_llama_server.sh): one server at a
# time on the machine, measured by `forerun loadtest`. The caller sets out, port, model, prompts and
# levels; LOADTEST_ARGS (an array) adds loadtest options.

wait_up() {  # URL PID
    for _ in $(seq 1 600); do
        curl -sf "$1/health" >/dev/null 2>&1 && return 0
        kill -0 "$2" 2>/dev/null || { echo "server exited" >&2; return 1; }
        sleep 1
    done
    echo "server did not start" >&2
    return 1
}

run_one() {  # NAME, then the server command (run without GGML_CPU_TILED_MM: llama.cpp's default)
    local name=$1; shift
    echo "== $name: $*" >&2
    env -u GGML_CPU_TILED_MM "$@" >"$out/$name.log" 2>&1 &
    local pid=$!
    wait_up "http://127.0.0.1:$port" "$pid"
    forerun loadtest --url "$name=http://127.0.0.1:$port" --model "$model" --prompts "$prompts" \
        --concurrency "$levels" --max-tokens "${MAX_TOKENS:-64}" "${LOADTEST_ARGS[@]}" --out "$out/$name.json" >&2
    kill "$pid"; wait "$pid" 2>/dev/null || true
    rm -f "$out/$name.png"
}
