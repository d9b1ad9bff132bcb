"""Where the integer kernels prefetch the weights (L1, 8 KiB ahead, or L2, 16 KiB ahead), paired.

``QLinear.set_prefetch`` chooses it per weight and ``gguf_weights.tune_prefetch`` measures it once
per model and machine. This loads the model and its draft model once, then decodes every prompt
under both settings (target and draft alike), the order alternating prompt by prompt, and times
the target's verify passes of 1..8 rows after each prompt under both. The tile widths and byte
copies stay as tuned. Every output is checked equal across settings.

    python bench/experiments/prefetch_level.py --prompts bench/data/code_completions.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from paired import paired_runs


def main() -> None:
    from forerun.build import Options, build
    from forerun.chat import prompt_ids
    from forerun.engine import Engine
    from forerun.sampling import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--chat", default="off", choices=["on", "off"])
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="none,draft+suffix")
    ap.add_argument("--out", default=None, help="a JSON file for the figures")
    args = ap.parse_args()

    torch.set_num_threads(2)
    from forerun.build import DRAFT_LOOKUPS

    def options(m):
        if m in DRAFT_LOOKUPS:
            return Options(model=args.model, method="draft", draft_lookup=DRAFT_LOOKUPS[m], backend="torch", threads=2)
        return Options(model=args.model, method=m, backend="torch", threads=2)
    setups = {m: build(options(m)) for m in args.methods.split(",") if m != "none"}
    first = next(iter(setups.values()), None) or build(Options(model=args.model, method="none", backend="torch", threads=2))
    target = first.target
    engines = {"none": Engine(target.backend, None, target.eos_token_ids), **{m: s.engine() for m, s in setups.items()}}
    from forerun.backends.native_model import NativeModel
    from forerun.backends.qweights import QLinear
    models = [o for o in gc.get_objects() if isinstance(o, NativeModel) and o.quant is not None]
    tuned = target.backend.model.quant[0].linears["o"].parts[0].pf_l1

    def setting(l1: int):  # every weight there is: the target's, the draft model's, their heads (made as drafting goes)
        for lin in [o for o in gc.get_objects() if isinstance(o, QLinear)]:
            lin.set_prefetch(l1)
        for model in models:
            for i, q in enumerate(model.quant):
                q.refresh()
                model.qlayers[i] = q.c

    methods = args.methods.split(",")
    rows = [json.loads(line) for line in open(args.prompts)][: args.limit]
    texts = [r["turns"][0] for r in rows]
    ids = [prompt_ids(target.tokenizer, t) if args.chat == "on" else target.tokenizer.encode(t) for t in texts]
    for m in methods[1:]:
        engines[m].generate(ids[0], max_new_tokens=16, params=SamplingParams(), k="auto")  # warm-up
    res, passes = paired_runs(engines, methods, ids, setting, (0, 1), target.backend, args.max_new_tokens, methods[0])
    setting(tuned)
    name = {0: "L2", 1: "L1"}
    report = {"tuned": name[tuned], "models": len(models),
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "tokens_per_s": {f"{m} {name[l1]}": res[(l1, m)][0] / res[(l1, m)][1] for l1 in (0, 1) for m in methods},
              "pass_ms": {f"{n} {name[l1]}": 1e3 * statistics.median(passes[(l1, n)]) for l1 in (0, 1) for n in range(1, 9)}}
    for m in methods:
        a, b = (res[(l1, m)][0] / res[(l1, m)][1] for l1 in (1, 0))
        print(f"{m}: L1 {a:.2f} tok/s, L2 {b:.2f} tok/s ({b / a:.3f}x)")
    step = {l1: statistics.median(passes[(l1, 1)]) for l1 in (0, 1)}
    for n in range(1, 9):
        a, b = (statistics.median(passes[(l1, n)]) for l1 in (1, 0))
        print(f"{n} rows: L1 {a * 1e3:.2f} ms ({a / step[1]:.2f} steps), L2 {b * 1e3:.2f} ms ({b / step[0]:.2f} steps; "
              f"{b / a:.3f} of L1)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
