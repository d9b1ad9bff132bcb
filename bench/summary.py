"""The README's results table from the folders ``bench/users_models.sh`` writes.

Usage: python bench/summary.py [--decode] RESULTS_DIR [RESULTS_DIR ...]  (prints markdown)

One row per model, backend and peer: the peer's plain decoding, our plain decoding, our fastest
method, its speedup over the peer, its mean accepted length, and greedy equality with our plain
decoding over all prompts. ``--decode`` (folders of ``bench/vs_llama_cpp.sh``): one row per model
with decode-only rates against llama.cpp's own ``llama-bench`` tg128 and the llama.cpp peer, and
whole-request rates against the peer, side by side.
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


def decode_row(folder: Path) -> str:
    d = json.loads((folder / "results.json").read_text())
    cfg, methods, lb = d["config"], d["methods"], d.get("llama_bench") or {}
    ours = {m: methods[m] for m in cfg["methods"] if m in methods}
    best = max(ours, key=lambda m: ours[m]["decode_tokens_per_s"] or 0)
    tg = lb.get("tg128", {}).get("tokens_per_s")
    peer = methods.get("llama.cpp", {})
    none_d, best_d, peer_d = ours["none"]["decode_tokens_per_s"], ours[best]["decode_tokens_per_s"], peer.get("decode_tokens_per_s")
    best_w = max(ours, key=lambda m: ours[m]["tokens_per_s"])

    def r(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    model = Path(str(cfg["model"])).name
    return (f"| {model} | {tg:.1f} | {peer_d or 0:.1f} | {none_d:.1f} | `{best}` {best_d:.1f} | **{r(none_d, tg)}** / "
            f"**{r(best_d, tg)}** | {r(none_d, peer_d)} / {r(best_d, peer_d)} | {peer.get('tokens_per_s', 0):.1f} | "
            f"`{best_w}` {ours[best_w]['tokens_per_s']:.1f} ({r(ours[best_w]['tokens_per_s'], peer.get('tokens_per_s'))}) | "
            f"{lb.get('pp512', {}).get('tokens_per_s', 0):.0f} / {lb.get('forerun_pp512', 0):.0f} | "
            f"{min(m['greedy_equal'] for m in ours.values())}/{cfg['prompts']} |")


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--decode":
        out = ["| model | llama-bench tg128 | llama.cpp peer, decode | our plain, decode | our best, decode | "
               "plain / best vs tg128 | plain / best vs peer | llama.cpp peer, whole request | our best, whole request "
               "(vs peer) | pp512 llama-bench / ours | greedy = plain |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        dates = set()
        for a in argv[1:]:
            out.append(decode_row(Path(a)))
            dates.add(json.loads((Path(a) / "results.json").read_text())["machine"]["date"][:10])
        print("\n".join(out))
        print(f"\nTokens/s; decode excludes the prompt pass, whole request includes it; measured {', '.join(sorted(dates))}.")
        return 0
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
