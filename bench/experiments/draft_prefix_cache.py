"""A chat's second turn served with a draft model: what the earlier turn left in the caches.

A chat's next request repeats every earlier turn. Without the keeping of finished requests, the
server's prefix cache gave the target back only the earlier prompt's whole chunks (the answer was
computed again), and a draft model read everything again before it drafted, and where that reading
would not repay itself (``DraftLength.worth_reading``) did not draft at all. This runs two-turn
Spec-Bench questions through the server's engine (``Setup.batch_engine``, one request at a time,
greedy): turn 1, then turn 2 with turn 1's answer in its prompt, once as the server runs now (the
draft model's own prefix cache; finished requests' chunks kept, the target's where
``kv_any_pass``) and once without either (``--without draft``: without the draft model's cache
only), alternating, each on a fresh engine, and reports turn 2's time to first token and whole
time, and what its draft model drafted. Every output is checked equal between the two.

    python bench/experiments/draft_prefix_cache.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --prompts ../shared/data/spec_bench/question.jsonl --limit-per-category 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    import forerun.batching as batching
    from forerun.batching import BatchRequest
    from forerun.build import Options, build
    from forerun.chat import chat_ids

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", required=True, help="Spec-Bench's question.jsonl (its two-turn questions are used)")
    ap.add_argument("--limit-per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--first-answer-tokens", type=int, default=None,
                    help="turn 1's answer at most this long (default: --max-new-tokens): a longer chat history")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--without", choices=("both", "draft"), default="both",
                    help="what the other run goes without: the draft model's cache and the target's keeping of "
                         "answers (both), or the draft model's cache only (draft)")
    ap.add_argument("--out", default=None, help="a JSON file of the figures")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    rows = [json.loads(line) for line in open(args.prompts)]
    per: dict[str, int] = {}
    questions = []
    for r in rows:
        if len(r.get("turns", [])) == 2 and per.get(r["category"], 0) < args.limit_per_category:
            per[r["category"]] = per.get(r["category"], 0) + 1
            questions.append(r)
    setup = build(Options(model=args.model, draft=args.draft, method="draft", threads=args.threads, serving=True))
    tok = setup.target.tokenizer

    def serve(eng, prompt, n=args.max_new_tokens):
        req = BatchRequest(prompt=prompt, max_new_tokens=n)
        out, first = [], []
        req.on_event = lambda toks, fin: (first or (toks and first.append(time.perf_counter())), out.extend(toks))
        t0 = time.perf_counter()
        eng.submit(req)
        while eng.active or eng.waiting:
            eng.step()
        return out, time.perf_counter() - t0, req.stats, first[0] - t0

    keep = batching.keep_chunks
    results = []
    for n, q in enumerate(questions):
        one = {"category": q["category"]}
        outs = {}
        for cached in ((True, False) if n % 2 == 0 else (False, True)):  # alternating, so drift spreads
            eng = setup.batch_engine(max_batch=4, prefix_cache_mb=512)
            if not cached:
                eng.drafter.prefix_cache = None
            batching.keep_chunks = keep if cached or args.without == "draft" else (lambda *a: 0)
            p1 = chat_ids(tok, [{"role": "user", "content": q["turns"][0]}])
            a1, t1, _, _ = serve(eng, p1, args.first_answer_tokens or args.max_new_tokens)
            answer = tok.decode(a1, skip_special_tokens=True)
            p2 = chat_ids(tok, [{"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": answer},
                                {"role": "user", "content": q["turns"][1]}])
            a2, t2, st, ttft = serve(eng, p2)
            cache = eng.drafter.prefix_cache
            key = "cached" if cached else "uncached"
            outs[key] = (a1, a2)
            one[key] = {"turn1_s": round(t1, 3), "turn2_s": round(t2, 3), "turn2_ttft_s": round(ttft, 3),
                        "turn2_prompt": len(p2), "turn2_tokens": len(a2),
                        "turn2_drafted": st.drafted, "turn2_accepted": st.accepted, "turn2_draft_s": round(st.draft_s, 3),
                        "draft_cache_hit_positions": cache.hit_positions if cache is not None else 0}
        one["equal"] = outs["cached"] == outs["uncached"]
        results.append(one)
        c, u = one["cached"], one["uncached"]
        print(f"{n + 1}/{len(questions)} {q['category']}: turn 2 prompt {c['turn2_prompt']} tokens; first token "
              f"{c['turn2_ttft_s']:.2f} s against {u['turn2_ttft_s']:.2f} s; "
              f"turn 2 {c['turn2_s']:.2f} s with the draft's cache ({c['draft_cache_hit_positions']} positions from it, "
              f"drafted {c['turn2_drafted']}, took {c['turn2_accepted']}, drafting and reading {c['turn2_draft_s']:.2f} s) "
              f"against {u['turn2_s']:.2f} s without (drafted {u['turn2_drafted']}, took {u['turn2_accepted']}, "
              f"{u['turn2_draft_s']:.2f} s); equal {one['equal']}", flush=True)
    ratio = [r["uncached"]["turn2_s"] / r["cached"]["turn2_s"] for r in results]
    total = sum(r["uncached"]["turn2_s"] for r in results) / sum(r["cached"]["turn2_s"] for r in results)
    ttft = sum(r["uncached"]["turn2_ttft_s"] for r in results) / sum(r["cached"]["turn2_ttft_s"] for r in results)
    print(f"turn 2's first token: {ttft:.3f}x as soon; turn 2, time without over time with: total {total:.3f}, "
          f"median per question {statistics.median(ratio):.3f}; all equal: {all(r['equal'] for r in results)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"questions": results, "turn2_total_ratio": total, "turn2_ttft_ratio": ttft, "without": args.without},
                      f, indent=1)


if __name__ == "__main__":
    main()
