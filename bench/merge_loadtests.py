"""Merge several `forerun loadtest --out` reports (one server each) into one report, table and chart."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from forerun.plots import loadtest_chart
from forerun.server.loadtest import comparison_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    merged = None
    for path in args.reports:
        r = json.loads(Path(path).read_text())
        if merged is None:
            merged = {k: v for k, v in r.items() if k not in ("methods", "table")}
            merged["methods"], merged["dates"] = {}, []
        merged["dates"].append(r["date"])
        for name, run in r["methods"].items():
            if name in merged["methods"]:
                raise SystemExit(f"{path}: server {name!r} appears twice")
            merged["methods"][name] = run
    # greedy: every server's text against forerun's plain decoding, and each llama-server variant's
    # against llama-server's own plain decoding
    # (a server run fresh for each level is named NAME@cN: its base name is NAME)
    for ref_name in ("forerun-none", "llama-server") if merged.get("temperature") == 0 else ():
        ref = {lv["concurrency"]: lv.get("texts", {}) for name, run in merged["methods"].items()
               if name.split("@")[0] == ref_name for lv in run["levels"]}
        if not ref:
            continue
        for name, run in merged["methods"].items():
            if ref_name == "llama-server" and not name.startswith("llama-server"):
                continue
            for lv in run["levels"]:
                b = ref.get(lv["concurrency"], {})
                same = [k for k in lv.get("texts", {}) if k in b]
                key = "greedy_equal_to_" + ref_name.replace("-", "_")
                lv[key] = f"{sum(lv['texts'][k] == b[k] for k in same)}/{len(same)}"
    merged["table"] = comparison_table(merged)
    Path(args.out).write_text(json.dumps(merged, indent=1))
    loadtest_chart(merged, Path(args.out).with_suffix(".png"))
    print(merged["table"])


if __name__ == "__main__":
    main()
