"""Self-speculation: the target drafts for itself with some layers skipped.

No extra weights: the draft runs the target's own layers minus a skipped set, with a KV
cache of its own (kept in step with the committed tokens, like an independent draft model).

Which layers to skip is chosen by measurement (``calibrate``): on text the target itself
generated, drop layers greedily, each time the one whose removal keeps the draft's
top-1 agreement with the target highest, and keep the set whose predicted speedup
(Leviathan et al. with the measured draft and verify costs) is best.

Optionally the draft predicts over a reduced vocabulary (the tokens of the context plus a
frequent-token list), since on small models the LM head dominates the cost of a step.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from importlib import resources
from pathlib import Path

import torch
from tqdm.auto import tqdm

from forerun import kept
from forerun.draft_length import expected_tokens
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.errors import ForerunError
from forerun.models import model_key
from forerun.timing import median_forward_s


class LayerSkipDrafter(DraftModelDrafter):
    name = "layerskip"
    batchable = False  # skipped layers and a per-sequence vocabulary: one sequence a pass
    stops_early = False  # planned as before (lengths first, charged per token): the token-by-token plan is measured on draft models only

    def __init__(self, backend, skip_layers, context_vocab: bool = True, extra_vocab=()):
        if not backend.capabilities.layer_skip:
            raise ForerunError("method layerskip needs a backend that can skip layers (the native backend)")
        bad = [i for i in skip_layers if not 0 <= i < backend.num_layers]
        if bad:
            raise ForerunError(f"layers {bad} out of range for a {backend.num_layers}-layer model")
        # Same weights, own KV cache: measured on the bundled model, the skipping model agrees with
        # the target more often reading its own keys/values than the target's exact ones.
        super().__init__(backend.fork())
        self.skip = tuple(sorted(set(skip_layers)))
        self.context_vocab = context_vocab
        self.extra_vocab = [int(t) for t in extra_vocab]

    def fork(self) -> LayerSkipDrafter:
        return LayerSkipDrafter(self.backend, self.skip, self.context_vocab, self.extra_vocab)

    def begin(self, prompt, params, generator):
        super().begin(prompt, params, generator)
        self._vocab: set[int] = set(self.extra_vocab)
        self._seen = 0
        self._map = self._head = None

    def _update_vocab(self, tokens: list[int]) -> None:
        """Draft vocabulary = every token of the context so far (plus ``extra_vocab``)."""
        fresh = set(tokens[self._seen :]) - self._vocab
        self._seen = len(tokens)
        if fresh or self._head is None:
            self._vocab |= fresh
            self._map = torch.tensor(sorted(self._vocab), dtype=torch.long, device=self.backend.device)
            self._head = self.backend.sub_head(self._map)

    def forward_kwargs(self, tokens: list[int]) -> dict:
        if not self.context_vocab:
            return {"skip_layers": self.skip}
        self._update_vocab(tokens)
        return {"skip_layers": self.skip, "head": self._head, "vocab_map": self._map}


CALIBRATION_PROMPTS = [
    "Write a short explanation of how a refrigerator keeps food cold.",
    "Summarize the main causes of the French Revolution in a few sentences.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Translate to German: The weather is nice today and we are going to the park.",
    "A train leaves at 3 pm and travels 60 miles per hour. How far has it gone by 5 pm? Explain.",
]


def _greedy(backend, ids: list[int], n: int) -> list[int]:
    """The target's own greedy continuation of ids (n tokens, one-token steps): what the drafter
    is measured against."""
    backend.reset()
    if len(ids) > 1:  # as the engine runs it: the prompt but its last token, then one-token steps
        backend.forward(torch.tensor(ids[:-1], device=backend.device), 0, logits=False)
    tok = int(backend.argmax_forward(torch.tensor(ids[-1:], device=backend.device), len(ids) - 1).ids[-1])
    out = [tok]
    for i in range(n - 1):
        tok = int(backend.argmax_forward(torch.tensor([tok], device=backend.device), len(ids) + i).ids[-1])
        out.append(tok)
    return out


@torch.inference_mode()
def calibrate(backend, tokenizer, *, new_tokens: int = 96, max_skip: int | None = None, extra_vocab=(), log=print,
              budget_s: float | None = 120.0, patience: int = 4, progress: bool = False) -> dict:
    """Choose the skipped layers by measurement. Returns a dict with the chosen set and the trace.

    Layers are added one at a time (the one whose skipping keeps the most agreement with the
    target), each set priced with the measured costs. The search stops when agreement falls below
    0.2, when the predicted speedup has not improved for ``patience`` rounds (skipping more only
    lowers agreement from there), or after ``budget_s`` seconds (the best set so far is kept).
    ``extra_vocab``: token ids the draft may always predict (besides the context's tokens).
    ``progress``: a progress bar on stderr, one step per round.
    """
    t_start = time.perf_counter()
    seqs = []
    for text in CALIBRATION_PROMPTS:
        ids = tokenizer(text).input_ids
        seqs.append((ids, _greedy(backend, ids, new_tokens)))

    # The drafter predicts over the tokens seen so far plus extra_vocab; measure it the same way.
    extra = {int(t) for t in extra_vocab}
    dev = backend.device  # every tensor of the search lives on the model's device
    vocab = torch.tensor(sorted({t for ids, out in seqs for t in ids + out} | extra), dtype=torch.long, device=dev)
    head = backend.sub_head(vocab)
    col = {t: j for j, t in enumerate(vocab.tolist())}

    def allowed(full: list[int]) -> torch.Tensor:
        """[len(full) - 1, |vocab|]: which vocab entries the drafter could predict at each position."""
        first = torch.full((len(vocab),), len(full), dtype=torch.long, device=dev)
        for t in extra:
            first[col[t]] = -1
        for i, t in enumerate(full):
            first[col[t]] = min(int(first[col[t]]), i)
        return first[None, :] <= torch.arange(len(full) - 1, device=dev)[:, None]

    def agreement(skip) -> float:
        """Teacher-forced top-1 agreement of the skipping model with the target's own output."""
        hit = tot = 0
        for ids, out in seqs:
            full = torch.tensor(ids + out, dtype=torch.long, device=dev)
            backend.reset()
            logits = backend.forward(full[:-1], 0, skip_layers=skip, head=head).logits
            pred = vocab[logits.masked_fill(~allowed(ids + out), float("-inf")).argmax(-1)]
            region = slice(len(ids) - 1, None)  # positions whose next token the target generated
            hit += int((pred[region] == full[1:][region]).sum())
            tot += len(out)
        return hit / tot

    x = torch.tensor(seqs[0][0] + seqs[0][1], dtype=torch.long, device=dev)

    def cost(n: int, **kw) -> float:
        """Median time of an n-token forward at the end of a real sequence."""
        return median_forward_s(backend, x, n, **kw)

    full_cost = cost(1)
    verify_ratio = {k: cost(k + 1) / full_cost for k in range(1, 9)}
    log("verify cost ratio " + ", ".join(f"K={k}: {r:.2f}" for k, r in verify_ratio.items()))
    n = backend.num_layers
    max_skip = max_skip if max_skip is not None else n - 2
    skip: list[int] = []
    trace = []
    best = {"skip": [], "speedup": 1.0, "agreement": 1.0, "cost_ratio": 1.0, "k": 0}
    bar = tqdm(total=max_skip, desc="calibrating layer skipping", unit="round", disable=not progress, leave=False)
    since_best, stopped = 0, "every layer tried"
    while len(skip) < max_skip:
        if budget_s is not None and time.perf_counter() - t_start > budget_s:
            stopped = f"time budget of {budget_s:.0f} s"
            break
        candidates = [i for i in range(n) if i not in skip]
        scored = [(agreement(tuple(skip + [i])), i) for i in candidates]
        a, layer = max(scored)
        skip.append(layer)
        c = cost(1, skip_layers=tuple(skip), head=head) / full_cost
        # Leviathan et al. with the measured draft cost and verify cost ratio, best K.
        am = min(a, 0.999)
        sp, kbest = max((expected_tokens(am, k) / (k * c + verify_ratio[k]), k) for k in range(1, 9))
        row = {"skip": sorted(skip), "agreement": round(a, 4), "cost_ratio": round(c, 4), "speedup": round(sp, 4), "k": kbest}
        trace.append(row)
        log(f"skip {row['skip']}: agreement {a:.3f}, draft cost {c:.2f} of a step, predicted speedup {sp:.2f} at K={kbest}")
        bar.update(1)
        bar.set_postfix(best=f"{max(sp, best['speedup']):.2f}x")
        if sp > best["speedup"]:
            best, since_best = row, 0
        else:
            since_best += 1
        if a < 0.2:
            stopped = "agreement below 0.2"
            break
        if since_best >= patience:
            stopped = f"no better set in {patience} rounds"
            break
    bar.close()
    log(f"layer skipping: {best['skip']} (predicted {best['speedup']:.2f}x); search stopped: {stopped}")
    backend.reset()
    return {"best": best, "trace": trace, "stopped": stopped, "full_step_s": full_cost, "verify_cost_ratio": verify_ratio,
            "prompts": CALIBRATION_PROMPTS, "new_tokens": new_tokens, "draft_vocab": sorted(extra)}


def corpus_token_frequencies(tokenizer, path: str, top: int, max_records: int = 5000) -> list[int]:
    """The ``top`` most frequent token ids over a text corpus (JSONL with text fields, or plain text)."""
    p = Path(path)
    if not p.exists():
        raise ForerunError(f"corpus not found: {path}")
    counts: Counter = Counter()
    with open(p) as f:
        for i, line in enumerate(f):
            if i >= max_records:
                break
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
                text = " ".join(str(v) for v in obj.values() if isinstance(v, str)) if isinstance(obj, dict) else str(obj)
            except json.JSONDecodeError:
                text = line
            counts.update(tokenizer(text, add_special_tokens=False).input_ids)
    return [t for t, _ in counts.most_common(top)]


def calibration_key(target) -> list:
    """What a layer-skip calibration is kept under (``forerun.kept``): the model and its backend."""
    return [*model_key(target), target.backend.num_layers, type(target.backend).__name__]


def default_calibration(target, log=None) -> dict:
    """The calibration for this model: shipped for the bundled model, else measured once per machine
    and kept (``forerun.kept``; ``forerun calibrate-layerskip`` replaces it)."""
    if target.name == "bundled":
        return json.loads(resources.files("forerun").joinpath("data/layerskip_bundled.json").read_text())

    info = logging.getLogger("forerun").info
    return kept.measured("layerskip", calibration_key(target),
                         lambda: calibrate(target.backend, target.tokenizer, log=log or info, progress=True),
                         f"calibrating layer skipping for {target.name} once for this machine (at most about 2 minutes)")
