"""Self-speculation: the target drafts for itself with some layers skipped.

No extra weights. The draft shares the target's KV cache: for the committed context it
reads the target's exact keys and values, and the entries it writes at drafted positions
are overwritten by the verify pass that follows (the cache is written by position).

Which layers to skip is chosen by measurement (``calibrate``): on text the target itself
generated, drop layers greedily, each time the one whose removal keeps the draft's
top-1 agreement with the target highest, and keep the set whose predicted speedup
(Leviathan et al. with the measured draft and verify costs) is best.

Optionally the draft predicts over a reduced vocabulary (the tokens of the context plus a
frequent-token list), since on small models the LM head dominates the cost of a step.
"""

from __future__ import annotations

import time

import torch

from forerun.drafters.base import Draft, Drafter
from forerun.drafters.draft_model import autoregressive_draft
from forerun.errors import ForerunError


class LayerSkipDrafter(Drafter):
    name = "layerskip"

    def __init__(self, backend, skip_layers, context_vocab: bool = True, extra_vocab=()):
        if not getattr(backend, "supports_layer_skip", False):
            raise ForerunError("method layerskip needs a backend that can skip layers (the native backend)")
        bad = [i for i in skip_layers if not 0 <= i < backend.num_layers]
        if bad:
            raise ForerunError(f"layers {bad} out of range for a {backend.num_layers}-layer model")
        self.backend = backend
        self.skip = tuple(sorted(set(skip_layers)))
        self.context_vocab = context_vocab
        self.extra_vocab = [int(t) for t in extra_vocab]

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

    def propose(self, tokens: list[int], k: int) -> Draft:
        be = self.backend
        pos = len(tokens) - 1
        be.truncate(pos)
        extra = {}
        if self.context_vocab:
            self._update_vocab(tokens)
            extra = {"head": self._head, "vocab_map": self._map}
        return autoregressive_draft(
            be, torch.tensor(tokens[-1:], dtype=torch.long), pos, k, self.params, self.generator,
            skip_layers=self.skip, **extra,
        )


CALIBRATION_PROMPTS = [
    "Write a short explanation of how a refrigerator keeps food cold.",
    "Summarize the main causes of the French Revolution in a few sentences.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Translate to German: The weather is nice today and we are going to the park.",
    "A train leaves at 3 pm and travels 60 miles per hour. How far has it gone by 5 pm? Explain.",
]


@torch.inference_mode()
def calibrate(backend, tokenizer, *, new_tokens: int = 96, max_skip: int | None = None, log=print) -> dict:
    """Choose the skipped layers by measurement. Returns a dict with the chosen set and the trace."""
    from forerun.engine import Engine

    eng = Engine(backend)
    seqs = []
    for text in CALIBRATION_PROMPTS:
        ids = tokenizer(text).input_ids
        res = eng.generate(ids, max_new_tokens=new_tokens)
        seqs.append((ids, res.token_ids))

    def agreement(skip) -> float:
        hit = tot = 0
        for ids, out in seqs:
            full = torch.tensor(ids + out, dtype=torch.long)
            backend.reset()
            pred = backend.forward(full[:-1], 0, skip_layers=skip).logits.argmax(-1)
            target_next = full[1:]
            region = slice(len(ids) - 1, None)  # positions whose next token the target generated
            hit += int((pred[region] == target_next[region]).sum())
            tot += len(out)
        return hit / tot

    def step_cost(skip) -> float:
        backend.reset()
        x = torch.tensor(seqs[0][0], dtype=torch.long)
        backend.forward(x, 0)
        one = x[-1:]
        times = []
        for _ in range(7):
            t = time.perf_counter()
            backend.forward(one, len(x), skip_layers=skip)
            times.append(time.perf_counter() - t)
        return sorted(times)[3]

    full_cost = step_cost(())
    n = backend.num_layers
    max_skip = max_skip if max_skip is not None else n - 2
    skip: list[int] = []
    trace = []
    best = {"skip": [], "speedup": 1.0, "agreement": 1.0, "cost_ratio": 1.0, "k": 0}
    while len(skip) < max_skip:
        candidates = [i for i in range(n) if i not in skip]
        scored = [(agreement(tuple(skip + [i])), i) for i in candidates]
        a, layer = max(scored)
        skip.append(layer)
        c = step_cost(tuple(skip)) / full_cost
        # Predicted speedup with the best K; the verify pass costs about one step (ratio measured elsewhere).
        sp, kbest = max(((1 - a ** (k + 1)) / (1 - min(a, 0.999)) / (k * c + 1), k) for k in range(1, 9))
        row = {"skip": sorted(skip), "agreement": round(a, 4), "cost_ratio": round(c, 4), "speedup": round(sp, 4), "k": kbest}
        trace.append(row)
        log(f"skip {row['skip']}: agreement {a:.3f}, draft cost {c:.2f} of a step, predicted speedup {sp:.2f} at K={kbest}")
        if sp > best["speedup"]:
            best = row
        if a < 0.2:
            break
    backend.reset()
    return {"best": best, "trace": trace, "full_step_s": full_cost}


def _calibration_file(target):
    from forerun.models import cache_dir

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(target.name))
    return cache_dir() / "layerskip" / f"{safe}-{target.backend.num_layers}.json"


def default_skip_layers(target, log=None) -> list[int]:
    """The calibrated skip set for this model: shipped for the bundled model, else measured once and cached."""
    import json
    from importlib import resources

    if target.name == "bundled":
        data = json.loads(resources.files("forerun").joinpath("data/layerskip_bundled.json").read_text())
        return data["best"]["skip"]
    path = _calibration_file(target)
    if path.exists():
        return json.loads(path.read_text())["best"]["skip"]
    import logging

    logging.getLogger("forerun").warning("calibrating layer skipping for %s (once; cached in %s)", target.name, path)
    result = calibrate(target.backend, target.tokenizer, log=log or (lambda s: None))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result["best"]["skip"]
