"""The README's results table from the folders ``bench/headline.sh`` writes.

Usage: python bench/headline.py OUT_DIR   (OUT_DIR/vs-llama-cpp/<model>/results.json and
       OUT_DIR/llama-server/<model>[-chat]/vs-llama-server.json; prints markdown)

One row per model file: plain decoding's and the best method's decode rate against llama.cpp's
own llama-bench tg128, the best method's whole-request rate against bench's llama.cpp peer
(llama-cpp-python), and forerun serve's best against llama-server's best at each client count.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

NAMES = {"smollm2": "SmolLM2-135M Q4_1 (shipped)", "smollm2-q4_0": "SmolLM2 Q4_0", "smollm2-q4_k_m": "SmolLM2 Q4_K_M",
         "smollm2-q8_0": "SmolLM2 Q8_0", "bundled": "Gemma 3 270M Q4_K_M (bundled)"}


def server_cell(path: Path) -> str:
    d = json.loads(path.read_text())
    runs = d["methods"]
    levels = sorted({lv["concurrency"] for r in runs.values() for lv in r["levels"]})
    out = []
    for c in levels:
        def best(prefix):
            return max((lv["output_tokens_per_s"] for n, r in runs.items() if n.startswith(prefix)
                        for lv in r["levels"] if lv["concurrency"] == c), default=0.0)
        ours, theirs = best("forerun"), best("llama-server")
        out.append(f"{ours / theirs:.2f}x" if theirs else "-")
    return " / ".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    root = Path(argv[0])
    rows = ["| model (GGUF) | decode vs `llama-bench` tg128: plain / best | whole request vs llama-cpp-python: "
            "best | server vs `llama-server`'s best at 1 / 4 / 16 clients |", "|---|---|---|---|"]
    for key, name in NAMES.items():
        f = root / "vs-llama-cpp" / key / "results.json"
        if not f.is_file():
            continue
        d = json.loads(f.read_text())
        m, tg = d["methods"], d["llama_bench"]["tg128"]["tokens_per_s"]
        ours = [k for k in d["config"]["methods"] if k in m]
        best_d = max(ours, key=lambda k: m[k]["decode_tokens_per_s"] or 0)
        best_w = max(ours, key=lambda k: m[k]["tokens_per_s"])
        servers = []
        for suffix, label in (("", "completions"), ("-chat", "chat")):
            s = root / "llama-server" / (key + suffix) / "vs-llama-server.json"
            if s.is_file():
                servers.append(f"{server_cell(s)} ({label})")
        rows.append(f"| {name} | {m['none']['decode_tokens_per_s'] / tg:.2f}x / {m[best_d]['decode_tokens_per_s'] / tg:.2f}x "
                    f"| {m[best_w]['tokens_per_s'] / m['llama.cpp']['tokens_per_s']:.2f}x | {'; '.join(servers) or '-'} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
