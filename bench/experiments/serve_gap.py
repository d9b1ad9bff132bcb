"""Where the server's speed goes at one client: the engine against the server's batch engine, paired.

``forerun bench`` decodes a request with ``Engine`` on the target's own cache; ``forerun serve``
runs the same decode step through ``BatchEngine`` (a slot's fork of the cache, the server's
policy settings, its prompt read in the prefix cache's chunks), on the main thread, with HTTP on
another. This loads the setup once and decodes every prompt three ways, the order rotating prompt
by prompt: ``engine`` (the bench's path), ``batch`` (the server's engine built as ``forerun
serve`` builds it, stepped on this thread, no HTTP) and, with ``--http``, ``served`` (the real
service in this process: uvicorn on a thread, one streaming client). Every output is checked
equal across them. Tokens per second count from the request to its last token, prompt included.

    python bench/experiments/serve_gap.py --prompts bench/data/code_completions.jsonl --method draft --http
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch


def main() -> None:
    from forerun.batching import BatchRequest
    from forerun.build import Options, build
    from forerun.sampling import SamplingParams
    from forerun.server.run import build_service

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--method", default="draft")
    ap.add_argument("--draft-lookup", default=None, choices=["ngram", "suffix"],
                    help="method draft: a model-free chain beside the model (as serve's --draft-lookup)")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--http", action="store_true", help="also through the real service (uvicorn, one client)")
    ap.add_argument("--out", default=None, help="a JSON file for the figures")
    args = ap.parse_args()

    torch.set_num_threads(2)
    setup = build(Options(model=args.model, method=args.method, backend="torch", threads=2,
                          draft_lookup=args.draft_lookup))
    target = setup.target
    service = build_service(setup, max_batch=args.max_batch, progress=True)
    batch = service.engine
    engine = setup.engine()
    rows = [json.loads(line) for line in open(args.prompts)][: args.limit]
    ids = [target.tokenizer.encode(r["turns"][0]) for r in rows]
    greedy = SamplingParams()

    def shown(tokens):  # the text as the server sends it
        return target.tokenizer.decode(tokens, skip_special_tokens=True)

    def run_engine(text, p):
        t = time.perf_counter()
        out = engine.generate(p, max_new_tokens=args.max_new_tokens, params=greedy, k="auto")
        return len(out.token_ids), shown(out.token_ids), time.perf_counter() - t, out.stats

    def run_batch(text, p):
        got = []
        req = BatchRequest(list(p), args.max_new_tokens, greedy, on_event=lambda toks, fin: got.extend(toks))
        t = time.perf_counter()
        batch.submit(req)
        while batch.n_running or batch.n_waiting:
            batch.step()
        return len(got), shown(got), time.perf_counter() - t, req.stats

    ways = {"engine": run_engine, "batch": run_batch}
    if args.http:
        ways["served"] = _served(service, args.max_new_tokens)
    names = list(ways)
    res = {n: [0, 0.0] for n in names}
    per = {n: [] for n in names}
    stats = {n: {"draft_s": 0.0, "verify_s": 0.0, "passes": 0, "drafted": 0, "accepted": 0} for n in names}
    run_engine(None, ids[0][:32])  # warm-up (first pass of each row count; the policy's first costs)
    run_batch(None, ids[0][:32])
    equal = 0
    texts = [r["turns"][0] for r in rows]
    for i, (text, p) in enumerate(zip(texts, ids)):
        order = names[i % len(names):] + names[: i % len(names)]
        outs = {}
        for n in order:
            count, outs[n], s, st = ways[n](text, p)
            res[n][0] += count
            res[n][1] += s
            per[n].append(count / s)
            if st is not None:
                for f, got in (("draft_s", st.draft_s), ("verify_s", st.verify_s), ("passes", st.target_passes),
                               ("drafted", st.drafted), ("accepted", st.accepted)):
                    stats[n][f] += got
        ref = outs["engine"]
        same = all(o == ref for o in outs.values())
        equal += same
        if not same:
            for n, o in outs.items():
                print(f"  differs: {n}: {o!r}", flush=True)
        print(f"prompt {i}: " + "  ".join(f"{n} {per[n][-1]:.1f}/s" for n in names), flush=True)
    summary = {n: {"tokens_per_s": res[n][0] / res[n][1], "median_per_prompt": statistics.median(per[n]), **stats[n]}
               for n in names}
    for n in names:
        s = summary[n]
        print(f"{n:7s} {s['tokens_per_s']:6.1f} tok/s (median {s['median_per_prompt']:.1f}), passes {s['passes']}, "
              f"drafted {s['drafted']}, accepted {s['accepted']}, draft {s['draft_s']:.2f} s, verify {s['verify_s']:.2f} s")
    print(f"outputs equal across ways: {equal}/{len(ids)}")
    if args.out:
        json.dump({"args": vars(args), "summary": summary, "equal": equal, "prompts": len(ids),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, open(args.out, "w"), indent=1)


def _served(service, max_new_tokens):
    """The service on uvicorn (a thread, as ``forerun serve`` runs HTTP) with the engine stepping on
    this thread while ``forerun loadtest``'s client streams one request: a function decoding one
    prompt that way (its token count from the stream's usage chunk)."""
    import uvicorn

    from forerun.server.app import create_app
    from forerun.server.loadtest import _Client

    config = uvicorn.Config(create_app(service, engine_thread=False), host="127.0.0.1", port=8019, log_level="warning")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    engine = service.engine

    def run(text, p):
        box = {}

        def client():
            box["reply"] = _Client("http://127.0.0.1:8019", None).stream(
                {"model": service.name, "prompt": text, "max_tokens": max_new_tokens, "temperature": 0,
                 "stream": True, "stream_options": {"include_usage": True}}, timeout=600)
            box["done"] = time.perf_counter()

        t = time.perf_counter()
        th = threading.Thread(target=client)
        th.start()
        engine.run(until=lambda: "done" in box)
        th.join()
        reply = box["reply"]
        if reply.get("status") != 200 or "text" not in reply:
            raise SystemExit(f"the served request failed: {reply}")
        return reply["tokens"], reply["text"], box["done"] - t, None

    return run


if __name__ == "__main__":
    main()
