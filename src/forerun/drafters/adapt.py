"""Online adaptation: a trained head keeps learning from what the target verifies while it serves.

Every verify pass already yields, for free, the target's features at every committed position and
the token it committed there (an accepted draft, or the target's own correction where a draft was
rejected: both teach). That is exactly the head's training data (``forerun.drafters.head_training``),
so an ``OnlineAdapter`` logs it per request and every ``every`` rounds takes one small optimizer
step on windows of it: the newest window of this request and windows drawn from a bounded replay
buffer of earlier ones (ideas from DVI, arXiv 2510.05421, and online speculative decoding, arXiv
2310.07177). Verification never reads the head's weights, so output stays exactly the target's.

Only the head's decoder layers learn (not its output layer, which stays the target's LM head rows
it was trained from, and not the reduced vocabulary). The weights the drafter reads are float16
roundings of float32 master weights, so they keep the half-width drafting kernels.

Guard: the acceptance (drafts accepted per round) measured over the first ``guard_rounds``
rounds, before any update, is the baseline; once updates run, when the recent average falls
below ``(1 - tolerance)`` of it, the head reverts to the shipped weights (and its optimizer state
is dropped). ``save`` writes the adapted head as safetensors (float32: it reloads bit-identically).
"""

from __future__ import annotations

import random
import sys
import time
from collections import deque

import torch

from forerun.drafters.head_training import Example, TrainConfig, Trainer

DEFAULTS = dict(lr=3e-4, every=8, window=32, batch=2, buffer_positions=8192, steps_ahead=2, guard_rounds=64,
                tolerance=0.15)


class OnlineAdapter:
    def __init__(self, head, embed: torch.Tensor, *, lr: float = DEFAULTS["lr"], every: int = DEFAULTS["every"],
                 window: int = DEFAULTS["window"], batch: int = DEFAULTS["batch"],
                 buffer_positions: int = DEFAULTS["buffer_positions"], steps_ahead: int = DEFAULTS["steps_ahead"],
                 guard_rounds: int = DEFAULTS["guard_rounds"], tolerance: float = DEFAULTS["tolerance"], seed: int = 0):
        if every < 1 or window < 4 or batch < 1 or buffer_positions < window:
            raise ValueError("adaptation needs every >= 1, window >= 4, batch >= 1 and a buffer of at least one window")
        self.head = head
        self.every, self.window, self.batch = every, window, batch
        self.buffer_positions = buffer_positions
        self.guard_rounds, self.tolerance = guard_rounds, tolerance
        cfg = head.cfg
        steps = min(steps_ahead, cfg.medusa_heads) if cfg.kind == "medusa" else steps_ahead
        self.trainer = Trainer(TrainConfig(kind=cfg.kind, steps_ahead=steps), embed, cfg.embed_scale, lm_head=None,
                               final_norm=None, num_layers=cfg.target.get("num_layers", 0),
                               feature_layers=list(cfg.feature_layers))
        t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.long, device=head.draft_to_target.device)
        t2d[head.draft_to_target] = torch.arange(cfg.draft_vocab, device=t2d.device)
        self.t2d = t2d
        self.live = [p for n, p in head.named_parameters() if not n.startswith("lm_head.")]
        self.master = [p.detach().clone().float().requires_grad_(True) for p in self.live]
        self.lr = lr
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.0)
        self.shipped = [p.detach().clone() for p in self.live]
        self.rng = random.Random(seed)
        self.buffer: deque[tuple[torch.Tensor, torch.Tensor, int]] = deque()  # (ids, feats, first learned index)
        self.buffered = 0
        self.rounds = 0
        self.updates = 0
        self.reverts = 0
        self.update_s = 0.0
        self.baseline: list[int] = []  # accepted per drafted round before the first update
        self.recent: deque[int] = deque(maxlen=guard_rounds)
        self.since_revert = 0
        self.on_update = None  # called after each weight change (the drafters repack their kernels)

    # -- data -------------------------------------------------------------------------------
    def new_log(self, prompt_len: int) -> RequestLog:
        return RequestLog(prompt_len)

    def retire(self, log: RequestLog) -> None:
        """A finished request's log joins the replay buffer (oldest entries leave when it is full)."""
        entry = log.entry()
        if entry is not None:
            self.buffer.append(entry)
            self.buffered += len(entry[0])
            while self.buffered > self.buffer_positions and len(self.buffer) > 1:
                self.buffered -= len(self.buffer.popleft()[0])

    def _windows(self, log: RequestLog) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """The newest window of this request and up to ``batch - 1`` from the replay buffer."""
        out = []
        newest = log.newest(self.window)
        if newest is not None:
            out.append(newest)
        pool = [e for e in self.buffer if len(e[0]) > e[2]]
        for _ in range(self.batch - len(out)):
            if not pool:
                break
            ids, feats, start = self.rng.choice(pool)
            lo = self.rng.randrange(max(0, start - self.window // 2), max(1, len(ids) - self.window // 2))
            hi = min(len(ids), lo + self.window)
            out.append((ids[lo:hi], feats[lo:hi], max(0, start - lo)))
        return out

    # -- learning ---------------------------------------------------------------------------
    def observe(self, log: RequestLog, tokens: list[int], drafted: int, accepted: int) -> None:
        """After a round of the request behind ``log``: its committed tokens, how its draft fared."""
        log.ids = tokens
        self.rounds += 1
        if drafted:
            if self.updates == 0 and len(self.baseline) < self.guard_rounds:
                self.baseline.append(accepted)
            else:
                self.recent.append(accepted)
                self.since_revert += 1
        if self._fell():
            self.revert()
            return
        if self.rounds % self.every == 0 and len(self.baseline) >= self.guard_rounds:
            self.step(log)

    def _fell(self) -> bool:
        # updates only start once the baseline is complete
        if not self.updates or len(self.recent) < self.guard_rounds:
            return False
        if self.since_revert < self.guard_rounds:
            return False
        base = sum(self.baseline) / len(self.baseline)
        return sum(self.recent) / len(self.recent) < (1 - self.tolerance) * base

    def step(self, log: RequestLog) -> bool:
        """One optimizer step on the newest window of ``log`` and the replay buffer; False if no data yet."""
        wins = self._windows(log)
        if not wins:
            return False
        with torch.inference_mode(False):  # the engine may run inside inference mode
            return self._step(wins)

    def _step(self, wins) -> bool:
        t0 = time.perf_counter()
        examples = [Example(ids, start, feats) for ids, feats, start in wins]
        ids, feats, real, learn = self.trainer.batch(examples, list(range(len(examples))))
        with torch.enable_grad():
            loss, _ = self.trainer.loss(self.head, ids, feats, real, learn, self.t2d)
            if not torch.is_tensor(loss):
                return False
            grads = torch.autograd.grad(loss, self.live, allow_unused=True)
        for m, g in zip(self.master, grads):
            m.grad = None if g is None else g.float()
        torch.nn.utils.clip_grad_norm_([m for m in self.master if m.grad is not None], 1.0)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.live, self.master):
                p.copy_(m.half().float())  # float16-exact: the drafting kernels read half-width weights
        self.updates += 1
        self.update_s += time.perf_counter() - t0
        if self.on_update is not None:
            self.on_update()
        return True

    def revert(self) -> None:
        """Back to the shipped weights; optimizer state and the acceptance window start afresh."""
        with torch.no_grad():
            for p, m, s in zip(self.live, self.master, self.shipped):
                p.copy_(s)
                m.copy_(s)
        self.opt = torch.optim.AdamW(self.master, lr=self.lr, weight_decay=0.0)
        self.reverts += 1
        self.recent.clear()
        self.since_revert = 0
        if self.on_update is not None:
            self.on_update()

    def save(self, path) -> None:
        self.head.save(path, dtype=torch.float32)

    def report(self) -> dict:
        return {"rounds": self.rounds, "updates": self.updates, "reverts": self.reverts,
                "update_s": round(self.update_s, 3), "buffered_positions": self.buffered}


class RequestLog:
    """One request's committed tokens and the target's features at positions ``base``.. (bfloat16)."""

    def __init__(self, prompt_len: int):
        self.learn_from = prompt_len  # labels inside the prompt are the user's text, not the target's
        self.ids: list[int] = []
        self.base = 0
        self.pieces: list[torch.Tensor] = []
        self.n = 0

    def features(self, pos: int, feats: torch.Tensor) -> None:
        if pos != self.base + self.n:
            if pos < self.base or pos > self.base + self.n:  # a gap: start the log afresh there
                self.base, self.pieces, self.n = pos, [], 0
            else:  # rows rewritten from pos on
                keep = pos - self.base
                whole = torch.cat(self.pieces)[:keep] if self.pieces else None
                self.pieces = [whole] if keep else []
                self.n = keep
        with torch.inference_mode(False):
            self.pieces.append(feats.detach().to("cpu", torch.bfloat16, copy=True))
        self.n += len(feats)

    def _feats(self) -> torch.Tensor:
        if len(self.pieces) > 1:
            self.pieces = [torch.cat(self.pieces)]
        return self.pieces[0]

    def span(self) -> int:
        """Positions base.. with both a feature and a committed token."""
        return max(0, min(len(self.ids) - self.base, self.n))

    def newest(self, window: int):
        n = self.span()
        start = max(0, self.learn_from - self.base)
        if n <= start:
            return None
        s = max(0, n - window)
        return (torch.tensor(self.ids[self.base + s: self.base + n], device="cpu"), self._feats()[s:n], max(0, start - s))

    def entry(self):
        """The whole log as one replay-buffer entry (None: nothing to learn)."""
        return self.newest(self.span())


def save_adapted(drafter, path) -> None:
    """Save what a drafter's adapter learned to ``path`` (--adapt-save), saying so on stderr."""
    if path and drafter is not None and getattr(drafter, "adapter", None) is not None:
        drafter.adapter.save(path)
        print(f"forerun: adapted head saved to {path} ({drafter.adapter.report()})", file=sys.stderr)
