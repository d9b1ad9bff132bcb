"""Drafting with trained heads that read the target's features: EAGLE-style and Medusa.

The EAGLE head keeps a small KV cache of its own. Entries for committed positions are always
built from the target's real features (sent by the engine after every target pass); entries
past them are the head's own guesses and are dropped at the next round.

Both can propose a chain or a token tree (``tree=(nodes, depth)``): EAGLE grows a dynamic tree
(EAGLE-2: expand the most probable branches depth by depth, then keep the best ``nodes`` by
path probability); Medusa fills a static tree shape with each head's top-ranked tokens.
With ``lookup`` (a source from ``drafters.lookup``: prompt lookup, or suffix drafting over the
context and earlier outputs; ``(max_ngram, min_ngram)`` means prompt lookup) a tree also carries
that source's chain as one more branch: text the answer copies from the prompt or repeats
is what a small head predicts worst and lookup predicts best. Verification treats every node
alike, so the result stays exactly the target's. With ``adaptive=True`` the drafter offers, each
round, its lookup chain before building a tree (``offers_tree_or_chain``): the draft-length policy
decides whether the tree pays at all this round, or whether the lookup chain alone (or a plain
step) gives more tokens per second; on hardware where verify rows are costly a head tree only pays
when the lookup has nothing good to offer.
"""

from __future__ import annotations

import heapq
import math

import torch

from forerun.drafters.base import Draft, Drafter
from forerun.drafters.draft_model import pick_token
from forerun.drafters.heads import EagleHead, MedusaHeads
from forerun.drafters.lookup import NgramLookup
from forerun.tree import graft_chain


class FeatureDrafter(Drafter):
    """Shared by heads that read target features: collects them as the engine sends them."""

    default_depth = 6

    def __init__(self, head, embed: torch.Tensor, tree=None, lookup=None, adaptive: bool = False, adapter=None):
        self.head = head
        # online adaptation (``forerun.drafters.adapt``): shared by every fork, one request log each
        self.adapter = adapter
        self.log = None
        self._drafted = 0
        self.tree_nodes, self.tree_depth = (None, None) if not tree else (tree[0], tree[1] or self.default_depth)
        if lookup is not None and not tree:
            raise ValueError("a lookup branch needs a token tree")
        if adaptive and lookup is None:
            raise ValueError("choosing between tree and lookup chain needs a lookup branch")
        if isinstance(lookup, tuple):  # (max_ngram, min_ngram): prompt lookup
            lookup = NgramLookup(*lookup)
        self.lookup = lookup  # the lookup branch's source (``drafters.lookup``), grafted onto every tree
        self.adaptive = adaptive
        self.offers_tree_or_chain = adaptive
        self._chain = None  # (context length, this round's lookup chain)
        self._chunks = None  # features not yet consumed, one tensor per pass (``feats``)
        self.embed = embed  # the target's token embeddings [vocab, hidden]
        self.feature_layers = tuple(head.cfg.feature_layers)
        self.d2t = head.draft_to_target
        # Tree building is Python: it reads scores and ids from one host copy per depth, since
        # element-wise reads of device tensors cost a GPU sync each.
        self.d2t_host = self.d2t.tolist()

    def begin(self, prompt, params, generator):
        super().begin(prompt, params, generator)
        self.feat_pos = 0  # target position of the first row of self.feats
        self.feats = None  # [rows, n_layers * hidden] features not yet consumed
        self._chain = None
        if self.lookup is not None:
            self.lookup.begin(prompt, params, generator)
        if self.adapter is not None:
            if self.log is not None:
                self.adapter.retire(self.log)
            self.log = self.adapter.new_log(len(prompt))

    def fork(self) -> FeatureDrafter:
        return type(self)(self.head, self.embed, tree=(self.tree_nodes, self.tree_depth) if self.tree_nodes else None,
                          lookup=self.lookup.fork() if self.lookup is not None else None, adaptive=self.adaptive,
                          adapter=self.adapter)

    def forget_history(self) -> None:
        """Drop what the lookup branch learned from earlier requests (a suffix source's outputs)."""
        if self.lookup is not None:
            self.lookup.forget_history()

    def propose(self, tokens: list[int], k: int) -> Draft:
        draft = self._propose(tokens, k)
        self._drafted = len(draft)
        return draft

    def lookup_chain(self, tokens: list[int], k: int) -> Draft:
        """This round's lookup chain, offered beside the tree: its trust bucket and per-token
        confidences are the lookup source's own."""
        chain = self.lookup.chain(tokens, k)
        self._chain = (len(tokens), chain)
        return chain

    def tree_rows(self, chain_len: int) -> int:
        return self.tree_nodes + 1 + chain_len

    def _tree_draft(self, tree: Draft | None, tokens: list[int], k: int) -> Draft:
        """The head's tree (None: no head tree this round) with the lookup branch, if any, grafted on.

        Node confidences (``Draft.conf``) carry over from the head's tree; a node of the lookup
        branch gets the chain's measured per-token acceptance for this round's n-gram length
        (a node both propose: the larger of the two)."""
        if tree is None:
            none = torch.zeros(0, dtype=torch.long, device="cpu")
            tree = Draft(tokens=none, parents=none.clone(), conf=[])
        if self.lookup is not None:
            if self._chain is None or self._chain[0] != len(tokens):  # not offered this round yet
                self.lookup_chain(tokens, k)
            c = self._chain[1]
            chain = c.tokens[:k].tolist()
            if chain:
                t, p, path = graft_chain(tree.tokens, tree.parents, chain)
                conf = None
                if tree.conf is not None:
                    rates = list(c.conf or [0.5] * len(chain))
                    conf = list(tree.conf) + [0.0] * (len(t) - len(tree))
                    for j, node in enumerate(path):  # a node both propose: the larger of the two
                        conf[node] = max(conf[node], rates[j])
                tree = Draft(tokens=t, parents=p, conf=conf)
        return tree

    def accepted(self, tokens: list[int], num_accepted: int) -> None:
        if self.adapter is not None and self.log is not None:
            self.adapter.observe(self.log, tokens, self._drafted, num_accepted)
        self._drafted = 0  # a round that proposes nothing (K = 0) does not call propose
        self._chain = None
        if self.lookup is not None:  # the source learns from every round, whatever was verified
            self.lookup.accepted(tokens, num_accepted)

    @property
    def feats(self) -> torch.Tensor | None:
        """Features of positions feat_pos.. not yet consumed [rows, n_layers * hidden]."""
        if self._chunks is None:
            return None
        if len(self._chunks) > 1:  # joined once, when the head reads them
            self._chunks = [torch.cat(self._chunks)]
        return self._chunks[0]

    @feats.setter
    def feats(self, value: torch.Tensor | None) -> None:
        self._chunks = None if value is None else [value]

    def take_features(self, pos: int, feats: torch.Tensor) -> None:
        """Features of target positions pos..pos+rows-1 (committed positions only). Kept as a list
        of passes until the head reads them: on rounds that do not draft, nothing is copied (a
        long prompt's features were copied again at every step before)."""
        if self.log is not None:
            self.log.features(pos, feats)
        have = sum(len(c) for c in self._chunks) if self._chunks is not None else 0
        if self._chunks is not None and pos <= self.feat_pos + have:
            if pos - self.feat_pos < have:
                self.feats = self.feats[: pos - self.feat_pos]
            self._chunks.append(feats)
        else:
            self.feat_pos, self.feats = pos, feats

    def _pick(self, logits: torch.Tensor, position: int):
        """One draft token (the sequence's token ``position``) from draft-vocabulary logits
        [draft_vocab]: (target token id, q or None)."""
        return pick_token(logits, self.params, self.generator, self.d2t, self.head.cfg.vocab_size, position)


class EagleDrafter(FeatureDrafter):
    name = "eagle"
    top_k = 8  # tree: children tried per expanded node
    branch = 8  # tree: nodes expanded per depth

    def __init__(self, head: EagleHead, embed: torch.Tensor, tree=None, lookup=None, adaptive: bool = False,
                 adapter=None):
        super().__init__(head, embed, tree, lookup, adaptive, adapter)
        self.scale = head.cfg.embed_scale

    def begin(self, prompt, params, generator):
        super().begin(prompt, params, generator)
        self.cache = None  # head keys/values: committed entries first, then this round's guesses

    def _emb(self, ids) -> torch.Tensor:
        return self.embed[ids].float() * self.scale

    @torch.inference_mode()
    def _propose(self, tokens: list[int], k: int) -> Draft:
        head = self.head
        if self.feats is None or len(self.feats) == 0:
            return self._tree_draft(None, tokens, k) if self.tree_nodes else Draft(tokens=torch.zeros(0, dtype=torch.long, device="cpu"))
        # 1. Entries for the newly verified positions: (token after position i, target features at i).
        p = self.feat_pos
        n = min(len(self.feats), len(tokens) - 1 - p)
        ids = torch.tensor(tokens[p + 1 : p + 1 + n], dtype=torch.long, device=self.embed.device)
        g, self.cache = head.step(self._emb(ids), head.fuse_features(self.feats[:n]), p, self.cache)
        self.feat_pos, self.feats = p + n, None
        if self.tree_nodes:
            return self._tree_draft(self._tree(g[-1:], p + n, min(k, self.tree_depth)), tokens, k)
        # 2. Run ahead on the head's own outputs.
        out, qs = [], []
        hid, pos = g[-1:], p + n
        for d in range(k):
            tok, q = self._pick(head.logits(hid[-1]), len(tokens) + d)
            out.append(tok)
            if q is not None:
                qs.append(q)
            if d + 1 < k:
                hid, self.cache = head.step(self._emb(tok.view(1)), hid, pos, self.cache)
                pos += 1
        return Draft(tokens=torch.stack(out), q=torch.stack(qs) if qs else None)


    def _tree(self, g_last, base: int, depth: int) -> Draft:
        """EAGLE-2 dynamic tree. Scores are path log-probabilities under the head; every depth
        expands the ``branch`` best new nodes in one head pass (each attending to the committed
        entries and its own ancestors), and the best ``tree_nodes`` nodes overall are kept."""
        head = self.head
        logp = torch.log_softmax(head.logits(g_last[0]), -1)
        vals, idx = _host_topk(logp, self.top_k)
        # node: (score, token id, parent node or -1, depth); the first depth hangs off the root.
        nodes = [(sc, self.d2t_host[i], -1, 1) for sc, i in zip(vals, idx)]
        # Only nodes among the best ``tree_nodes`` can be kept, and a child never scores above its
        # parent: expanding more than that many per depth cannot change the tree.
        branch = min(self.branch, self.tree_nodes)
        frontier = list(range(min(branch, len(nodes))))
        hid = {-1: g_last[0]}  # node -> head output after consuming its token
        slot = {}  # node -> its entry in the head cache (after the base committed entries)
        cache = self.cache
        for d in range(2, depth + 1):
            if not frontier:
                break
            n_prev = cache.n
            rows = len(frontier)
            mask = torch.zeros(rows, n_prev + rows, dtype=torch.bool, device="cpu")  # built on the CPU, moved once
            mask[:, :base] = True
            for r, nd in enumerate(frontier):
                a = nodes[nd][2]
                while a != -1:
                    mask[r, slot[a]] = True
                    a = nodes[a][2]
                mask[r, n_prev + r] = True
            dev = self.embed.device
            emb = self._emb(torch.tensor([nodes[nd][1] for nd in frontier], device=dev))
            parent_hid = torch.stack([hid[nodes[nd][2]] for nd in frontier])
            positions = torch.full((rows,), base + d - 2, device=dev)
            g, cache = head.step(emb, parent_hid, n_prev, cache, positions=positions, mask=mask.to(dev))
            for r, nd in enumerate(frontier):
                hid[nd] = g[r]
                slot[nd] = n_prev + r
            vals, idx = _host_topk(torch.log_softmax(head.logits(g), -1), self.top_k)  # [rows][top_k]
            cand = []
            for r, nd in enumerate(frontier):
                sc0 = nodes[nd][0]
                for sc, i in zip(vals[r], idx[r]):
                    cand.append((sc0 + sc, self.d2t_host[i], nd, d))
            best = heapq.nlargest(branch, cand, key=lambda c: c[0])
            frontier = list(range(len(nodes), len(nodes) + len(best)))
            nodes.extend(best)
        # Keep the best nodes; a child never scores above its parent, so ancestors come along
        # (ties broken towards shallower nodes).
        keep = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], nodes[i][3], i))[: self.tree_nodes]
        keep_set = set(keep)
        keep = [i for i in keep if nodes[i][2] == -1 or nodes[i][2] in keep_set]
        order = sorted(keep, key=lambda i: (nodes[i][3], i))  # by depth: parents before children
        index = {nd: j for j, nd in enumerate(order)}
        tokens = torch.tensor([nodes[i][1] for i in order], dtype=torch.long, device="cpu")
        parents = torch.tensor([index[nodes[i][2]] if nodes[i][2] != -1 else -1 for i in order], dtype=torch.long, device="cpu")
        # The head's own probability of each node given its parent: its estimate of acceptance.
        conf = [math.exp(nodes[i][0] - (nodes[nodes[i][2]][0] if nodes[i][2] != -1 else 0.0)) for i in order]
        return Draft(tokens=tokens, parents=parents, conf=conf)


def _host_topk(logp: torch.Tensor, k: int) -> tuple[list, list]:
    """topk of [..., n] as Python lists (scores, indices), read back from the device at once."""
    top = logp.topk(k)
    return top.values.tolist(), top.indices.tolist()


def static_tree(nodes: int, depth: int, rank_weights=(0.6, 0.15, 0.07, 0.04, 0.03, 0.02, 0.015, 0.01)):
    """A fixed tree shape for Medusa: the ``nodes`` rank paths (e.g. (0, 1) = head 1's top token,
    then head 2's second) with the highest product of typical per-rank acceptance rates."""
    heap = [(-w, (r,)) for r, w in enumerate(rank_weights)]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < nodes:
        negw, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < depth:
            for r, w in enumerate(rank_weights):
                heapq.heappush(heap, (negw * w, path + (r,)))
    return sorted(out, key=lambda p: (len(p), p))


class MedusaDrafter(FeatureDrafter):
    name = "medusa"

    def __init__(self, head: MedusaHeads, embed: torch.Tensor, tree=None, lookup=None, adaptive: bool = False,
                 adapter=None):
        super().__init__(head, embed, tree, lookup, adaptive, adapter)
        self.max_k = head.cfg.medusa_heads
        if self.tree_nodes:
            self.tree_depth = min(self.tree_depth, self.max_k)
            self.paths = static_tree(self.tree_nodes, self.tree_depth)

    @torch.inference_mode()
    def _propose(self, tokens: list[int], k: int) -> Draft:
        # Head j reads the features of the newest verified position (which predicted the last
        # committed token) and guesses j tokens further.
        last = len(tokens) - 2 - self.feat_pos
        if self.feats is None or not 0 <= last < len(self.feats):
            return self._tree_draft(None, tokens, k) if self.tree_nodes else Draft(tokens=torch.zeros(0, dtype=torch.long, device="cpu"))
        self.feat_pos, self.feats = self.feat_pos + last, self.feats[last:]  # older rows are never read again
        logits = self.head(self.feats[0])[: min(k, self.max_k)]  # [k, draft_vocab]
        if self.tree_nodes:
            paths = [p for p in self.paths if len(p) <= len(logits)]
            ranked = logits.topk(1 + max(max(p) for p in paths), -1).indices.tolist()  # [k][ranks]
            index = {p: i for i, p in enumerate(paths)}
            cand = torch.tensor([self.d2t_host[ranked[len(p) - 1][p[-1]]] for p in paths], dtype=torch.long, device="cpu")
            parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=torch.long, device="cpu")
            return self._tree_draft(Draft(tokens=cand, parents=parents), tokens, k)
        out, qs = [], []
        for j, lg in enumerate(logits):
            tok, q = self._pick(lg, len(tokens) + j)
            out.append(tok)
            if q is not None:
                qs.append(q)
        return Draft(tokens=torch.stack(out), q=torch.stack(qs) if qs else None)
