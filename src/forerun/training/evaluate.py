"""``forerun eval-draft``: how well a trained head predicts the target on a set of prompts.

The target answers every prompt greedily (n-gram speculation makes that faster and changes
nothing); then, teacher-forced on those answers, the head's top-1 agreement per position ahead,
its top-k hit rate (what a token tree can catch) and the share of answer tokens its draft
vocabulary holds at all are counted per category. No draft is verified, so this is far cheaper
than a benchmark and says why a head falls short: tokens it cannot name, or tokens it ranks wrong.
"""

from __future__ import annotations

import time

import torch

from forerun.errors import ForerunError


def evaluate_head(target, head, prompts: list[dict], *, max_new_tokens: int = 128, steps: int = 4, top_k: int = 8,
                  log=print) -> dict:
    """``prompts``: dicts with ``text`` and ``category`` (as ``bench.load_prompts`` returns them)."""
    from forerun.training.data import Sequence, greedy_answers
    from forerun.training.trainer import TrainConfig, Trainer, extract_features

    be = target.backend
    if not hasattr(be, "embed"):
        raise ForerunError("eval-draft reads the target's hidden states: it needs the torch backend on a Gemma 3 model")
    if steps < 1 or top_k < 1 or max_new_tokens < 1:
        raise ForerunError("--steps, --top-k and --max-new-tokens must be >= 1")
    if head.cfg.kind == "medusa" and steps > head.cfg.medusa_heads:
        steps = head.cfg.medusa_heads  # one position per Medusa head
    t0 = time.time()
    seqs, cats = [], []
    answers = greedy_answers(target, [p["text"] for p in prompts], max_new_tokens=max_new_tokens, desc="target answers")
    for p, (_, ids, out) in zip(prompts, answers):
        if out:
            seqs.append(Sequence(ids + out, len(ids)))
            cats.append(p["category"])
    if not seqs:
        raise ForerunError("the target answered no prompt with a token")
    answers_s = time.time() - t0
    trainer = Trainer(TrainConfig(kind=head.cfg.kind, steps_ahead=steps), be.embed, float(be.embed_scale),
                      be.lm_head.weight, be.final_norm, be.num_layers, feature_layers=list(head.cfg.feature_layers))
    examples = extract_features(be, seqs, list(head.cfg.feature_layers), None, log=log)
    head = head.to(be.device)
    vocab = set(head.draft_to_target.tolist())

    def row(group, hits, total, hits_k):
        labels = [t for e in group for t in e.ids[max(e.start, 1):].tolist()]
        return {"prompts": len(group), "answer_tokens": len(labels),
                "draft_vocab_coverage": round(sum(t in vocab for t in labels) / max(len(labels), 1), 4),
                "top1_per_position": [round(x, 4) for x in (hits / total.clamp(min=1)).tolist()],
                f"top{top_k}_per_position": [round(x, 4) for x in (hits_k / total.clamp(min=1)).tolist()]}

    rows, sums = {}, [0, 0, 0]  # sums: the categories' counts, for the "all" row
    for cat in dict.fromkeys(cats):
        group = [e for e, c in zip(examples, cats) if c == cat]
        counts = trainer.agreement_counts(head, group, top_k)
        sums = [a + b for a, b in zip(sums, counts)]
        rows[cat] = row(group, *counts)
    rows["all"] = row(examples, *sums)
    return {"head": head.cfg.kind, "draft_vocab": head.cfg.draft_vocab, "max_new_tokens": max_new_tokens, "top_k": top_k,
            "seconds": {"answers": round(answers_s, 1), "total": round(time.time() - t0, 1)}, "categories": rows}


def format_report(report: dict) -> str:
    k = report["top_k"]
    lines = [f"| category | prompts | answer tokens | in draft vocab | top-1 per position ahead | top-{k}, position 1 |",
             "|---|---|---|---|---|---|"]
    for cat, r in report["categories"].items():
        name = f"**{cat}**" if cat == "all" else cat
        lines.append(f"| {name} | {r['prompts']} | {r['answer_tokens']} | {r['draft_vocab_coverage']:.3f} | "
                     + " ".join(f"{x:.2f}" for x in r["top1_per_position"])
                     + f" | {r[f'top{k}_per_position'][0]:.2f} |")
    return "\n".join(lines)
