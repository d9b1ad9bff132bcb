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
    res = {(l1, m): [0, 0.0] for l1 in (0, 1) for m in methods}
    passes = {(l1, n): [] for l1 in (0, 1) for n in range(1, 9)}
    outs = {}
    for m in methods[1:]:
        engines[m].generate(ids[0], max_new_tokens=16, params=SamplingParams(), k="auto")  # warm-up
    be = target.backend
    for i, p in enumerate(ids):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for l1 in order:
            setting(l1)
            for m in methods:
                t0 = time.perf_counter()
                r = engines[m].generate(p, max_new_tokens=args.max_new_tokens, params=SamplingParams(), k="auto")
                res[(l1, m)][0] += len(r.token_ids)
                res[(l1, m)][1] += time.perf_counter() - t0
                outs.setdefault((i, m), r.token_ids)
                assert r.token_ids == outs[(i, m)], f"prompt {i} {m}: the output differs between settings"
        ctx = torch.tensor(p + outs[(i, methods[0])])[:-8]
        be.reset()
        be.forward(ctx, 0, last_only=True)
        feed = torch.tensor(outs[(i, methods[0])][-8:])
        for rep in range(3):
            for l1 in order:
                setting(l1)
                for n in range(1, 9):
                    be.truncate(len(ctx))
                    t0 = time.perf_counter()
                    be.argmax_forward(feed[:n], len(ctx))
                    passes[(l1, n)].append(time.perf_counter() - t0)
        print(f"prompt {i + 1}/{len(ids)} done", flush=True)
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
