"""Suffix drafting: continue the longest earlier match of the context's end, in this request and
in every earlier output, with a confidence per continuation from how often it followed.

Idea from SuffixDecoding (Oliaro et al., NeurIPS 2025): where outputs repeat across requests
(agents, code, templated answers) a frequency-weighted index over past outputs drafts long runs
that a model-free prompt lookup over one request cannot see.

Structure. A ``TokenIndex`` holds token sequences and, per bigram and per token, the positions
where it ends (in insertion order). To draft after a context ``c``:

1. Occurrences: every earlier position whose token equals ``c[-1]`` and that has a following
   token; its match length is how many tokens, backwards from there, equal the end of ``c``
   (at most ``max_match``). Positions are found through the bigram ``c[-2:]`` (through the
   token alone when no bigram occurrence has a continuation); with ``max_occurrences`` set, only
   that many of the most recent bigram (or token) occurrences per index are read.
2. The longest match wins: the occurrences whose match length equals the longest found, ``m``.
3. Their continuations form a counted tree: a node's count is how many of those occurrences
   continue through it. A child's confidence is count(child) / count(parent) (for the first
   token: / number of occurrences), its score the product of confidences along its path.
4. A chain follows the most counted child (ties: the one seen most recently) while its
   confidence is at least ``min_prob``. The request's own context and the earlier outputs each
   give one such chain (from each one's own longest match); each token of a chain has a trust
   key (the match length it extends, whether the match is in the request's own context, its
   count-based confidence and how many occurrences support it), and an ``Acceptance``
   shared by every request learns, per key, how often the target took such a token. The chain
   with more expected accepted tokens is proposed, with those estimates as ``Draft.conf``:
   adaptive K cuts it where it stops paying (a long, well-supported match earns a long draft).
   After each round both chains are scored against the committed tokens, whatever was verified.
5. A tree takes the best-scoring nodes over the longest match of both indexes (each at least
   ``min_prob`` given its parent), at most ``ceil(spec_factor * m)`` levels deep.

Two indexes are read: the request's own context (prompt and output so far) and a shared one of
earlier outputs (and the outputs of requests running beside it), bounded by ``max_history``
tokens, oldest outputs dropped first. ``Draft.bucket`` (for policies without per-token
estimates): the match length (up to 4), plus 4 when the match is only in earlier outputs.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import torch

from forerun.draft_length import Acceptance, chain_yield
from forerun.drafters.base import Draft, Drafter

_SHIFT = 21  # bigram key: (a << 21) | b; token ids below 2M


class TokenIndex:
    """Token sequences and the positions where each token and each bigram ends, in insertion
    order; at most ``max_tokens`` tokens kept (None: unbounded), whole sequences dropped oldest
    first (a sequence being written is dropped too if it alone is too long: appends to a dropped
    sequence are ignored)."""

    def __init__(self, max_tokens: int | None = None):
        if max_tokens is not None and max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self.max_tokens = max_tokens
        self.seqs: dict[int, list[int]] = {}
        self.order: deque[int] = deque()  # sequence ids, oldest first
        self.uni: dict[int, list[int]] = {}  # token -> codes (sid << 32 | position)
        self.bi: dict[int, list[int]] = {}  # bigram key -> codes of the bigram's second position
        self.total = 0
        self.stale = 0  # index entries that point into dropped sequences
        self._next = 0

    def new_sequence(self, tokens=()) -> int:
        sid = self._next
        self._next += 1
        self.seqs[sid] = []
        self.order.append(sid)
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens) -> None:
        seq = self.seqs.get(sid)
        if seq is None:
            return
        uni, bi = self.uni, self.bi
        base = sid << 32
        for t in tokens:
            t = int(t)
            pos = len(seq)
            seq.append(t)
            uni.setdefault(t, []).append(base | pos)
            if pos:
                bi.setdefault((seq[pos - 1] << _SHIFT) | t, []).append(base | pos)
        self.total += len(tokens)
        if self.max_tokens is not None and self.total > self.max_tokens:
            self._shrink()

    def _shrink(self) -> None:
        while self.total > self.max_tokens and self.order:
            sid = self.order.popleft()
            n = len(self.seqs.pop(sid))
            self.total -= n
            self.stale += 2 * n
        if self.stale > 2 * self.total + 4096:  # rebuild the index without the dropped sequences
            live = set(self.seqs)
            for table in (self.uni, self.bi):
                for key in list(table):
                    kept = [c for c in table[key] if (c >> 32) in live]
                    if kept:
                        table[key] = kept
                    else:
                        del table[key]
            self.stale = 0

    def occurrences(self, ctx: list[int], max_match: int, max_occurrences: int | None,
                    exclude: int | None = None) -> list[tuple[int, int, int]]:
        """(match length, sid, position) for each occurrence of ``ctx[-1]`` that has a following
        token, the most recently inserted first. ``exclude``: a sequence id to skip."""
        if not ctx:
            return []
        out = []
        if len(ctx) >= 2:
            codes = self.bi.get((ctx[-2] << _SHIFT) | ctx[-1])
            out = self._scan(codes, ctx, max_match, max_occurrences, exclude, 2)
        if not out:
            out = self._scan(self.uni.get(ctx[-1]), ctx, max_match, max_occurrences, exclude, 1)
        return out

    def _scan(self, codes, ctx, max_match, cap, exclude, known) -> list:
        if not codes:
            return []
        out = []
        seqs = self.seqs
        n_ctx = len(ctx)
        limit = min(max_match, n_ctx)
        for code in reversed(codes):
            if cap is not None and len(out) >= cap:
                break
            sid, pos = code >> 32, code & 0xFFFFFFFF
            seq = seqs.get(sid)
            if seq is None or sid == exclude or pos + 1 >= len(seq):
                continue
            n = min(known, limit)
            while n < limit and n <= pos and seq[pos - n] == ctx[n_ctx - 1 - n]:
                n += 1
            out.append((n, sid, pos))
        return out

    def continuation(self, sid: int, pos: int, n: int) -> list[int]:
        return self.seqs[sid][pos + 1: pos + 1 + n]


class _Node:
    __slots__ = ("count", "recency", "children")

    def __init__(self, recency: int):
        self.count = 0
        self.recency = recency
        self.children: dict[int, _Node] = {}


def continuation_tree(conts: list[list[int]]) -> _Node:
    """Counted tree of continuations, listed most recent first (a node's recency: the index of
    the first continuation through it)."""
    root = _Node(0)
    root.count = len(conts)
    for r, cont in enumerate(conts):
        node = root
        for t in cont:
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = _Node(r)
            child.count += 1
            node = child
    return root


def _best_child(node: _Node):
    return min(node.children.items(), key=lambda kv: (-kv[1].count, kv[1].recency))


def tree_from(root: _Node, max_nodes: int, max_depth: int, min_prob: float):
    """Best nodes by path score: (tokens, parents, confidences), parents before children."""
    heap = []  # (-score, depth, recency, tie, token, node, parent index in picked, confidence)
    tie = 0

    def push(node, parent_idx, score, depth):
        nonlocal tie
        if depth > max_depth:
            return
        for tok, child in node.children.items():
            p = child.count / node.count
            if p >= min_prob:
                heapq.heappush(heap, (-score * p, depth, child.recency, tie, tok, child, parent_idx, p))
                tie += 1

    push(root, -1, 1.0, 1)
    picked = []  # (token, parent index in picked, confidence)
    while heap and len(picked) < max_nodes:
        neg, depth, _, _, tok, node, parent, p = heapq.heappop(heap)
        picked.append((tok, parent, p))
        push(node, len(picked) - 1, -neg, depth + 1)
    # heap order already puts every parent before its children (a child never outscores its parent
    # and is pushed only after it was picked)
    return [t for t, _, _ in picked], [q for _, q, _ in picked], [c for _, _, c in picked]


KEY_MATCH_CAP = 16  # match lengths above this share a trust key


def trust_key(match: int, own: bool, confidence: float, support: int) -> tuple:
    """Trust key of a chain token: the match length it extends (capped), whether the match is in
    the request's own context, its count-based confidence (4 bins) and support (1, 2-3, 4+)."""
    conf_bin = 0 if confidence >= 0.99 else 1 if confidence >= 0.6 else 2 if confidence >= 0.3 else 3
    return min(match, KEY_MATCH_CAP), own, conf_bin, 0 if support <= 1 else 1 if support < 4 else 2


class Candidate:
    """One chain on offer: its tokens, their trust keys, the match it continues."""

    __slots__ = ("tokens", "keys", "match", "own")

    def __init__(self, tokens: list[int], keys: list, match: int, own: bool):
        self.tokens, self.keys, self.match, self.own = tokens, keys, match, own


def candidate_chain(root: _Node, match: int, own: bool, max_len: int, min_prob: float) -> Candidate:
    """The chain down the most counted children (ties: the most recent) while each is at least
    ``min_prob`` of its parent, and each token's trust key."""
    toks, keys = [], []
    node = root
    while len(toks) < max_len and node.children:
        tok, child = _best_child(node)
        p = child.count / node.count
        if p < min_prob:
            break
        keys.append(trust_key(match + len(toks), own, p, child.count))
        toks.append(tok)
        node = child
    return Candidate(toks, keys, match, own)


class SuffixHistory:
    """Earlier outputs, and what drafting from them has been worth, shared by every drafter forked
    from one prototype (one per server)."""

    def __init__(self, max_tokens: int):
        self.index = TokenIndex(max_tokens)
        self.acceptance = Acceptance()


class SuffixDrafter(Drafter):
    name = "suffix"
    cheap_proposals = True

    def __init__(self, max_match: int = 32, min_prob: float = 0.1, spec_factor: float = 2.0,
                 max_occurrences: int | None = 64, max_history: int = 1_000_000, tree_nodes: int | None = None,
                 max_depth: int | None = None, history: SuffixHistory | None = None):
        if max_match < 1:
            raise ValueError("max_match must be >= 1")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError("min_prob must be in [0, 1]")
        self.max_match = max_match
        self.min_prob = min_prob
        self.spec_factor = spec_factor
        self.max_occurrences = max_occurrences
        self.tree_nodes = tree_nodes
        self.max_depth = max_depth  # a draft's depth at most (None: the K asked for)
        self.history = history if history is not None else SuffixHistory(max_history)
        self.local = TokenIndex()
        self.local_sid = None
        self.out_sid = None  # this request's output in the shared history
        self.n_seen = 0
        self.offered: tuple[int, list[Candidate]] | None = None  # (context length, chains) of the last proposal

    def fork(self) -> SuffixDrafter:
        return SuffixDrafter(self.max_match, self.min_prob, self.spec_factor, self.max_occurrences,
                             tree_nodes=self.tree_nodes, max_depth=self.max_depth, history=self.history)

    def forget_history(self) -> None:
        """Drop every earlier output (e.g. after a warm-up run)."""
        self.history.index = TokenIndex(self.history.index.max_tokens)
        self.history.acceptance = Acceptance()
        self.out_sid = None

    def begin(self, prompt, params, generator):
        super().begin(prompt, params, generator)
        self.local = TokenIndex()
        self.local_sid = self.local.new_sequence(prompt)
        self.out_sid = self.history.index.new_sequence()
        self.n_seen = len(prompt)
        self.offered = None

    def accepted(self, tokens: list[int], num_accepted: int) -> None:
        if self.offered is not None:  # what each chain on offer would have earned
            at, chains = self.offered
            self.offered = None
            for c in chains:
                self.history.acceptance.observe_run(c.keys, c.tokens, tokens[at:])
        new = tokens[self.n_seen:]
        self.n_seen = len(tokens)
        self.local.extend(self.local_sid, new)
        self.history.index.extend(self.out_sid, new)

    def match(self, tokens: list[int]) -> tuple[int, list]:
        """The longest match length m (0: none) and its occurrences as (index, sid, position): the
        request's own context first, then history, most recent first within each."""
        occ = [(n, self.local, sid, pos) for n, sid, pos in
               self.local.occurrences(tokens, self.max_match, self.max_occurrences)]
        hist = self.history.index
        occ += [(n, hist, sid, pos) for n, sid, pos in
                hist.occurrences(tokens, self.max_match, self.max_occurrences, exclude=self.out_sid)]
        if not occ:
            return 0, []
        m = max(o[0] for o in occ)
        return m, [o[1:] for o in occ if o[0] == m]

    @staticmethod
    def bucket(m: int, own: bool) -> int:
        """Trust bucket for policies without per-token estimates: the match length (up to 4), and
        whether the match is in this request's own context (1-4) or only in earlier outputs (5-8):
        a short match in someone else's output is a far weaker predictor."""
        return min(m, 4) + (0 if own else 4)

    def candidates(self, tokens: list[int], k: int) -> list[Candidate]:
        """The chains on offer, at most ``k`` tokens each: from the longest match in the request's
        own context, then from the longest in earlier outputs (none where an index has no match)."""
        out = []
        limit = min(k, self.max_depth or k)
        hist = self.history.index
        for idx, own, exclude in ((self.local, True, None), (hist, False, self.out_sid)):
            occ = idx.occurrences(tokens, self.max_match, self.max_occurrences, exclude=exclude)
            if not occ:
                continue
            m = max(o[0] for o in occ)
            root = continuation_tree([idx.continuation(sid, pos, limit) for n, sid, pos in occ if n == m])
            c = candidate_chain(root, m, own, limit, self.min_prob)
            if c.tokens:
                out.append(c)
        return out

    def propose(self, tokens: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft(tokens=torch.zeros(0, dtype=torch.long, device="cpu"), bucket=0)
        if self.tree_nodes:
            return self._propose_tree(tokens, k)
        chains = self.candidates(tokens, k)
        self.offered = (len(tokens), chains)
        if not chains:
            return Draft(tokens=torch.zeros(0, dtype=torch.long, device="cpu"), bucket=0)
        table = self.history.acceptance
        confs = [[table.rate(key) for key in c.keys] for c in chains]
        best = max(range(len(chains)), key=lambda i: chain_yield(confs[i])[-1])  # ties: the own context's
        c = chains[best]
        return Draft(tokens=torch.tensor(c.tokens, dtype=torch.long, device="cpu"), conf=confs[best],
                     bucket=self.bucket(c.match, c.own))

    def _propose_tree(self, tokens: list[int], k: int) -> Draft:
        m, best = self.match(tokens)
        if m == 0:
            return Draft(tokens=torch.zeros(0, dtype=torch.long, device="cpu"), bucket=0)
        limit = min(k, math.ceil(self.spec_factor * m), self.max_depth or k)
        root = continuation_tree([idx.continuation(sid, pos, limit) for idx, sid, pos in best])
        toks, parents, conf = tree_from(root, self.tree_nodes, limit, self.min_prob)
        return Draft(tokens=torch.tensor(toks, dtype=torch.long, device="cpu"),
                     parents=torch.tensor(parents, dtype=torch.long, device="cpu"), conf=conf,
                     bucket=self.bucket(m, any(idx is self.local for idx, _, _ in best)))
