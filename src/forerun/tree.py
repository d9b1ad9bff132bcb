"""Token trees: several candidate continuations verified in one target pass.

A tree of n draft nodes is given by ``parents`` [n]: the parent's node index, or -1 for a child
of the root (the last committed token, which the verify pass runs first). Parents come before
their children. The verify pass runs n + 1 rows: row 0 is the root, row i + 1 is node i, each
at position ``pos + depth`` and attending to the cached prefix and to its own ancestors only.

After verification one root-to-node path is kept; ``path_rows`` lists its rows, and the KV
cache moves those rows' keys and values into consecutive slots (the only data a tree moves).
"""

from __future__ import annotations

import heapq

import numpy as np
import torch


def tree_depths(parents: torch.Tensor) -> list[int]:
    """Each row's depth [n + 1] (the root's is 0), checking that parents come before their children."""
    depth = [0]
    for i, p in enumerate(parents.tolist()):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must come before their children")
        depth.append(depth[p + 1] + 1)
    return depth


def tree_layout(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """depths [n + 1] (root 0) and the ancestor mask [n + 1, n + 1] (True: row i sees row j)."""
    depth = tree_depths(parents)
    anc = np.eye(len(depth), dtype=bool)
    for i, p in enumerate(parents.tolist()):  # a row sees what its parent sees, and itself
        anc[i + 1, : i + 1] = anc[p + 1, : i + 1]
    return torch.tensor(depth, device="cpu"), torch.from_numpy(anc)


def children_lists(parents: torch.Tensor) -> list[list[int]]:
    """Row -> child rows, in node order (row 0 is the root)."""
    kids: list[list[int]] = [[] for _ in range(parents.numel() + 1)]
    for i, p in enumerate(parents.tolist()):
        kids[p + 1].append(i + 1)
    return kids


def greedy_tree_accept(tokens: torch.Tensor, parents: torch.Tensor, target_ids: torch.Tensor):
    """Walk down from the root while a child holds the target's argmax.

    tokens [n] draft tokens; target_ids [n + 1] target argmax per row. Returns (path rows after the
    root, output tokens: the accepted ones plus the target's own next token)."""
    tgt = target_ids.tolist()
    rows, out, _ = greedy_tree_walk(tokens, parents, lambda rs: [tgt[r] for r in rs])
    return rows, out


TREE_WALK_BATCH = 4  # rows per LM-head call of a greedy tree walk (the row reached and 3 below it)
TREE_WALK_MAX_ROWS = 6  # with per-node confidences: the most rows one call asks for
TREE_WALK_MIN_REACH = 0.25  # ... and only rows the walk reaches at least this likely


def greedy_tree_walk(tokens: torch.Tensor, parents: torch.Tensor, argmax_rows, batch: int = TREE_WALK_BATCH,
                     conf: list[float] | None = None):
    """``greedy_tree_accept`` with the target's argmaxes computed only for rows the walk reaches.

    ``argmax_rows(rows)`` gives the target's greedy token at each of the pass rows ``rows`` (a
    list). Each round asks for the row the walk stands on and, in the same call, rows below it
    that the walk is likely to need next: a call costs a pass over the LM head's weights plus a
    little per row, so a row worth asking for is one the walk probably reaches.

    Without ``conf``: up to ``batch - 1`` rows along first children (the drafter's most likely
    continuation: siblings come in order of the drafter's confidence). With ``conf`` (per node,
    the drafter's estimate that the target accepts it once its parent is reached): the rows
    below with the highest chance of being reached (the product of the estimates down the path),
    while that chance is at least ``TREE_WALK_MIN_REACH``, up to ``TREE_WALK_MAX_ROWS`` in all.
    Either way the path is the one the walk takes knowing every row's argmax
    (``greedy_tree_accept``); only the number of calls and rows differs.
    Returns (path rows after the root, output tokens, rows evaluated)."""
    kids = children_lists(parents)
    tok = tokens.tolist()
    known: dict[int, int] = {}
    row, rows, out = 0, [], []
    while True:
        if row not in known:
            ask = _likely_rows(kids, row, conf) if conf is not None else _first_child_rows(kids, row, batch)
            for r, t in zip(ask, argmax_rows(ask)):
                known[r] = int(t)
        want = known[row]
        nxt = next((c for c in kids[row] if tok[c - 1] == want), None)
        out.append(want)
        if nxt is None:
            return rows, out, len(known)
        rows.append(nxt)
        row = nxt


def _first_child_rows(kids: list[list[int]], row: int, batch: int) -> list[int]:
    ask = [row]
    while len(ask) < batch and kids[ask[-1]]:
        ask.append(kids[ask[-1]][0])
    return ask


def _likely_rows(kids: list[list[int]], row: int, conf: list[float]) -> list[int]:
    """``row`` and the rows below it most likely to be reached (best first), see greedy_tree_walk."""
    ask, frontier = [row], [(-conf[c - 1], c) for c in kids[row]]
    heapq.heapify(frontier)
    while frontier and len(ask) < TREE_WALK_MAX_ROWS:
        neg, r = heapq.heappop(frontier)
        if -neg < TREE_WALK_MIN_REACH:
            break
        ask.append(r)
        for c in kids[r]:
            heapq.heappush(frontier, (neg * conf[c - 1], c))
    return ask


def sample_tree_accept(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor, generator=None):
    """Lossless sampling over a tree of fixed candidates (recursive rejection with point-mass drafts).

    p [n + 1, vocab]: the target's probabilities at every row. At a row, each child in turn is
    accepted with the current residual probability of its token; a rejected token is removed from
    the residual (which is renormalised). The token that comes out is distributed exactly as p:
    P(child i) = (1 - sum of earlier) * p(c_i) / (1 - sum of earlier) = p(c_i), and a token that is
    no candidate comes from the final residual with its own probability. An accepted child moves
    the walk down; otherwise (or below a leaf) the output token is drawn from the residual.
    Returns (path rows after the root, output tokens)."""
    kids = children_lists(parents)
    tok = tokens.tolist()
    row, rows, out = 0, [], []
    while True:
        resid = p[row].clone()
        moved = False
        for c in kids[row]:
            t = tok[c - 1]
            mass = float(resid.sum())
            if mass <= 0:
                break
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * mass < float(resid[t]):  # accept with probability resid[t] / mass
                out.append(t)
                rows.append(c)
                row, moved = c, True
                break
            resid[t] = 0.0
        if moved:
            continue
        if float(resid.sum()) <= 0:  # every token with mass was a rejected candidate: impossible but safe
            resid = p[row]
        out.append(int(torch.multinomial(resid / resid.sum(), 1, generator=generator)))
        return rows, out


def graft_chain(tokens: torch.Tensor, parents: torch.Tensor,
                chain: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Add ``chain`` to a tree as one more root-to-node path, sharing the nodes it already has.

    The walk follows existing children while they hold the chain's tokens and appends the rest as
    new nodes (after every existing one, so parents still come first). Returns (tokens, parents,
    the chain's nodes in order)."""
    tok, par = tokens.tolist(), parents.tolist()
    child = {}  # (parent node, token) -> node
    for i, (t, p) in enumerate(zip(tok, par)):
        child.setdefault((p, t), i)
    node, path = -1, []
    for t in chain:
        nxt = child.get((node, t))
        if nxt is None:
            tok.append(int(t))
            par.append(node)
            nxt = child[(node, t)] = len(tok) - 1
        node = nxt
        path.append(node)
    return torch.tensor(tok, dtype=torch.long, device="cpu"), torch.tensor(par, dtype=torch.long, device="cpu"), path
