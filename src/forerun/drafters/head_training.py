"""Train an EAGLE-style head or Medusa heads on a target's own hidden states.

Pipeline: token sequences (``training/data.py``) -> target features at the head's layers, computed once
and cached -> a reduced draft vocabulary from label-token frequencies -> training with a
held-out validation split, resumable checkpoints and a fixed seed -> a head folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from forerun.backends.arch import rms_norm
from forerun.drafters.heads import (
    DraftHead,
    HeadConfig,
    build_head,
    default_feature_layers,
    eagle3_feature_layers,
    target_fingerprint,
)
from forerun.errors import ForerunError, OptionError


@dataclass
class Sequence:
    """A token sequence to learn from."""

    ids: list[int]
    start: int  # positions >= start are learned (predicting ids[start:])


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
    eval_seconds: float = 600.0  # validation agreement at least this often (the learning curve)
    depth_decay: float = 0.8  # loss weight of depth j is depth_decay ** (j - 1)
    soft_labels: float = 0.0  # weight of the target's own next-token distribution in the loss (1 - it: its token)
    n_heads: int = 8
    head_dim: int = 80
    intermediate: int = 1536
    # eagle: "forerun" (per-layer feature norms, the last layer among the features) or "eagle3": EAGLE-3's
    # own shape and feature layers, exportable to vLLM and SGLang (forerun export-draft)
    shape: str = "forerun"


SHAPES = ("forerun", "eagle3")


@dataclass
class Example:
    ids: torch.Tensor  # [T] int64
    start: int  # labels at positions >= start are learned
    feats: torch.Tensor  # [T, n_layers * hidden] bfloat16


def _seq_key(layers: list[int], ids: list[int], start: int) -> str:
    return hashlib.sha256(json.dumps([list(layers), list(ids), int(start)]).encode()).hexdigest()[:20]


@torch.inference_mode()
def extract_features(backend, seqs: list[Sequence], layers: list[int], cache: Path | None, log=print) -> list[Example]:
    """Run the target over every sequence once and keep its features at ``layers`` (bfloat16).

    Cached in ``cache`` per sequence (keyed by its tokens, its learned start and the layers): a
    resumed run skips the forward passes, and a run with more data computes only the new
    sequences. The file holds exactly the sequences of the latest run."""
    seqs = [Sequence(list(s.ids[: backend.max_context]), s.start) for s in seqs]
    keys = [_seq_key(layers, s.ids, s.start) for s in seqs]
    have: dict[str, Example] = {}
    if cache is not None and cache.exists():
        blob = torch.load(cache, weights_only=True)
        if blob.get("format") == 2:
            wanted = set(keys)
            have = {k: Example(*e) for k, e in zip(blob["keys"], blob["examples"]) if k in wanted}
        del blob
    todo = [i for i, k in enumerate(keys) if k not in have]
    if cache is not None and have:
        log(f"features: {len(have)} sequences from {cache}, {len(todo)} to compute")
    for i in tqdm(todo, desc="features", unit="seq", disable=not todo):
        s = seqs[i]
        backend.reset()
        f = backend.forward(torch.tensor(s.ids, dtype=torch.long), 0, layers=layers, logits=False).layers
        # bfloat16, not float16: Gemma's residual stream reaches 1e5.
        have[keys[i]] = Example(torch.tensor(s.ids, dtype=torch.long), s.start, f.to(torch.bfloat16).cpu())
    out = [have[k] for k in keys]
    if cache is not None and todo:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save({"format": 2, "layers": list(layers), "keys": keys,
                    "examples": [(e.ids, e.start, e.feats) for e in out]}, tmp)
        tmp.replace(cache)
    return out


def split_validation(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Held-out and training examples. A sequence's side follows from its own tokens (a hash with
    the seed), not from its place in the data: adding data, or starting from a head trained on
    less of it, never moves a training sequence into validation. At least one of each when there
    are two or more."""
    def u(e: Example) -> float:
        h = hashlib.sha256(f"{seed}:{e.start}:".encode() + e.ids.numpy().tobytes()).digest()
        return int.from_bytes(h[:8], "big") / 2 ** 64

    scores = [u(e) for e in examples]
    held = [s < fraction for s in scores]
    if len(examples) > 1 and fraction > 0:
        if not any(held):
            held[min(range(len(examples)), key=scores.__getitem__)] = True
        if all(held):
            held[max(range(len(examples)), key=scores.__getitem__)] = False
    return ([e for e, h in zip(examples, held) if h], [e for e, h in zip(examples, held) if not h])


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


CHECKPOINT_SECONDS = 180  # a checkpoint at least this often, whatever the step count


def running_estimate(agree: list[float | None]) -> str:
    """Progress-bar text: running top-1 agreement per depth on the training batches, and the tokens per
    target pass a chain of these depths would give if each depth's agreement held given the ones
    before it (an estimate: teacher-forced agreement is not acceptance)."""
    known = [a for a in agree if a is not None]
    if not known:
        return ""
    return f"agree {' '.join(f'{a:.2f}' for a in known)} est. tau {chain_tau(known):.2f}"


def chain_tau(agree) -> float:
    """Tokens per pass of a chain whose depth i is right with probability agree[i] given the ones before."""
    tau, p = 1.0, 1.0
    for a in agree:
        p *= a
        tau += p
    return tau


class Trainer:
    @classmethod
    def of_target(cls, tc: TrainConfig, model, feature_layers: list[int] | None = None) -> Trainer:
        """A trainer for heads over a ``NativeModel``'s hidden states: its embeddings, embedding
        scale, LM head, final norm, depth, norm epsilon and logit cap."""
        return cls(tc, model.embed, float(model.embed_scale), model.lm_head.weight, model.final_norm, model.num_layers,
                   feature_layers=feature_layers, eps=model.eps, softcap=model.softcap)

    def __init__(self, tc: TrainConfig, embed: torch.Tensor, embed_scale: float, lm_head: torch.Tensor,
                 final_norm: torch.Tensor | None, num_layers: int, feature_layers: list[int] | None = None,
                 eps: float = 1e-6, softcap: float | None = None):
        self.tc = tc
        self.eps, self.softcap = eps, softcap  # the target's final norm and logit cap (soft labels)
        self.embed = embed  # the target's token embeddings, frozen (not part of the head)
        self.device = embed.device  # training runs where the target's weights are (a GPU if it is on one)
        self.embed_scale = embed_scale
        self.lm_head = lm_head
        self.final_norm = final_norm
        self.num_layers = num_layers
        if tc.shape not in SHAPES:
            raise ForerunError(f"unknown head shape {tc.shape!r} (choose {', '.join(SHAPES)})")
        if tc.kind == "medusa":
            if tc.shape != "forerun":
                raise OptionError("{shape} {got} is a shape of eagle heads, not medusa", got=tc.shape)
            self.feature_layers = [num_layers - 1]
        elif feature_layers:
            self.feature_layers = list(feature_layers)
        else:
            pick = eagle3_feature_layers if tc.shape == "eagle3" else default_feature_layers
            self.feature_layers = pick(num_layers)
        # Soft labels are computed from the last layer's features: read it too where the head does not.
        self.extract_layers = list(self.feature_layers)
        if tc.soft_labels > 0 and self.feature_layers[-1] != num_layers - 1:
            self.extract_layers.append(num_layers - 1)

    # -- model ------------------------------------------------------------------------------
    def new_head(self, d2t: torch.Tensor) -> DraftHead:
        tc = self.tc
        cfg = HeadConfig(kind=tc.kind, hidden_size=self.embed.shape[1], vocab_size=self.embed.shape[0],
                         draft_vocab=len(d2t), feature_layers=list(self.feature_layers),
                         target=target_fingerprint(self.embed, self.num_layers), n_heads=tc.n_heads,
                         head_dim=tc.head_dim, intermediate=tc.intermediate, medusa_heads=tc.steps_ahead,
                         embed_scale=float(self.embed_scale), feature_norms=tc.shape != "eagle3")
        torch.manual_seed(tc.seed)
        head = build_head(cfg, d2t).to(self.device)
        head.init_from_target(self.lm_head, self.final_norm)
        return head

    def warm_start(self, head: DraftHead, init: DraftHead) -> int:
        """Start ``head`` from a trained head ``init`` of the same kind, shape and target: every
        weight is copied, and output rows for the tokens both draft vocabularies hold (the rest
        keep the target's LM head rows). Returns how many output rows were copied."""
        a, b = head.cfg, init.cfg
        shape = ("kind", "hidden_size", "vocab_size", "feature_layers", "n_heads", "head_dim", "intermediate",
                 "medusa_heads", "target", "feature_norms")
        diff = [f for f in shape if getattr(a, f) != getattr(b, f) and not (a.kind == "eagle" and f == "medusa_heads")]
        if diff:
            raise OptionError("the {init} head differs from the head to train in {diff}", diff=", ".join(diff))
        state = {k: v for k, v in init.state_dict().items() if k not in ("lm_head.weight", "draft_to_target")}
        head.load_state_dict(state, strict=False)
        pos = {int(t): i for i, t in enumerate(init.draft_to_target.tolist())}
        with torch.no_grad():
            rows = [(j, pos[int(t)]) for j, t in enumerate(head.draft_to_target.tolist()) if int(t) in pos]
            if rows:
                dst, src = (torch.tensor(x, device=head.lm_head.weight.device) for x in zip(*rows))
                head.lm_head.weight[dst] = init.lm_head.weight.to(head.lm_head.weight)[src]
        return len(rows)

    def batch(self, examples: list[Example], idx: list[int]):
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
        feats = feats[..., : len(self.feature_layers) * self.embed.shape[1]]  # without a label-only last layer
        if self.tc.kind == "eagle":
            fused = head.fuse_features(feats)
            return head.ttt_forward(lambda j: self._shift_emb(ids, real, j), fused, self.tc.steps_ahead, real)
        return head.hidden(feats)

    @torch.no_grad()
    def target_logprobs(self, feats, d2t):
        """The target's next-token log-probabilities over the draft vocabulary at every position
        ([B, T, V_draft]), from the top-layer features in ``feats``: its final norm and LM head rows,
        exactly as it computes them (renormalised over the draft vocabulary)."""
        if self.extract_layers[-1] != self.num_layers - 1 or self.final_norm is None:
            raise ForerunError("soft labels need the target's last layer among the feature layers")
        h = rms_norm(feats[..., -self.embed.shape[1]:].float(), self.final_norm.float(), self.eps)
        logits = h @ self.lm_head[d2t].float().T
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.log_softmax(-1)

    def loss(self, head, ids, feats, real, learn, t2d):
        """Per depth j, cross-entropy with the target's token at i + j + 1 (positions learned and in
        the draft vocabulary), mixed with ``soft_labels`` of cross-entropy with the target's whole
        distribution there (as EAGLE does: the ranking below the top token is what a tree drafts
        from); depth j weighs depth_decay ** (j - 1)."""
        total, parts = 0.0, []
        self.last_hits = []  # per depth: (top-1 hits, labels) of this batch, for the running estimate
        w = self.tc.soft_labels
        soft = self.target_logprobs(feats, head.draft_to_target) if w > 0 else None
        for j, g in enumerate(self.depth_hidden(head, ids, feats, real), 1):
            s = j + 1
            lab = self._labels(ids, learn, t2d, s)
            sel = lab >= 0  # the output layer runs on learned positions only: it is most of the cost
            if sel.any():
                logq = head.logits(g[sel]).log_softmax(-1)
                l = F.nll_loss(logq, lab[sel])
                self.last_hits.append(((logq.argmax(-1) == lab[sel]).sum().item(), int(sel.sum().item())))
                if soft is not None:
                    # The target's distribution over token i + s comes from its features at i + s - 1;
                    # no label is learned past T - s, so the shifted view covers every selected row.
                    logp = soft[:, s - 1:][sel[:, : ids.shape[1] - s + 1]]
                    ls = -(logp.exp() * logq).sum(-1).mean()
                    l = (1 - w) * l + w * ls
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
            ids, feats, real, learn = self.batch(examples, idx)
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
              stop_after: int | None = None, init: DraftHead | None = None,
              keep_vocab: bool = False) -> tuple[DraftHead, dict]:
        """``stop_after``: save a checkpoint and return after this many steps (a resumable pause).
        ``init``: a trained head to start from (see ``warm_start``) instead of a fresh one.
        ``keep_vocab``: the new head keeps ``init``'s draft vocabulary (and so all its output rows)
        instead of choosing one from these examples: the right choice when continuing on fresh data
        only, which alone would pick a vocabulary from fewer tokens."""
        tc = self.tc
        val, train = split_validation(examples, tc.val_fraction, tc.seed)
        if not train:
            raise ForerunError("not enough training data (need at least 2 sequences)")
        if keep_vocab:
            if init is None:
                raise OptionError("keeping the draft vocabulary needs a head to start from ({init})")
            d2t = init.draft_to_target.detach().to("cpu", torch.long).clone()
        else:
            d2t = choose_draft_vocab(train, tc.draft_vocab, self.embed.shape[0], always_vocab)
        t2d = torch.full((self.embed.shape[0],), -1, dtype=torch.long)
        t2d[d2t] = torch.arange(len(d2t))
        t2d = t2d.to(self.device)
        head = self.new_head(d2t)
        if init is not None:
            copied = self.warm_start(head, init)
            log(f"starting from a trained head: {copied} of {len(d2t)} output rows copied")
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
            saved = state["train_config"]
            # settings that do not change what is learned may differ (and older checkpoints lack newer ones)
            differs = any(saved.get(k, v) != v for k, v in asdict(tc).items() if k != "eval_seconds")
            if differs or not torch.equal(state["draft_to_target"], d2t):
                raise OptionError("{ckpt} belongs to a run with other settings or data; remove it or use another {work}",
                                  ckpt=ckpt)
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
        t0 = saved = evaluated = time.time()
        spent = max((h.get("train_seconds", 0.0) for h in history), default=0.0)  # before a resume
        run: list[float | None] = [None] * tc.steps_ahead
        bar = tqdm(total=total_steps, initial=step, desc=f"train {tc.kind}", unit="step")
        for epoch in range(step // per_epoch, tc.epochs):
            batches = _batches(train, tc.batch_tokens, random.Random(tc.seed * 1000 + epoch))
            for b_i, idx in enumerate(batches):
                if epoch * per_epoch + b_i < step:
                    continue  # done before the resume
                ids, feats, real, learn = self.batch(train, idx)
                loss, parts = self.loss(head, ids, feats, real, learn, t2d)
                opt.zero_grad(set_to_none=True)
                if torch.is_tensor(loss):
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                    opt.step()
                sched.step()
                step += 1
                bar.update(1)
                for d, (h, n) in enumerate(self.last_hits):  # running top-1 agreement per depth (teacher-forced)
                    if n:
                        run[d] = h / n if run[d] is None else 0.95 * run[d] + 0.05 * h / n
                bar.set_postfix_str(f"loss {' '.join(f'{p:.2f}' for p in parts)} | " + running_estimate(run))
                due = step % tc.checkpoint_every == 0 or time.time() - saved > CHECKPOINT_SECONDS
                if due or step == stop_after:
                    save_ckpt()
                    saved = time.time()
                if val and time.time() - evaluated > tc.eval_seconds:  # points of the learning curve
                    agree = self.evaluate(head, val, t2d)
                    history.append({"step": step, "epoch": round(step / per_epoch, 3), "val_agreement": agree,
                                    "train_seconds": round(spent + time.time() - t0, 1)})
                    bar.write(f"step {step}: validation top-1 agreement per position " +
                              " ".join(f"{a:.3f}" for a in agree) + f" (est. tau {chain_tau(agree):.2f})")
                    evaluated = time.time()
                if step == stop_after:
                    bar.close()
                    return head, {"steps": step, "stopped": True, "history": history}
            if val:
                agree = self.evaluate(head, val, t2d)
                history.append({"step": step, "epoch": epoch + 1, "val_agreement": agree,
                                "train_seconds": round(spent + time.time() - t0, 1)})
                log(f"epoch {epoch + 1}: validation top-1 agreement per position " + " ".join(f"{a:.3f}" for a in agree))
            save_ckpt()
        bar.close()
        report = {"train_sequences": len(train), "val_sequences": len(val),
                  "train_tokens": sum(len(e.ids) for e in train), "steps": step,
                  "train_seconds_this_run": round(time.time() - t0, 1),
                  "draft_vocab_coverage_val": round(coverage(val, d2t), 4) if val else None,
                  "history": history, "train_config": asdict(tc)}
        return head, report
