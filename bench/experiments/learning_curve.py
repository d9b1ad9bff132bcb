"""Learning curve of trained heads: validation agreement per position, and the tokens per pass a chain
of them would give, against training time, from each head's ``training.history`` (config.json).

Usage: python bench/experiments/learning_curve.py OUT.png HEAD_DIR [HEAD_DIR ...]
Also prints the points as a Markdown table.
"""

import json
import sys
from pathlib import Path

from forerun.drafters.head_training import chain_tau


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, heads = Path(argv[0]), [Path(a) for a in argv[1:]]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    print("| head | training minutes | step | validation agreement, positions 1-4 | est. tau |")
    print("|---|---|---|---|---|")
    for h in heads:
        cfg = json.loads((h / "config.json").read_text())
        hist = [p for p in cfg.get("training", {}).get("history", []) if "train_seconds" in p or p["step"] == 0]
        xs = [p.get("train_seconds", 0.0) / 60 for p in hist]
        ys = [chain_tau(p["val_agreement"]) for p in hist]
        ax.plot(xs, ys, marker="o", label=h.name)
        for p, x, y in zip(hist, xs, ys):
            print(f"| {h.name} | {x:.1f} | {p['step']} | {' '.join(f'{a:.3f}' for a in p['val_agreement'])} | {y:.2f} |")
    ax.set_xlabel("training time (minutes, this CPU)")
    ax.set_ylabel("est. tau (chain, from validation agreement)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
