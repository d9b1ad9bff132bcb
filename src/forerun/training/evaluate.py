"""``forerun eval-draft``: how well a trained head predicts the target on a set of prompts.

The target answers every prompt greedily (n-gram speculation makes that faster and changes
nothing); then, teacher-forced on those answers, the head's top-1 agreement per position ahead,
its top-k hit rate (what a token tree can catch) and the share of answer tokens its draft
vocabulary holds at all are counted per category. No draft is verified, so this is far cheaper
than a benchmark and says why a head falls short: tokens it cannot name, or tokens it ranks wrong.

``--replay`` goes one step further: it runs the drafters of bench methods (chains, trees, the
lookup branch) on the same answers, reading acceptance off the known greedy answer, and so gives
the tau a greedy bench would measure, still without a verify pass.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from forerun.backends.base import ArgmaxOutput, Capabilities, ForwardOutput
from forerun.drafters import require_hidden_states
from forerun.drafters.head_training import TrainConfig, Trainer, extract_features
from forerun.engine import Engine
from forerun.errors import ForerunError
from forerun.stats import GenerationStats
from forerun.training.data import Sequence, greedy_answers
from forerun.tree import tree_layout


def evaluate_head(target, head, prompts: list[dict], *, max_new_tokens: int = 128, steps: int = 4, top_k: int = 8,
                  replay: dict | None = None, log=print) -> dict:
    """``prompts``: dicts with ``text`` and ``category`` (as ``bench.load_prompts`` returns them).
    ``replay``: method name -> (drafter, draft length) to replay on the same answers (greedy; see
    ``replay_generation``), reported as the tau and per-position acceptance a bench would measure."""
    be = target.backend

    require_hidden_states(target, "eval-draft")
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
    trainer = Trainer.of_target(TrainConfig(kind=head.cfg.kind, steps_ahead=steps), be.model,
                                feature_layers=list(head.cfg.feature_layers))
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
    report = {"head": head.cfg.kind, "draft_vocab": head.cfg.draft_vocab, "max_new_tokens": max_new_tokens,
              "top_k": top_k, "seconds": {"answers": round(answers_s, 1)}, "categories": rows}
    if replay:
        report["replay"] = replay_methods(target, replay, [(c, s.ids, s.start) for c, s in zip(cats, seqs)])
    report["seconds"]["total"] = round(time.time() - t0, 1)
    return report


def format_report(report: dict) -> str:
    k = report["top_k"]
    lines = [f"| category | prompts | answer tokens | in draft vocab | top-1 per position ahead | top-{k}, position 1 |",
             "|---|---|---|---|---|---|"]
    for cat, r in report["categories"].items():
        name = f"**{cat}**" if cat == "all" else cat
        lines.append(f"| {name} | {r['prompts']} | {r['answer_tokens']} | {r['draft_vocab_coverage']:.3f} | "
                     + " ".join(f"{x:.2f}" for x in r["top1_per_position"])
                     + f" | {r[f'top{k}_per_position'][0]:.2f} |")
    if report.get("replay"):
        lines += ["", "Replayed on the same answers:", "", format_replay(report["replay"])]
    return "\n".join(lines)


class RecordedTarget:
    """A target that answers from a recording: its greedy answer ``ids`` (prompt included) and the
    outputs of its feature layers in one pass over them (``feats`` [len(ids), ...]).

    Its argmax at a verify row is the recorded token after that row's position, and the row's
    features are the recorded position's: exact on the recorded path, which is all that greedy
    acceptance and the kept rows ever read. Driven by the ordinary engine, a drafter is replayed
    exactly as in a generation whose target gave this answer (same drafting, same acceptance, same
    rollback), without running the target again."""

    capabilities = Capabilities(exact_argmax=True, argmax_features=True, argmax_tree=True, token_trees=True)
    device = torch.device("cpu")

    def __init__(self, ids: list[int], feats: torch.Tensor | None):
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.feats = feats
        self.max_context = len(ids) + (1 << 20)  # no cache to fill: trees are never cut for room
        self.vocab_size = int(self.ids.max()) + 1

    def reset(self) -> None:
        pass

    def truncate(self, length: int) -> None:
        pass

    def keep_rows(self, root: int, rows) -> None:
        pass

    def forward(self, tokens: torch.Tensor, pos: int, *, layers=(), **kw) -> ForwardOutput:
        """The prefill: only the recorded features are read."""
        return ForwardOutput(logits=None, layers=self.feats[pos: pos + len(tokens)] if layers else None)

    def argmax_forward(self, tokens: torch.Tensor, pos: int, *, layers=(), tree=None):
        depth = torch.arange(len(tokens)) if tree is None else tree_layout(tree)[0]
        at = (pos + depth).clamp(max=len(self.ids) - 1)  # each row's position on the recorded path
        return ArgmaxOutput(self.ids[(at + 1).clamp(max=len(self.ids) - 1)], self.feats[at] if layers else None)


def replay_generation(drafter, ids: list[int], start: int, feats: torch.Tensor | None, k: int
                      ) -> tuple[list[int], list[int]]:
    """Tokens committed per verify pass, and the drafted depth per pass, of a greedy generation with
    draft length ``k`` whose target answers ``ids[start:]``: the engine runs as in any generation
    (``forerun.decode``), on a ``RecordedTarget`` instead of the model."""
    stats = GenerationStats()
    steps = Engine(RecordedTarget(ids, feats), drafter, ()).stream(
        list(ids[:start]), max_new_tokens=len(ids) - start, k=k, stats=stats)
    return [len(s.tokens) for s in steps], stats.k_history


def _add(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists of any lengths."""
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


@torch.inference_mode()
def replay_methods(target, drafters: dict, answers: list[tuple[str, list[int], int]]) -> dict:
    """Replayed tau and acceptance per position, per method and category. ``drafters``: method
    name -> (drafter, k); ``answers``: (category, prompt + greedy answer ids, prompt length)."""
    be = target.backend
    counts = {m: {} for m in drafters}  # method -> category -> counts
    for cat, ids, start in tqdm(answers, desc="replay", unit="prompt"):
        feats = {}  # one target pass per set of feature layers
        for m, (drafter, k) in drafters.items():
            layers = tuple(drafter.feature_layers)
            if layers not in feats:
                be.reset()
                feats[layers] = be.forward(torch.tensor(ids, dtype=torch.long), 0, layers=layers, logits=False).layers
            commits, depths = replay_generation(drafter, ids, start, feats[layers], k)
            c = counts[m].setdefault(cat, {"prompts": 0, "new_tokens": 0, "passes": 0, "drafted": [], "accepted": []})
            c["prompts"] += 1
            c["new_tokens"] += sum(commits)
            c["passes"] += len(commits)
            for n, d in zip(commits, depths):  # per depth: passes that drafted it, and that accepted it
                c["drafted"] = _add(c["drafted"], [1] * d)
                c["accepted"] = _add(c["accepted"], [1] * (n - 1))
    report = {}
    for m, cats in counts.items():
        total = {"prompts": 0, "new_tokens": 0, "passes": 0, "drafted": [], "accepted": []}
        for c in cats.values():
            total = {key: (_add(v, c[key]) if isinstance(v, list) else v + c[key]) for key, v in total.items()}
        report[m] = {cat: {"prompts": c["prompts"], "new_tokens": c["new_tokens"], "target_passes": c["passes"],
                           "tau": round(c["new_tokens"] / max(c["passes"], 1), 4),
                           "acceptance_per_position": [round(a / d, 4) for a, d in zip(c["accepted"], c["drafted"])]}
                     for cat, c in list(cats.items()) + [("all", total)]}
    return report


def format_replay(report: dict) -> str:
    methods = list(report)
    cats = list(report[methods[0]]) if methods else []
    lines = ["| category | " + " | ".join(f"{m} tau" for m in methods) + " |", "|---|" + "---|" * len(methods)]
    for cat in cats:
        name = f"**{cat}**" if cat == "all" else cat
        lines.append(f"| {name} | " + " | ".join(f"{report[m][cat]['tau']:.2f}" for m in methods) + " |")
    return "\n".join(lines)
