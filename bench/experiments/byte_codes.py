"""6-bit weights read as bytes by passes of several rows: what it does to decoding, paired.

A Q4_K_M file's LM head and part of its layers are Q6_K. A one-token step reads them as the file
holds them (6.56 bits a weight) and is bound by memory; a verify pass of several rows is bound by
its products, where joining a 6-bit code from its nibble and two bit planes is a third of the
work. ``QLinear.set_many`` gives passes of N rows or more a copy of those weights laid a byte a
code (same sums, same bits). This loads the model (and its draft model) once, then decodes every
prompt with plain decoding and with the drafting methods under two settings, alternating the
order prompt by prompt: the bytes never read (``--off``) and read from ``--layers-from`` and
``--head-from`` rows. Also the verify passes alone, 1..8 rows after each prompt, in both
settings. Every output is checked equal across settings.

    python bench/experiments/byte_codes.py --prompts bench/data/code_completions.jsonl --chat off
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from paired import paired_runs


def main() -> None:
    from forerun.backends.qweights import NEVER_WIDE
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
    ap.add_argument("--layers-from", type=int, default=4, help="rows from which layers read bytes")
    ap.add_argument("--head-from", type=int, default=4, help="rows from which the LM head reads bytes")
    ap.add_argument("--layers-wide", type=int, default=None, help="the layers' 512-bit tile from this many rows "
                    "while bytes are read (default: as tuned)")
    ap.add_argument("--methods", default="none,draft")
    ap.add_argument("--out", default=None, help="a JSON file for the figures")
    args = ap.parse_args()

    torch.set_num_threads(2)
    setup = build(Options(model=args.model, method="draft", backend="torch", threads=2))
    target = setup.target
    model = target.backend.model
    head = model.lm_head.qlin
    every = [lin for q in model.quant for lin in q.linears.values()]
    planes = [lin for lin in every if lin.has_planes]
    tuned_wide = every[0].parts[0].wide

    def refresh():
        for i, q in enumerate(model.quant):
            q.refresh()
            model.qlayers[i] = q.c

    def setting(on: bool):
        for lin in every:
            lin.set_wide(args.layers_wide if on and args.layers_wide else tuned_wide)
        for lin in planes:
            lin.set_many(args.layers_from if on else NEVER_WIDE)
        head.set_many(args.head_from if on else NEVER_WIDE)
        refresh()

    engines = {"none": Engine(target.backend, None, target.eos_token_ids), "draft": setup.engine()}
    methods = args.methods.split(",")
    rows = [json.loads(line) for line in open(args.prompts)][: args.limit]
    texts = [r["turns"][0] for r in rows]
    ids = [prompt_ids(target.tokenizer, t) if args.chat == "on" else target.tokenizer.encode(t) for t in texts]
    engines["draft"].generate(ids[0], max_new_tokens=16, params=SamplingParams(), k="auto")  # warm-up
    res, passes = paired_runs(engines, methods, ids, setting, (False, True), target.backend, args.max_new_tokens, "none")
    report = {"settings": {"layers_from": args.layers_from, "head_from": args.head_from,
                           "layers_wide": args.layers_wide or tuned_wide, "tuned_wide": tuned_wide},
              "tokens_per_s": {f"{m} {'bytes' if on else 'off'}": res[(on, m)][0] / res[(on, m)][1]
                               for on in (False, True) for m in methods},
              "pass_ms": {f"{n} {'bytes' if on else 'off'}": 1e3 * statistics.median(passes[(on, n)])
                          for on in (False, True) for n in range(1, 9)}}
    for m in methods:
        off, on = res[(False, m)], res[(True, m)]
        print(f"{m}: off {off[0] / off[1]:.2f} tok/s, bytes {on[0] / on[1]:.2f} tok/s "
              f"({(on[0] / on[1]) / (off[0] / off[1]):.3f}x)")
    if "none" in methods:
        base = {on: res[(on, "none")][0] / res[(on, "none")][1] for on in (False, True)}
        for m in methods:
            if m != "none":
                print(f"{m} over none: off {res[(False, m)][0] / res[(False, m)][1] / base[False]:.3f}x, "
                      f"bytes {res[(True, m)][0] / res[(True, m)][1] / base[True]:.3f}x")
    step = {on: statistics.median(passes[(on, 1)]) for on in (False, True)}
    for n in range(1, 9):
        a, b = (statistics.median(passes[(on, n)]) for on in (False, True))
        print(f"{n} rows: off {a * 1e3:.2f} ms ({a / step[False]:.2f} steps), bytes {b * 1e3:.2f} ms "
              f"({b / step[False]:.2f} of the off step)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
