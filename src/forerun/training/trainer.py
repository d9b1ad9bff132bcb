"""Train an EAGLE-style head or Medusa heads on a target's own hidden states.

Pipeline: token sequences (``data.py``) -> target features at the head's layers, computed once
and cached -> a reduced draft vocabulary from label-token frequencies -> training with a
held-out validation split, resumable checkpoints and a fixed seed -> a head folder.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from forerun.drafters.heads import DraftHead, HeadConfig, build_head, default_feature_layers, target_fingerprint
from forerun.errors import ForerunError
from forerun.training.data import Sequence


@dataclass
class TrainConfig:
    kind: str = "eagle"
    draft_vocab: int = 8192
    steps_ahead: int = 4  # eagle: depths unrolled in training-time test; medusa: number of heads
    epochs: int = 2
    lr: float = 1e-3
    batch_tokens: int = 2048
    val_fraction: float = 0.05
    seed: int = 0
    checkpoint_every: int = 50  # optimizer steps
    depth_decay: float = 0.8  # loss weight of depth j is depth_decay ** (j - 1)
    n_heads: int = 8
    head_dim: int = 80
    intermediate: int = 1536


@dataclass
class Example:
    ids: torch.Tensor  # [T] int64
    start: int  # labels at positions >= start are learned
    feats: torch.Tensor  # [T, n_layers * hidden] bfloat16


@torch.inference_mode()
def extract_features(backend, seqs: list[Sequence], layers: list[int], cache: Path | None, log=print) -> list[Example]:
    """Run the target over every sequence once and keep its features at ``layers`` (bfloat16).
    Cached in ``cache`` (keyed by the sequences and layers), so a resumed run skips this."""
    from tqdm import tqdm

    import hashlib

    key = hashlib.sha256(json.dumps([layers, [(s.ids, s.start) for s in seqs]]).encode()).hexdigest()[:16]
    if cache is not None and cache.exists():
        blob = torch.load(cache, weights_only=True)
        if blob.get("key") == key:
            log(f"features: {len(blob['examples'])} sequences from {cache}")
            return [Example(*e) for e in blob["examples"]]
    out = []
    for s in tqdm(seqs, desc="features", unit="seq"):
        ids = torch.tensor(s.ids[: backend.max_context], dtype=torch.long)
        backend.reset()
        f = backend.forward(ids, 0, layers=layers, logits=False).layers
        out.append(Example(ids, s.start, f.to(torch.bfloat16).cpu()))  # float16 overflows: Gemma's residual reaches 1e5
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "examples": [(e.ids, e.start, e.feats) for e in out]}, cache)
    return out


def choose_draft_vocab(examples: list[Example], size: int, vocab_size: int, always=()) -> torch.Tensor:
    """``always`` (e.g. EOS), then the most frequent learned tokens, then the most frequent prompt
    tokens (ties by id)."""
    learned, context = Counter(), Counter()
    for e in examples:
        learned.update(e.ids[max(e.start, 1):].tolist())
        context.update(e.ids[: max(e.start, 1)].tolist())
    chosen = [t for t in dict.fromkeys(always) if 0 <= t < vocab_size]
    have = set(chosen)
    for counts in (learned, context):
        for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(chosen) >= size:
                break
            if t not in have:
                chosen.append(t)
                have.add(t)
    # A corpus with fewer distinct tokens than asked for: fill with the lowest unused ids.
    filler = (t for t in range(vocab_size) if t not in have)
    while len(chosen) < size:
        chosen.append(next(filler))
    return torch.tensor(chosen, dtype=torch.long)


def coverage(examples: list[Example], d2t: torch.Tensor) -> float:
    allowed = set(d2t.tolist())
    total = hit = 0
    for e in examples:
        lab = e.ids[max(e.start, 1):].tolist()
        total += len(lab)
        hit += sum(t in allowed for t in lab)
    return hit / max(total, 1)


def _batches(examples: list[Example], batch_tokens: int, rng: random.Random | None):
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    batches, cur, longest = [], [], 0
    for i in order:
        n = len(examples[i].ids)
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    if rng is not None:
        rng.shuffle(batches)
    return batches


class Trainer:
    def __init__(self, tc: TrainConfig, embed: torch.Tensor, embed_scale: float, lm_head: torch.Tensor,
                 final_norm: torch.Tensor | None, num_layers: int, feature_layers: list[int] | None = None):
        self.tc = tc
        self.embed = embed  # the target's token embeddings, frozen (not part of the head)
        self.device = embed.device  # training runs where the target's weights are (a GPU if it is on one)
        self.embed_scale = embed_scale
        self.lm_head = lm_head
        self.final_norm = final_norm
        self.num_layers = num_layers
        if tc.kind == "medusa":
            self.feature_layers = [num_layers - 1]
        else:
            self.feature_layers = feature_layers or default_feature_layers(num_layers)

    # -- model ------------------------------------------------------------------------------
    def new_head(self, d2t: torch.Tensor) -> DraftHead:
        tc = self.tc
        cfg = HeadConfig(kind=tc.kind, hidden_size=self.embed.shape[1], vocab_size=self.embed.shape[0],
                         draft_vocab=len(d2t), feature_layers=list(self.feature_layers),
                         target=target_fingerprint(self.embed, self.num_layers), n_heads=tc.n_heads,
                         head_dim=tc.head_dim, intermediate=tc.intermediate, medusa_heads=tc.steps_ahead,
                         embed_scale=float(self.embed_scale))
        torch.manual_seed(tc.seed)
        head = build_head(cfg, d2t).to(self.device)
        head.init_from_target(self.lm_head, self.final_norm)
        return head

    def _batch(self, examples: list[Example], idx: list[int]):
        """Padded tensors for one batch: ids [B, T], feats [B, T, F], real [B, T], learn [B, T]."""
        T = max(len(examples[i].ids) for i in idx)
        B = len(idx)
        Fdim = examples[idx[0]].feats.shape[1]
        ids = torch.zeros(B, T, dtype=torch.long)
        feats = torch.zeros(B, T, Fdim)
        real = torch.zeros(B, T, dtype=torch.bool)
        learn = torch.zeros(B, T, dtype=torch.bool)
        for b, i in enumerate(idx):
            e = examples[i]
            n = len(e.ids)
            ids[b, :n] = e.ids
            feats[b, :n] = e.feats.float()
            real[b, :n] = True
            learn[b, max(e.start, 1) : n] = True
        return tuple(t.to(self.device) for t in (ids, feats, real, learn))

    def _labels(self, ids, learn, t2d, shift: int):
        """Draft-vocabulary label of position i + shift for every i; -100 where not learned."""
        B, T = ids.shape
        lab = torch.full((B, T), -100, dtype=torch.long, device=ids.device)
        if shift < T:
            tgt = t2d[ids[:, shift:]]
            ok = learn[:, shift:] & (tgt >= 0)
            lab[:, : T - shift] = torch.where(ok, tgt, torch.full_like(tgt, -100))
        return lab

    def _shift_emb(self, ids, real, j: int):
        B, T = ids.shape
        e = torch.zeros(B, T, self.embed.shape[1], device=ids.device)
        if j < T:
            rows = F.embedding(ids[:, j:], self.embed).float() * self.embed_scale
            e[:, : T - j] = rows * real[:, j:, None]
        return e

    def depth_hidden(self, head: DraftHead, ids, feats, real):
        """Output states per depth (eagle) or per head (medusa): list of [B, T, H]; the j-th
        (1-based) predicts position i + j + 1 through ``head.logits``."""
        if self.tc.kind == "eagle":
            fused = head.fuse_features(feats)
            return head.ttt_forward(lambda j: self._shift_emb(ids, real, j), fused, self.tc.steps_ahead, real)
        return head.hidden(feats)

    def loss(self, head, ids, feats, real, learn, t2d):
        total, parts = 0.0, []
        for j, g in enumerate(self.depth_hidden(head, ids, feats, real), 1):
            lab = self._labels(ids, learn, t2d, j + 1)
            sel = lab >= 0  # the output layer runs on learned positions only: it is most of the cost
            if sel.any():
                l = F.cross_entropy(head.logits(g[sel]), lab[sel])
                total = total + self.tc.depth_decay ** (j - 1) * l
                parts.append(l.item())
        return total, parts

    @torch.no_grad()
    def agreement_counts(self, head, examples, top_k: int = 1):
        """Per depth (1-based position ahead): (top-1 hits, labels, top-``top_k`` hits), teacher-forced
        on the target's own tokens; labels outside the draft vocabulary count as misses."""
        was_training = head.training
        head.eval()
        hits = torch.zeros(self.tc.steps_ahead)
        hits_k = torch.zeros(self.tc.steps_ahead)
        total = torch.zeros(self.tc.steps_ahead)
        d2t = head.draft_to_target
        for idx in _batches(examples, self.tc.batch_tokens, None):
            ids, feats, real, learn = self._batch(examples, idx)
            for j, g in enumerate(self.depth_hidden(head, ids, feats, real), 1):
                s = j + 1
                if s >= ids.shape[1]:
                    continue
                m = learn[:, s:]
                logits = head.logits(g[:, : ids.shape[1] - s][m])
                want = ids[:, s:][m]
                top = d2t[logits.topk(min(top_k, logits.shape[-1]), -1).indices]
                hits[j - 1] += (top[:, 0] == want).sum().item()
                hits_k[j - 1] += (top == want[:, None]).any(-1).sum().item()
                total[j - 1] += m.sum().item()
        head.train(was_training)
        return hits, total, hits_k

    def evaluate(self, head, examples, t2d=None) -> list[float]:
        """Top-1 agreement with the target's next tokens per depth (1-based position ahead), counting
        labels outside the draft vocabulary as misses."""
        hits, total, _ = self.agreement_counts(head, examples)
        return (hits / total.clamp(min=1)).tolist()

    # -- loop -------------------------------------------------------------------------------
    def train(self, examples: list[Example], work: Path, *, always_vocab=(), log=print,
              stop_after: int | None = None) -> tuple[DraftHead, dict]:
        """``stop_after``: save a checkpoint and return after this many steps (a resumable pause)."""
        from tqdm import tqdm

        tc = self.tc
        rng = random.Random(tc.seed)
        order = list(range(len(examples)))
        rng.shuffle(order)
        n_val = max(1, int(len(examples) * tc.val_fraction)) if len(examples) > 1 else 0
        val = [examples[i] for i in order[:n_val]]
        train = [examples[i] for i in order[n_val:]]
        if not train:
            raise ForerunError("not enough training data (need at least 2 sequences)")
        d2t = choose_draft_vocab(train, tc.draft_vocab, self.embed.shape[0], always_vocab)
        t2d = torch.full((self.embed.shape[0],), -1, dtype=torch.long)
        t2d[d2t] = torch.arange(len(d2t))
        t2d = t2d.to(self.device)
        head = self.new_head(d2t)
        opt = torch.optim.AdamW(head.parameters(), lr=tc.lr, weight_decay=0.0, betas=(0.9, 0.95))
        per_epoch = len(_batches(train, tc.batch_tokens, None))
        total_steps = per_epoch * tc.epochs
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
        work.mkdir(parents=True, exist_ok=True)
        ckpt = work / "checkpoint.pt"
        step, history = 0, []
        if ckpt.exists():
            state = torch.load(ckpt, weights_only=False, map_location="cpu")
            if state["train_config"] != asdict(tc) or not torch.equal(state["draft_to_target"], d2t):
                raise ForerunError(f"{ckpt} belongs to a run with other settings or data; remove it or use another --work")
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            step, history = state["step"], state["history"]
            log(f"resuming from {ckpt} at step {step}/{total_steps}")

        def save_ckpt():
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
                        "history": history, "train_config": asdict(tc), "draft_to_target": d2t}, tmp)
            tmp.replace(ckpt)

        before = self.evaluate(head, val, t2d) if val and step == 0 else None
        if before is not None:
            log("validation top-1 agreement before training: " + " ".join(f"{a:.3f}" for a in before))
            history.append({"step": 0, "val_agreement": before})
        head.train()
        t0 = time.time()
        bar = tqdm(total=total_steps, initial=step, desc=f"train {tc.kind}", unit="step")
        for epoch in range(step // per_epoch, tc.epochs):
            batches = _batches(train, tc.batch_tokens, random.Random(tc.seed * 1000 + epoch))
            for b_i, idx in enumerate(batches):
                if epoch * per_epoch + b_i < step:
                    continue  # done before the resume
                ids, feats, real, learn = self._batch(train, idx)
                loss, parts = self.loss(head, ids, feats, real, learn, t2d)
                opt.zero_grad(set_to_none=True)
                if torch.is_tensor(loss):
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                    opt.step()
                sched.step()
                step += 1
                bar.update(1)
                bar.set_postfix_str(" ".join(f"{p:.2f}" for p in parts))
                if step % tc.checkpoint_every == 0 or step == stop_after:
                    save_ckpt()
                if step == stop_after:
                    bar.close()
                    return head, {"steps": step, "stopped": True, "history": history}
            if val:
                agree = self.evaluate(head, val, t2d)
                history.append({"step": step, "epoch": epoch + 1, "val_agreement": agree})
                log(f"epoch {epoch + 1}: validation top-1 agreement per position " + " ".join(f"{a:.3f}" for a in agree))
            save_ckpt()
        bar.close()
        report = {"train_sequences": len(train), "val_sequences": len(val),
                  "train_tokens": sum(len(e.ids) for e in train), "steps": step,
                  "train_seconds_this_run": round(time.time() - t0, 1),
                  "draft_vocab_coverage_val": round(coverage(val, d2t), 4) if val else None,
                  "history": history, "train_config": asdict(tc)}
        return head, report
