"""Perplexity of a fixed text under forerun's paths and under llama.cpp, same GGUF file, same tokens.

    python bench/perplexity.py --model smollm2 [--text bench/data/perplexity.txt] [--window 512]

The text is cut into windows of ``--window`` tokens (each starting with the model's BOS where it has
one); every token after the first of a window is scored given the tokens before it in that window.
Paths: the torch backend's integer path (the default for GGUF files), its float32 path on the same
weights, and llama.cpp with its default settings (the bench's llama.cpp peer). Prints a markdown
table; with --json, the numbers."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch


def nll(backend, windows) -> tuple[float, int]:
    total, count = 0.0, 0
    for w in windows:
        backend.reset()
        logits = backend.forward(torch.tensor(w), 0).logits.double()
        lp = torch.log_softmax(logits[:-1], -1)
        total -= float(lp.gather(1, torch.tensor(w[1:])[:, None]).sum())
        count += len(w) - 1
    return total, count


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default=str(Path(__file__).with_name("data") / "perplexity.txt"))
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from forerun.backends.llamacpp import LlamaCppBackend, LlamaCppModel
    from forerun.backends.native import NativeBackend
    from forerun.models import load_model, resolve_source

    lm = load_model(args.model, backend="torch", threads=args.threads)
    _, path = resolve_source(args.model)
    tok = lm.tokenizer
    ids = tok(Path(args.text).read_text(), add_special_tokens=False).input_ids
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    step = args.window - len(bos)
    windows = [bos + ids[i: i + step] for i in range(0, len(ids), step) if len(ids[i: i + step]) > 1]
    paths = {
        "forerun, integer path": lm.backend,
        "forerun, float32 path": NativeBackend(lm.hf_model, gguf=path, integer=False),
        "llama.cpp (default settings)": LlamaCppBackend(LlamaCppModel(path, exact=False), threads=args.threads,
                                                        max_context=args.window, fast_greedy=False),
    }
    rows = {}
    for name, be in paths.items():
        t = time.perf_counter()
        total, count = nll(be, windows)
        rows[name] = {"perplexity": math.exp(total / count), "tokens": count, "seconds": time.perf_counter() - t}
    ref = rows["llama.cpp (default settings)"]["perplexity"]
    if args.json:
        print(json.dumps({"model": args.model, "window": args.window, "paths": rows}, indent=1))
        return 0
    print(f"{args.model}: {rows[next(iter(rows))]['tokens']} scored tokens, windows of {args.window}\n")
    print("| path | perplexity | vs llama.cpp |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['perplexity']:.4f} | {100 * (r['perplexity'] / ref - 1):+.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
