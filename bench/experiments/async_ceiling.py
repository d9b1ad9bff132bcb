"""How much could drafting beside verification (asynchronous drafting) save on this machine?

Measures, for one model on the torch backend:
  1. the round's time split of synchronous speculation (eagle chain K=4 and an eagle tree of 32
     nodes, greedy, 128 tokens, a few Spec-Bench prompts): drafting vs verifying per pass;
  2. one verify pass (K=4, greedy, with the head's features) and one eagle draft of K=4, each alone
     at 2 and 1 threads, and both at once on two Python threads (torch ops and forerun's C kernels
     release the GIL; each thread sets its own thread count) for several thread splits.
The ceiling of asynchronous drafting is the drafting share of a round, if a concurrent draft cost
the verify pass nothing; part 2 shows what running them together costs.

Usage: python bench/experiments/async_ceiling.py --model bundled --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch


def round_split(target, prompts, tree, k=4, max_new=128) -> dict:
    from forerun.chat import prompt_ids
    from forerun.drafters import make_drafter
    from forerun.engine import Engine

    drafter = make_drafter("eagle", target, tree=tree)
    eng = Engine(target.backend, drafter, target.eos_token_ids)
    draft = verify = passes = new = 0.0
    for text in prompts:
        st = eng.generate(prompt_ids(target.tokenizer, text, "auto"), max_new_tokens=max_new, k=k).stats
        draft, verify, passes, new = draft + st.draft_s, verify + st.verify_s, passes + st.target_passes, new + st.new_tokens
    return {"draft_ms_per_pass": 1000 * draft / passes, "verify_ms_per_pass": 1000 * verify / passes,
            "draft_share": draft / (draft + verify), "tau": new / passes}


def pair_timings(target, secs: float) -> dict:
    from forerun.chat import prompt_ids
    from forerun.drafters import make_drafter

    be = target.backend
    head = make_drafter("eagle", target).head
    layers = tuple(head.cfg.feature_layers)
    text = "Summarize: " + " ".join(["The committee met on Tuesday to discuss the budget and approved the plan."] * 8)
    ids = prompt_ids(target.tokenizer, text, "auto")
    be.reset()
    be.forward(torch.tensor(ids[:-1]), 0, layers=layers, logits=False)
    pos = len(ids) - 1
    feed = torch.tensor(ids[-1:] + ids[5:9])
    with torch.inference_mode():
        feats = torch.randn(40, len(layers) * head.cfg.hidden_size) * 3
        g0, cache0 = head.step(be.embed[torch.tensor(ids[1:41])].float(), head.fuse_features(feats), 0, None)

    def verify_once():
        be.argmax_forward(feed, pos, layers=layers)
        be.truncate(pos)

    def draft_once(k=4):
        with torch.inference_mode():
            g, cache, p = g0[-1:], cache0, 40
            for i in range(k):
                tok = int(head.draft_to_target[head.logits(g[-1]).argmax()])
                if i + 1 < k:
                    g, cache = head.step(be.embed[tok].float().view(1, -1), g, p, cache)
                    p += 1

    def ms_per_call(fn, threads, stop=None):
        torch.set_num_threads(threads)
        fn()
        n, t0 = 0, time.perf_counter()
        while (stop is None and time.perf_counter() - t0 < secs) or (stop is not None and not stop.is_set()):
            fn()
            n += 1
        return 1000 * (time.perf_counter() - t0) / max(n, 1)

    out = {}
    for th in (2, 1):
        out[f"verify_alone_{th}t_ms"] = ms_per_call(verify_once, th)
        out[f"draft_alone_{th}t_ms"] = ms_per_call(draft_once, th)
    for vt, dt in ((2, 1), (1, 1), (2, 2)):
        stop, side = threading.Event(), {}
        th = threading.Thread(target=lambda: side.update(ms=ms_per_call(draft_once, dt, stop)))
        th.start()
        v = ms_per_call(verify_once, vt)
        stop.set()
        th.join()
        out[f"together_verify_{vt}t_draft_{dt}t"] = {"verify_ms": v, "draft_ms": side["ms"]}
    torch.set_num_threads(2)
    return out


def main() -> None:
    from forerun.bench import load_prompts, machine_info
    from forerun.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[3] / "shared/data/spec_bench/question.jsonl"))
    ap.add_argument("--categories", default="writing,math,summarization,coding")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target = load_model(args.model, backend="torch", threads=2)
    prompts = [p["text"] for p in load_prompts(args.prompts, args.categories.split(","), 1)]
    result = {"model": args.model, "machine": machine_info(torch.float32), "threads": 2,
              "chain_k4": round_split(target, prompts, None), "tree_32x6": round_split(target, prompts, (32, 6), k=6),
              "pair": pair_timings(target, args.seconds)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
