"""EAGLE-style drafting: a trained one-layer head runs ahead of the target on its features.

The head keeps a small KV cache of its own. Entries for committed positions are always built
from the target's real features (sent by the engine after every target pass); entries past
them are the head's own guesses and are dropped at the next round.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forerun.drafters.base import Draft, Drafter
from forerun.drafters.heads import EagleHead, MedusaHeads
from forerun.sampling import logits_to_probs, sample


class FeatureDrafter(Drafter):
    """Shared by heads that read target features: collects them as the engine sends them."""

    def __init__(self, head, embed: torch.Tensor):
        self.head = head
        self.embed = embed  # the target's token embeddings [vocab, hidden]
        self.feature_layers = tuple(head.cfg.feature_layers)
        self.d2t = head.draft_to_target

    def begin(self, prompt, params, generator):
        super().begin(prompt, params, generator)
        self.feat_pos = 0  # target position of the first row of self.feats
        self.feats = None  # [rows, n_layers * hidden] features not yet consumed

    def take_features(self, pos: int, feats: torch.Tensor) -> None:
        """Features of target positions pos..pos+rows-1 (committed positions only)."""
        if self.feats is not None and pos <= self.feat_pos + len(self.feats):
            self.feats = torch.cat([self.feats[: pos - self.feat_pos], feats])
        else:
            self.feat_pos, self.feats = pos, feats

    def _pick(self, logits: torch.Tensor):
        """One draft token from draft-vocabulary logits [draft_vocab]: (target token id, q or None)."""
        if self.params.greedy:
            return self.d2t[logits.argmax(-1)], None
        q_small = logits_to_probs(logits, self.params)
        q = torch.zeros(self.head.cfg.vocab_size).scatter_(0, self.d2t, q_small)  # zero outside the draft vocabulary
        return sample(q, self.generator), q


class EagleDrafter(FeatureDrafter):
    name = "eagle"

    def __init__(self, head: EagleHead, embed: torch.Tensor):
        super().__init__(head, embed)
        self.scale = head.cfg.embed_scale

    def begin(self, prompt, params, generator):
        super().begin(prompt, params, generator)
        self.cache = None
        self.entries = 0  # head entries built from real target features

    def _emb(self, ids) -> torch.Tensor:
        return F.embedding(ids, self.embed).float() * self.scale

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> Draft:
        head = self.head
        if self.feats is None or len(self.feats) == 0:
            return Draft(tokens=torch.zeros(0, dtype=torch.long))
        # 1. Entries for the newly verified positions: (token after position i, target features at i).
        p = self.feat_pos
        n = min(len(self.feats), len(tokens) - 1 - p)
        ids = torch.tensor(tokens[p + 1 : p + 1 + n], dtype=torch.long)
        g, self.cache = head.step(self._emb(ids), head.fuse_features(self.feats[:n]), p, self.cache)
        self.entries = p + n
        self.feat_pos, self.feats = p + n, None
        # 2. Run ahead on the head's own outputs.
        out, qs = [], []
        hid, pos = g[-1:], p + n
        for d in range(k):
            tok, q = self._pick(head.logits(hid[-1]))
            out.append(tok)
            if q is not None:
                qs.append(q)
            if d + 1 < k:
                hid, self.cache = head.step(self._emb(tok.view(1)), hid, pos, self.cache)
                pos += 1
        return Draft(tokens=torch.stack(out), q=torch.stack(qs) if qs else None)


class MedusaDrafter(FeatureDrafter):
    name = "medusa"

    def __init__(self, head: MedusaHeads, embed: torch.Tensor):
        super().__init__(head, embed)
        self.max_k = head.cfg.medusa_heads

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> Draft:
        # Head j reads the features of the newest verified position (which predicted the last
        # committed token) and guesses j tokens further.
        if self.feats is None or len(self.feats) == 0:
            return Draft(tokens=torch.zeros(0, dtype=torch.long))
        last = len(tokens) - 2 - self.feat_pos
        if last < 0 or last >= len(self.feats):
            return Draft(tokens=torch.zeros(0, dtype=torch.long))
        self.feat_pos, self.feats = self.feat_pos + last, self.feats[last:]  # older rows are never read again
        logits = self.head(self.feats[0])[: min(k, self.max_k)]  # [k, draft_vocab]
        out, qs = [], []
        for lg in logits:
            tok, q = self._pick(lg)
            out.append(tok)
            if q is not None:
                qs.append(q)
        return Draft(tokens=torch.stack(out), q=torch.stack(qs) if qs else None)
