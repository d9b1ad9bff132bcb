"""PNG charts beside the reports of ``forerun bench`` and ``forerun loadtest`` (matplotlib).

Each function takes the report's JSON as it is written to disk and returns the paths it wrote;
without matplotlib it writes nothing and says so once (the reports stay complete without charts).
"""

from __future__ import annotations

import logging
from pathlib import Path

from forerun.bench_report import time_split

log = logging.getLogger("forerun")


def _pyplot():
    try:
        import matplotlib  # charts only: its backend is chosen (Agg) when a chart is drawn, not on import

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt  # after choosing Agg, as matplotlib requires
    except ImportError:
        log.warning("matplotlib is not installed: no charts (pip install matplotlib)")
        return None
    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_charts(results: dict, out_dir: str | Path) -> list[Path]:
    """tokens_per_s.png (every method and peer), acceptance_by_position.png, predicted_speedup.png
    (measured against predicted speedup over plain decoding), verify_cost.png (the cost of a
    K+1-row pass in one-token steps) and time_split.png (drafting, verifying and the rest, per
    generated token), each where the report has the figures."""
    plt = _pyplot()
    if plt is None:
        return []
    out_dir = Path(out_dir)
    methods = results.get("methods", {})
    cfg = results.get("config", {})
    peers = set(cfg.get("peers", []))
    title = f"{cfg.get('model', '')} · {results.get('machine', {}).get('date', '')}"
    written = []

    if methods:
        names = list(methods)
        tps = [methods[n]["tokens_per_s"] for n in names]
        colors = ["#999999" if n in peers else "#2b6cb0" for n in names]
        fig, ax = plt.subplots(figsize=(7, 0.45 * len(names) + 1.4))
        ax.barh(names[::-1], tps[::-1], color=colors[::-1])
        for y, v in enumerate(tps[::-1]):
            ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
        ax.set_xlabel("tokens/s (prompt passes included)" + ("; grey: peers" if peers & set(names) else ""))
        ax.set_title(f"Throughput per method — {title}", fontsize=9)
        written.append(_save(plt, fig, out_dir / "tokens_per_s.png"))

    accept = {n: m["acceptance_per_position"] for n, m in methods.items() if m.get("acceptance_per_position")}
    if accept:
        fig, ax = plt.subplots(figsize=(7, 4))
        for n, acc in accept.items():
            while acc and acc[-1] == 0:  # positions never drafted
                acc = acc[:-1]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=n)
        ax.set_xlabel("draft position")
        ax.set_ylabel("share of drafted tokens accepted")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        ax.set_title(f"Acceptance by draft position — {title}", fontsize=9)
        written.append(_save(plt, fig, out_dir / "acceptance_by_position.png"))

    pred = {n: (m["speedup_vs_none"], m["predicted_speedup_vs_none"]) for n, m in methods.items()
            if m.get("predicted_speedup_vs_none") and m.get("speedup_vs_none")}
    if pred:
        fig, ax = plt.subplots(figsize=(5, 5))
        xs, ys = zip(*pred.values())
        lim = max(max(xs), max(ys)) * 1.15
        ax.plot([0, lim], [0, lim], color="#bbbbbb", linewidth=1)
        ax.scatter(ys, xs, color="#2b6cb0")
        for n, (meas, p) in pred.items():
            ax.annotate(n, (p, meas), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlim(0, lim)
        ax.set_ylim(0, lim)
        ax.set_xlabel("predicted speedup over none (Leviathan, measured costs)")
        ax.set_ylabel("measured speedup over none")
        ax.set_title(f"Measured vs predicted — {title}", fontsize=9)
        written.append(_save(plt, fig, out_dir / "predicted_speedup.png"))

    curves = dict(results.get("verify_cost_ratio_by_backend") or {})
    if not curves and results.get("verify_cost_ratio"):
        curves = {cfg.get("backend", "target"): results["verify_cost_ratio"]}
    curves = {b: {int(k): v for k, v in r.items() if str(k).isdigit()} for b, r in curves.items() if r}
    if any(curves.values()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for b, r in curves.items():
            ks = sorted(r)
            ax.plot(ks, [r[k] for k in ks], marker="o", label=b)
        top = max(k for r in curves.values() for k in r)
        ax.plot([1, top], [2, top + 1], color="#bbbbbb", linewidth=1, label="K+1 one-token steps")
        ax.set_xlabel("K (draft tokens; the pass verifies K+1 rows)")
        ax.set_ylabel("pass time / one-token step")
        ax.legend(fontsize=8)
        ax.set_title(f"Verify cost against K — {title}", fontsize=9)
        written.append(_save(plt, fig, out_dir / "verify_cost.png"))

    split = time_split(methods)
    if split:
        names = list(split)[::-1]
        fig, ax = plt.subplots(figsize=(7, 0.45 * len(names) + 1.4))
        left = [0.0] * len(names)
        parts = (("draft", lambda t: t["draft"] - t["read"], "#dd8452"), ("draft: reading", lambda t: t["read"], "#f2c29b"),
                 ("verify", lambda t: t["verify"], "#2b6cb0"), ("other", lambda t: t["other"], "#999999"))
        for part, value, color in parts:
            vals = [value(split[n]) for n in names]
            if part == "draft: reading" and not any(vals):
                continue
            ax.barh(names, vals, left=left, color=color, label=part)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_xlabel("milliseconds per generated token (prompt passes left out)")
        ax.legend(fontsize=8)
        ax.set_title(f"Where a round's time goes — {title}", fontsize=9)
        written.append(_save(plt, fig, out_dir / "time_split.png"))
    return written


def loadtest_chart(report: dict, path: str | Path) -> list[Path]:
    """Output tokens/s, TTFT p50 and time per output token p50 against concurrency, one line per
    method or server in the report (``forerun loadtest --out``'s JSON)."""
    plt = _pyplot()
    if plt is None:
        return []
    series = {name: sorted(r.get("levels", []), key=lambda lv: lv["concurrency"])
              for name, r in report.get("methods", {}).items()}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name, levels in series.items():
        c = [lv["concurrency"] for lv in levels]
        axes[0].plot(c, [lv.get("output_tokens_per_s") or 0 for lv in levels], marker="o", label=name)
        axes[1].plot(c, [lv.get("ttft_p50_s") or 0 for lv in levels], marker="o", label=name)
        axes[2].plot(c, [1000 * (lv.get("tpot_p50_s") or 0) for lv in levels], marker="o", label=name)
    ticks = sorted({lv["concurrency"] for levels in series.values() for lv in levels})
    for ax, label in zip(axes, ("output tokens/s", "time to first token, p50 (s)", "time per output token, p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"forerun loadtest — {report.get('model', '')} · {report.get('date', '')}", fontsize=9)
    return [_save(plt, fig, Path(path))]
