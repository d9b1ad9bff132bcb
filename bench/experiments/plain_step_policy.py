"""The draft-length policy's plain step, paired: timed before drafting is weighed against it, against the old rule.

Until 2026-12-01 a sequence decoding alone never timed a one-token step where its drafter drafted
from the first round (a draft model): the step every choice is weighed against was a line drawn
from the multi-row passes, and its refresh counted choices within one request only. ``Old``
restores that rule over the current class (everything else shared); one engine over the Qwen pair
decodes every prompt under both, alternating which goes first, each keeping its own chain of
policies across requests. Prints tokens per second of whole requests, the draft lengths chosen,
the pass costs each policy measured, and whether the outputs are equal.

    python bench/experiments/plain_step_policy.py bench/data/code_completions.jsonl off 12
    python bench/experiments/plain_step_policy.py ../shared/data/spec_bench/question.jsonl on 2   # 2 a category
"""
import json
import sys
import time

import torch

from forerun.build import Options, build
from forerun.chat import prompt_ids
from forerun.draft_length import DraftLength

torch.set_num_threads(2)

class Old(DraftLength):
    """The rule before: a one-row pass never timed is priced by interpolation, never forced; the
    refresh's clock starts afresh with every request. The rest of the class is shared (the pass of
    one draft timed first, and the pass priced no dearer than a longer one, are in both)."""

    def choose(self, available, buckets, confs=None, charge_drafting=False):
        pts = self.costs["pass"]
        guess = pts.get(1) is None and self.cost(1) is not None and self.fixed is None
        if guess:
            pts[1] = self.cost(1)
        try:
            return super().choose(available, buckets, confs, charge_drafting)
        finally:
            if guess:
                pts[1] = None

    def renewed(self, k):
        new = super().renewed(k)
        new.__class__ = Old
        new._clock, new._seen = 0, {}
        return new


def main():
    prompts, chat, n = sys.argv[1], sys.argv[2] == "on", int(sys.argv[3])
    setup = build(Options(model="qwen2.5-coder-1.5b", method="draft", backend="torch", threads=2))
    t = setup.target
    eng = setup.engine()
    rows = [json.loads(line) for line in open(prompts)]
    if "category" in rows[0] and len({r["category"] for r in rows}) > 1:
        by = {}
        for r in rows:
            by.setdefault(r["category"], []).append(r)
        rows = [r for c in by.values() for r in c[:n]]
    else:
        rows = rows[:n]
    ids = [prompt_ids(t.tokenizer, r["turns"][0]) if chat else t.tokenizer.encode(r["turns"][0]) for r in rows]
    pols = {"new": DraftLength(refresh_every=256), "old": Old()}
    res = {k: [0, 0.0] for k in pols}
    ks = {k: [] for k in pols}
    eq = 0
    for i, p in enumerate(ids):
        outs = {}
        for name in (("new", "old") if i % 2 == 0 else ("old", "new")):
            eng.policy = eng.decoder.policy = pols[name]
            s = time.perf_counter()
            o = eng.generate(p, max_new_tokens=128, k="auto")
            res[name][1] += time.perf_counter() - s
            res[name][0] += len(o.token_ids)
            pols[name] = eng.policy
            outs[name] = o.token_ids
            ks[name] += o.stats.k_history
        eq += outs["new"] == outs["old"]
    for k, (tok, sec) in res.items():
        print(k, round(tok / sec, 2), "tok/s", tok, round(sec, 2))
    import collections
    for k, h in ks.items():
        print(k, "passes", len(h), "drafted", sum(h), "hist", sorted(collections.Counter(h).items()))
    for k, p in pols.items():
        costs = {r: v and round(v * 1000, 1) for r, v in sorted(p.costs["pass"].items())}
        print(k, "pass ms", costs, "draft ms", round(p.draft_cost * 1000, 2))
    print("equal", eq, len(ids), "ratio new/old", round((res["new"][0] / res["new"][1]) / (res["old"][0] / res["old"][1]), 3))


if __name__ == "__main__":
    main()
