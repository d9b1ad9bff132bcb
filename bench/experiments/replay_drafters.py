"""Replay model-free drafters on recorded greedy outputs: exact acceptance, modelled time.

Greedy output is fixed by the target, so how far a draft is accepted depends only on the recorded
continuation. This script records the target's greedy outputs once, then runs the real ``Engine``
with a drafter against a backend that answers every verify pass from the recording and charges
each pass the verify cost a ``forerun bench`` run measured on this machine (its
``verify_cost_ratio``; a line through the measured ratios beyond K = 8). Drafting is charged its
real time. So drafters and their settings compare in seconds instead of a full benchmark each,
with no run-to-run noise; a benchmark run then confirms the choice.

    python bench/experiments/replay_drafters.py record --model bundled --limit-per-category 20 --out rec.jsonl
    python bench/experiments/replay_drafters.py replay rec.jsonl --costs bench/results/X/results.json \\
        [--limit-per-category 3] [--out replay.json]

``replay`` reports, for ``ngram:auto`` and ``suffix:auto`` over the recorded stream in prompt
order: modelled tokens/s, tau, the ratio to ``ngram:auto``, per category; how well the suffix
drafter's per-token estimates are calibrated; and two ceilings for any drafter that reads the
same stores: each drafter's chains cut exactly where the target would reject them (a perfect
K choice), and the best continuation of every earlier occurrence of the last token in both stores,
cut the same way (a perfect choice of what to draft as well).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time as _time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"


def record(args) -> None:
    from forerun.bench import load_prompts
    from forerun.chat import prompt_ids
    from forerun.drafters import make_drafter
    from forerun.engine import Engine
    from forerun.models import load_model
    from forerun.sampling import SamplingParams

    prompts = load_prompts(args.prompts, None, args.limit_per_category)
    target = load_model(args.model, backend="torch", threads=args.threads)
    # lossless: prompt lookup only makes the recording faster; the outputs are plain greedy decoding's
    engine = Engine(target.backend, make_drafter("ngram", target), target.eos_token_ids)
    limit = target.backend.max_context - args.max_new_tokens
    with open(args.out, "w") as f:
        for i, p in enumerate(prompts):
            ids = prompt_ids(target.tokenizer, p["text"], "auto")[-limit:]
            out = engine.generate(ids, max_new_tokens=args.max_new_tokens, params=SamplingParams(), k="auto").token_ids
            f.write(json.dumps({"id": p["id"], "category": p["category"], "prompt": ids, "out": out}) + "\n")
            print(f"{i + 1}/{len(prompts)} {p['category']}: {len(out)} tokens", file=sys.stderr)


class Clock:
    """``time`` for the engine: real time plus the modelled seconds of every replayed pass."""

    def __init__(self):
        self.extra = 0.0

    def perf_counter(self) -> float:
        return _time.perf_counter() + self.extra


class ReplayBackend:
    """Answers verify passes from one recorded sequence; each pass costs its modelled time."""

    def __init__(self, clock: Clock, step_s: float, ratios: dict[int, float]):
        from forerun.backends.base import Capabilities

        self.capabilities = Capabilities(exact_argmax=True)
        self.max_context = 1 << 20
        self.clock, self.step_s = clock, step_s
        ks = sorted(ratios)
        self.ratio = dict(ratios)
        self.ratio[0] = 1.0
        slope = (ratios[ks[-1]] - ratios[ks[len(ks) // 2]]) / (ks[-1] - ks[len(ks) // 2])
        self.beyond = (ks[-1], ratios[ks[-1]], slope)
        self.full: list[int] = []

    def load(self, full: list[int]) -> None:
        self.full = full

    def cost(self, k: int) -> float:
        top, r, slope = self.beyond
        return self.step_s * (self.ratio[k] if k in self.ratio else r + slope * (k - top))

    def reset(self) -> None:
        pass

    def truncate(self, n: int) -> None:
        pass

    def forward(self, tokens, pos, **kw):  # the prefill: not part of the comparison
        return None

    def argmax_forward(self, feed: torch.Tensor, root: int) -> torch.Tensor:
        start = _time.perf_counter()
        n = len(feed)
        ids = self.full[root + 1: root + 1 + n]
        ids = ids + [0] * (n - len(ids))
        self.clock.extra += self.cost(n - 1) - (_time.perf_counter() - start)
        return torch.tensor(ids, dtype=torch.long)


def load_records(path: str, limit: int | None) -> list[dict]:
    recs, seen = [], collections.Counter()
    for line in open(path):
        r = json.loads(line)
        if limit is None or seen[r["category"]] < limit:
            seen[r["category"]] += 1
            recs.append(r)
    return recs


def replay_run(recs, drafter, backend: ReplayBackend, clock: Clock, k="auto", on_round=None) -> dict:
    """Tokens/s (modelled), tau and per category for one drafter over the stream, in order."""
    from forerun.engine import Engine
    from forerun.sampling import SamplingParams

    engine = Engine(backend, drafter, ())
    total = collections.defaultdict(float)
    cats: dict[str, collections.defaultdict] = {}
    for r in recs:
        full = r["prompt"] + r["out"]
        backend.load(full)
        res = engine.generate(r["prompt"], max_new_tokens=len(r["out"]), params=SamplingParams(), k=k)
        assert res.token_ids == r["out"], "a replay must reproduce the recording"
        s = res.stats
        secs = s.draft_s + s.verify_s
        for d in (total, cats.setdefault(r["category"], collections.defaultdict(float))):
            d["tokens"] += s.new_tokens
            d["seconds"] += secs
            d["passes"] += s.target_passes

    def summary(d):
        return {"tokens_per_s": d["tokens"] / d["seconds"], "tau": d["tokens"] / d["passes"]}

    return {**summary(total), "by_category": {c: summary(d) for c, d in cats.items()}}


def _clock_engine(clock: Clock):
    import forerun.engine as engine_module

    engine_module.time = clock  # the engine times its rounds with this clock


class CutOracle:
    """A drafter's chains cut exactly where the target rejects them (ceiling for choosing K)."""

    cheap_proposals = False
    feature_layers = ()

    def __init__(self, inner, backend: ReplayBackend):
        self.inner, self.backend = inner, backend

    def begin(self, prompt, params, generator):
        self.inner.begin(prompt, params, generator)

    def accepted(self, tokens, n):
        self.inner.accepted(tokens, n)

    def take_features(self, pos, feats):
        pass

    def propose(self, tokens, k):
        from forerun.drafters.base import Draft

        draft = self.inner.propose(tokens, k).tokens.tolist()
        return Draft(tokens=torch.tensor(_agreeing(draft, self.backend.full, len(tokens)), dtype=torch.long))


class OccurrenceOracle(CutOracle):
    """The best continuation of every occurrence of the last token, in the request's own context and
    in earlier outputs, cut where the target rejects it (ceiling for drafting from these stores)."""

    def propose(self, tokens, k):
        from forerun.drafters.base import Draft

        d, best = self.inner, []
        stores = ((d.local, None), (d.history.index, d.out_sid))
        for idx, exclude in stores:
            for _, sid, pos in idx.occurrences(tokens, d.max_match, None, exclude=exclude):
                run = _agreeing(idx.continuation(sid, pos, k), self.backend.full, len(tokens))
                if len(run) > len(best):
                    best = run
        return Draft(tokens=torch.tensor(best, dtype=torch.long))


def _agreeing(draft: list[int], full: list[int], at: int) -> list[int]:
    n = 0
    while n < len(draft) and at + n < len(full) and draft[n] == full[at + n]:
        n += 1
    return draft[:n]


def calibration(recs, backend, clock) -> list[dict]:
    """The suffix drafter's per-token estimates against how often the target took those tokens."""
    from forerun.drafters.suffix import SuffixDrafter

    bins = collections.defaultdict(lambda: [0, 0.0, 0])

    class Watched(SuffixDrafter):
        def propose(self, tokens, k):
            d = super().propose(tokens, k)
            self.shown = (len(tokens), d.tokens.tolist(), d.conf or [])
            return d

        def accepted(self, tokens, n):
            shown = getattr(self, "shown", None)
            if shown:
                at, toks, conf = shown
                for t, c, p in zip(toks, tokens[at:], conf):
                    b = bins[min(int(p * 10), 9)]
                    b[0] += 1
                    b[1] += p
                    b[2] += t == c
                    if t != c:
                        break
            self.shown = None
            super().accepted(tokens, n)

    replay_run(recs, Watched(), backend, clock)
    return [{"bin": f"{b / 10:.1f}-{(b + 1) / 10:.1f}", "tokens": n, "predicted": round(s / n, 3), "taken": round(h / n, 3)}
            for b, (n, s, h) in sorted(bins.items())]


def replay(args) -> None:
    from forerun.drafters.ngram import NgramDrafter
    from forerun.drafters.suffix import SuffixDrafter

    costs = json.load(open(args.costs))["verify_cost_ratio"]
    ratios = {int(k): v for k, v in costs.items() if k.isdigit()}
    clock = Clock()
    _clock_engine(clock)
    backend = ReplayBackend(clock, costs["step_ms"] / 1000, ratios)
    recs = load_records(args.records, args.limit_per_category)
    runs = {
        "ngram:auto": replay_run(recs, NgramDrafter(), backend, clock),
        "suffix:auto": replay_run(recs, SuffixDrafter(), backend, clock),
        "ceiling: ngram cut perfectly": replay_run(recs, CutOracle(NgramDrafter(), backend), backend, clock, k=16),
        "ceiling: suffix cut perfectly": replay_run(recs, CutOracle(SuffixDrafter(), backend), backend, clock, k=16),
        "ceiling: best occurrence, cut perfectly": replay_run(recs, OccurrenceOracle(SuffixDrafter(), backend), backend,
                                                              clock, k=16),
    }
    base = runs["ngram:auto"]["tokens_per_s"]
    plain = 1.0 / backend.cost(0)
    report = {"records": args.records, "prompts": len(recs), "limit_per_category": args.limit_per_category,
              "costs": args.costs, "plain_tokens_per_s": plain, "runs": runs,
              "suffix_calibration": calibration(recs, backend, clock)}
    print(f"{len(recs)} prompts; plain decoding {plain:.1f} tokens/s (modelled)")
    print(f"{'method':42s} {'tokens/s':>9s} {'vs ngram:auto':>14s} {'tau':>6s}")
    for name, r in runs.items():
        print(f"{name:42s} {r['tokens_per_s']:9.1f} {r['tokens_per_s'] / base:13.3f}x {r['tau']:6.2f}")
    print("suffix:auto by category (tokens/s vs ngram:auto, tau):")
    for c, r in runs["suffix:auto"]["by_category"].items():
        b = runs["ngram:auto"]["by_category"][c]
        print(f"  {c:16s} {r['tokens_per_s'] / b['tokens_per_s']:.3f}x  tau {r['tau']:.2f} (ngram:auto {b['tau']:.2f})")
    print("suffix estimates: predicted vs taken")
    for row in report["suffix_calibration"]:
        print(f"  {row['bin']}: {row['tokens']:6d} tokens, predicted {row['predicted']:.3f}, taken {row['taken']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record the target's greedy outputs on Spec-Bench prompts")
    r.add_argument("--model", default="bundled")
    r.add_argument("--prompts", default=str(PROMPTS))
    r.add_argument("--limit-per-category", type=int, default=20)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--out", required=True)
    p = sub.add_parser("replay", help="replay ngram:auto, suffix:auto and ceilings on a recording")
    p.add_argument("records")
    p.add_argument("--costs", required=True, help="a forerun bench results.json of the same model and machine")
    p.add_argument("--limit-per-category", type=int, default=None)
    p.add_argument("--out")
    args = ap.parse_args()
    record(args) if args.cmd == "record" else replay(args)


if __name__ == "__main__":
    main()
