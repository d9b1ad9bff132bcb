"""Would a draft model's tree pay: its second choice as a sibling where the draft is unsure.

A chain drafted by a small model is cut where the target disagrees; the target's own token there
is committed anyway. A tree that also carries the draft's runner-up at a position gains one token
(the target's token after that sibling) exactly where the chain is rejected at that position and
the runner-up is the target's token, and it pays one more verify row for it.

Greedy output is fixed by the target, so this is measured exactly, offline: the target's greedy
continuation of each prompt is recorded, then at every position of it the draft model (as
``--method draft`` runs it: 4-bit layers, cut head) drafts ``--k-max`` tokens greedily from the
true context, keeping its top two tokens and their probabilities at each step. Rounds of any
policy are then replayed over the recording (each starts where the last one's commits end), and
each round is charged the costs measured in the same process: a draft step over a target step,
and a verify pass of n rows over a one-row pass (both at the prompts' contexts). Trees are
charged as chains of as many rows (their masks cost nothing extra here), so the tree figures are
a ceiling.

    python bench/experiments/draft_tree_ceiling.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --prompts bench/data/code_completions.jsonl --chat off
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def three_bit_draft() -> None:
    """From here on a draft model's re-coding (``requantize_4bit``) puts every weight part at 3-bit
    codes (``q4_0_codes(bits=3)``: -4..3 times a float16 scale per 32 weights, rounded to nearest),
    held in Q4_0 blocks: the draft's acceptance as a 3-bit draft would have it, its steps still
    reading 4-bit bytes."""
    import forerun.backends.qweights as qw
    from forerun.backends.block_weights import q4_0_codes

    def requantized(self):
        out = qw.QLinear([qw.QPart(q4_0_codes(p.dequantize(), bits=3), qw.Q4_0) for p in self.parts])
        out.set_wide(self.parts[0].wide)
        return out

    qw.QLinear.requantized = requantized


def record(target, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """The target's greedy continuation of ``ids``, up to ``n`` tokens (eos included)."""
    b = target.backend
    b.reset()
    tok = int(b.argmax_forward(torch.tensor(ids), 0).ids[-1])
    out = [tok]
    while len(out) < n and tok not in eos:
        tok = int(b.argmax_forward(torch.tensor([tok]), len(ids) + len(out) - 1).ids[-1])
        out.append(tok)
    return out


def draft_everywhere(db, head, vocab, ids: list[int], ref: list[int], k_max: int) -> list[list[tuple]]:
    """For every start i of ``ref``: the draft's greedy chain of ``k_max`` tokens after ids + ref[:i],
    as (top-1 token, its probability, runner-up token, its probability) per step."""
    db.reset()
    out = []
    for i in range(len(ref)):
        ctx = ids + ref[:i]
        db.truncate(min(db.length, len(ctx) - 1))
        feed, pos, steps = torch.tensor(ctx[db.length:]), db.length, []
        for _ in range(k_max):
            logits = db.forward(feed, pos, last_only=True, head=head).logits[-1]
            p = torch.softmax(logits.float(), -1)
            top = torch.topk(p, 2)
            t1, t2 = int(vocab[top.indices[0]]), int(vocab[top.indices[1]])
            steps.append((t1, float(top.values[0]), t2, float(top.values[1])))
            pos += feed.numel()
            feed = torch.tensor([t1])
        out.append(steps)
    return out


def timed(fn, reps: int) -> float:
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def measure_reading(target, db, head, ids: list[int], reps: int) -> float:
    """The draft model's reading of a prompt, per token, over the target's one-row pass after it."""
    b, L = target.backend, len(ids)
    b.reset()
    b.argmax_forward(torch.tensor(ids), 0)
    feed = torch.tensor(ids[-1:])

    def step():
        b.truncate(L)
        b.argmax_forward(feed, L)

    def read():
        db.reset()
        db.forward(torch.tensor(ids), 0, last_only=True, head=head)

    reading = statistics.median([timed(read, 1) for _ in range(max(3, reps // 2))])
    return reading / L / timed(step, reps)


def measure_costs(target, db, head, ids: list[int], rows_max: int, reps: int) -> tuple[float, dict[int, float]]:
    """(draft step / target step, {n: pass of n rows / one-row pass}) at the context of ``ids``."""
    b, L = target.backend, len(ids)
    b.reset()
    b.argmax_forward(torch.tensor(ids), 0)
    db.reset()
    db.forward(torch.tensor(ids), 0, last_only=True, head=head)
    feeds = {n: torch.tensor(ids[-n:]) for n in range(1, rows_max + 1)}

    def target_pass(n):
        b.truncate(L)
        b.argmax_forward(feeds[n], L)

    def draft_step():
        db.truncate(L)
        db.forward(feeds[1], L, last_only=True, head=head)

    times = {n: [] for n in feeds}
    drafts = []
    for _ in range(3):  # rounds alternate, so a drift of the machine's speed spreads over every width
        for n in feeds:
            times[n].append(timed(lambda: target_pass(n), reps))
        drafts.append(timed(draft_step, reps))
    one = statistics.median(times[1])
    return statistics.median(drafts) / one, {n: statistics.median(t) / one for n, t in times.items()}


def replay(chains, ref: list[int], pick, d: float, rows_cost) -> tuple[int, int, int, int, float]:
    """Rounds over one recording: (tokens, rounds, draft steps, verify rows, time in one-row passes).
    ``pick(steps, truth)`` (truth: the target's tokens there, read by the oracle only) -> (chain
    length K, draft steps run, the positions that carry the runner-up as a sibling: j < K beside the
    chain's token j, or K itself: the position past the chain, whose logits the draft computed to
    stop there, as two leaves, its top-1 and runner-up)."""
    i = tokens = rounds = dsteps = rows = 0
    cost = 0.0
    while i < len(ref):
        steps = chains[i]
        k, ran, sib = pick(steps, ref[i:i + len(steps)])
        a = 0
        while a < k and i + a < len(ref) and steps[a][0] == ref[i + a]:
            a += 1
        got = a + 1  # the accepted tokens and the target's own
        if a < len(steps) and a in sib and i + a < len(ref) and ref[i + a] in (steps[a][2], steps[a][0]):
            got = a + 2  # a leaf at the rejected position (or past the chain) taken, and the target's token after it
        got = min(got, len(ref) - i)
        n_rows = 1 + k + sum(2 if j == k else 1 for j in sib)
        tokens, i, rounds, dsteps, rows = tokens + got, i + got, rounds + 1, dsteps + ran, rows + n_rows
        cost += ran * d + rows_cost(n_rows)
    return tokens, rounds, dsteps, rows, cost


def policies(k_max: int) -> dict:
    """Chains of fixed length and confidence-stopped chains, each with its tree variants."""
    def oracle(s, truth):  # every chain cut exactly where the target rejects it: no chain policy does better
        k = next((j for j in range(len(truth)) if s[j][0] != truth[j]), len(truth))
        return k, k, set()

    out = {"oracle: cut where the target rejects": oracle}
    for k in range(1, k_max + 1):
        out[f"chain k={k}"] = lambda s, t, k=k: (k, k, set())
        out[f"chain k={k} + sibling at its least sure"] = lambda s, t, k=k: (
            k, k, {min(range(k), key=lambda j: s[j][1])})
        out[f"chain k={k} + siblings where p1 < 0.5"] = lambda s, t, k=k: (
            k, k, {j for j in range(k) if s[j][1] < 0.5})
    for stop in (0.3, 0.5, 0.7, 0.9):
        def stopped(s, t=None, stop=stop, fork=False):
            k = next((j for j in range(len(s)) if s[j][1] < stop), len(s))
            ran = min(k + 1, len(s))  # the step that found the unsure token ran too
            return k, ran, ({k} if fork and k < len(s) else set())
        def through(s, t=None, stop=stop, sibling=False):  # the unsure token kept as the chain's last
            j = next((j for j in range(len(s)) if s[j][1] < stop), None)
            k = len(s) if j is None else j + 1
            return k, k, ({j} if sibling and j is not None else set())
        out[f"stop before p1 < {stop}"] = stopped
        out[f"stop after p1 < {stop}"] = through
        out[f"stop after p1 < {stop}, its runner-up beside it"] = lambda s, t, f=through: f(s, sibling=True)
        out[f"stop before p1 < {stop}, both top-2 as leaves there"] = lambda s, t, f=stopped: f(s, fork=True)
    return out


def main() -> None:
    from forerun.bench import load_prompts
    from forerun.build import Options, load_draft_model, load_target
    from forerun.chat import prompt_ids
    from forerun.drafters.draft_vocab import auto_draft_tokens, draft_vocabulary

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", default=str(ROOT / "bench" / "data" / "code_completions.jsonl"))
    ap.add_argument("--categories", default=None)
    ap.add_argument("--limit-per-category", type=int, default=None)
    ap.add_argument("--chat", default="off")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k-max", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None, help="a JSON file of the figures")
    ap.add_argument("--recording", default=None, help="a JSON file of the recorded drafts: written once, then read")
    ap.add_argument("--draft-bits", type=int, choices=(3, 4), default=4,
                    help="3: the draft's weights re-coded at 3 bits (its acceptance only: see three_bit_draft)")
    ap.add_argument("--draft-step-scale", type=float, default=1.0,
                    help="the timed draft step times this (e.g. 3.5 / 4.5: the bytes of 3-bit codes over 4-bit ones)")
    args = ap.parse_args()
    if args.draft_bits == 3:
        three_bit_draft()

    torch.set_num_threads(args.threads)
    opts = Options(model=args.model, draft=args.draft, method="draft", threads=args.threads)
    target = load_target(opts, ("draft",))
    dm = load_draft_model(opts, "torch")
    n_vocab = auto_draft_tokens(dm.backend.vocab_size, None)
    vocab = draft_vocabulary(dm.tokenizer, n_vocab) if n_vocab else torch.arange(dm.backend.vocab_size)
    db = dm.backend
    head = db.integer_sub_head(vocab) or db.sub_head(vocab)
    cats = args.categories.split(",") if args.categories else None
    prompts = load_prompts(args.prompts, cats, args.limit_per_category)
    eos = set(target.eos_token_ids)

    saved = Path(args.recording) if args.recording else None
    if saved is not None and saved.is_file():  # drafts recorded before: only the costs are timed again
        recs = [(r["ids"], r["ref"], r["chains"]) for r in json.loads(saved.read_text())]
    else:
        recs = []
        t0 = time.perf_counter()
        for n, p in enumerate(prompts):
            ids = prompt_ids(target.tokenizer, p["text"], args.chat)
            ref = record(target, ids, args.max_new_tokens, eos)
            chains = draft_everywhere(db, head, vocab, ids, ref, args.k_max)
            recs.append((ids, ref, chains))
            print(f"{n + 1}/{len(prompts)} {p['category']}: {len(ref)} tokens ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        if saved is not None:
            saved.write_text(json.dumps([{"ids": i, "ref": r, "chains": c} for i, r, c in recs]))
    mean_ctx = sum(len(ids) + len(ref) // 2 for ids, ref, _ in recs) // len(recs)
    ctx_ids = (recs[0][0] + recs[0][1])[:mean_ctx]
    d, v = measure_costs(target, db, head, ctx_ids, 2 * args.k_max + 3, args.reps)
    d *= args.draft_step_scale
    longest = max(recs, key=lambda r: len(r[0]))[0]
    read = measure_reading(target, db, head, longest, args.reps)
    print(f"draft reading a token of a prompt / target step {read:.4f} (at {len(longest)} tokens)")
    print(f"draft step / target step {d:.3f}; pass of n rows / one row: "
          + " ".join(f"{n}:{r:.2f}" for n, r in v.items()), flush=True)

    # How often the runner-up is the target's token where the top-1 is not, by the top-1's probability.
    miss = [(s[1], s[2] == ref[i + j]) for _, ref, chains in recs for i, steps in enumerate(chains)
            for j, s in enumerate(steps) if i + j < len(ref) and s[0] != ref[i + j]]
    bins = [(0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.01)]
    second = []
    for lo, hi in bins:
        hit = [h for p1, h in miss if lo <= p1 < hi]
        second.append({"p1": f"{lo:.1f}-{min(hi, 1.0):.1f}", "misses": len(hit),
                       "runner_up_right": round(sum(hit) / len(hit), 3) if hit else None})

    def rows_cost(r: int) -> float:  # beyond the widths timed: the last step's slope
        top = max(v)
        return v[r] if r in v else v[top] + (r - top) * (v[top] - v[top - 1])

    results = []
    for name, pick in policies(args.k_max).items():
        tok = rnd = ds = rw = 0
        cost = with_reading = chosen = 0.0
        for ids, ref, chains in recs:
            t, r, s, w, c = replay(chains, ref, pick, d, rows_cost)
            tok, rnd, ds, rw, cost = tok + t, rnd + r, ds + s, rw + w, cost + c
            with_reading += c + read * len(ids)  # the draft model reads the prompt before its first draft
            chosen += min(c + read * len(ids), len(ref))  # a request that would not repay it decodes plainly
        results.append({"policy": name, "tau": round(tok / rnd, 3), "rows_per_round": round(rw / rnd, 2),
                        "draft_steps_per_round": round(ds / rnd, 2), "speedup": round(tok / cost, 3),
                        "speedup_reading": round(tok / with_reading, 3), "speedup_chosen": round(tok / chosen, 3)})
    results.sort(key=lambda r: -r["speedup"])
    print("\nrunner-up right where the top-1 was wrong, by the top-1's probability:")
    for s in second:
        print(f"  p1 {s['p1']}: {s['misses']} misses, runner-up right {s['runner_up_right']}")
    print("\n| policy | tau | rows a round | draft steps a round | modelled speedup over plain | with the prompts "
          "read | reading only where it repays |\n|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['tau']:.2f} | {r['rows_per_round']:.2f} | {r['draft_steps_per_round']:.2f} "
              f"| {r['speedup']:.3f}x | {r['speedup_reading']:.3f}x | {r['speedup_chosen']:.3f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps({"draft_step": d, "draft_reading": read, "pass_rows": v, "runner_up": second,
                                              "policies": results, "prompts": len(recs)}, indent=1))


if __name__ == "__main__":
    main()
