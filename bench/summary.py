"""The README's results table from the folders ``bench/users_models.sh`` writes.

Usage: python bench/summary.py RESULTS_DIR [RESULTS_DIR ...]  (prints markdown)

One row per model, backend and peer: the peer's plain decoding, our plain decoding, our fastest
method, its speedup over the peer, its mean accepted length, and greedy equality with our plain
decoding over all prompts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PEER_NAMES = {"llama.cpp": "llama.cpp", "hf": "transformers `generate()`", "hf-lookup": "transformers prompt lookup"}


def rows(folder: Path) -> list[str]:
    d = json.loads((folder / "results.json").read_text())
    cfg, methods = d["config"], d["methods"]
    peers = [p for p in cfg["peers"] if p in methods]
    ours = {m: methods[m] for m in cfg["methods"] if m in methods}
    best = max(ours, key=lambda m: ours[m]["tokens_per_s"])
    backends = set(cfg.get("backend_by_method", {}).values()) or {cfg.get("backend")}
    prompts = cfg["prompts"]
    equal = min(ours[m]["greedy_equal"] for m in ours)
    b = ours[best]
    tau = b.get("mean_accepted_len")
    out = []
    for peer in peers or [None]:
        peer_tps = methods[peer]["tokens_per_s"] if peer else None
        out.append(f"| {cfg['model']} | {', '.join(sorted(backends))} | "
                   + (f"{PEER_NAMES.get(peer, peer)} {peer_tps:.1f}" if peer else "-")
                   + f" | {ours['none']['tokens_per_s']:.1f} | `{best}` {b['tokens_per_s']:.1f}"
                   + (f" | **{b['tokens_per_s'] / peer_tps:.2f}x**" if peer else " | -")
                   + f" | {f'{tau:.2f}' if tau else '-'} | {equal}/{prompts} |")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out = ["| model | backend | peer (tokens/s) | our plain decoding | our best method | vs peer | tau | greedy = plain |",
           "|---|---|---|---|---|---|---|---|"]
    dates = set()
    for a in argv:
        for f in sorted(Path(a).glob("**/results.json")) if not (Path(a) / "results.json").exists() else [Path(a) / "results.json"]:
            out += rows(f.parent)
            dates.add(json.loads(f.read_text())["machine"]["date"][:10])
    print("\n".join(out))
    print(f"\nTokens/s include prompt passes; measured {', '.join(sorted(dates))}.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
