"""Start-up cost of a GGUF model on the torch backend's integer path: resident memory and seconds
to load, read straight from the file (the default) against the transformers conversion it
replaced (float32 model, then the blocks matched to it). Each load runs in a fresh process, after
one untimed load that builds every cache (conversion, tokenizer, config, kernels).

    python bench/experiments/load_cost.py [--models smollm2,bundled] [--out bench/results/load-cost.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = r"""
import json, resource, sys, time, torch
t = time.perf_counter()
import forerun.models as m
spec, mode = sys.argv[1], sys.argv[2]
if mode == "file":
    lm = m.load_model(spec, backend="torch")
    assert lm._hf is None and lm.backend.model.quant is not None
else:
    kind, loc = m.resolve_source(spec)
    lm = m._load_transformers(spec, kind, loc, torch.float32, torch.device("cpu"), "native", None)
    assert lm.backend.model.quant is not None
s = time.perf_counter() - t
rss = int(open("/proc/self/statm").read().split()[1]) * 4096 / 1e6
print(json.dumps({"seconds": s, "rss_mb": rss, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3}))
"""


def run(spec: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, spec, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,bundled")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "models": {}}
    for spec in args.models.split(","):
        res["models"][spec] = {}
        for mode in ("converted", "file"):
            run(spec, mode)  # builds the caches
            runs = [run(spec, mode) for _ in range(args.reps)]
            best = min(runs, key=lambda r: r["seconds"])
            res["models"][spec][mode] = best
            print(f"{spec} {mode}: {best['seconds']:.1f} s, resident {best['rss_mb']:.0f} MB "
                  f"(peak {best['peak_mb']:.0f} MB)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
