"""Token trees: layout and masks, tree passes against chain passes, acceptance, rollback."""

import pytest
import torch

from forerun.drafters.base import Draft
from forerun.drafters.eagle import static_tree
from forerun.tree import graft_chain, greedy_tree_accept, greedy_tree_walk, sample_tree_accept, tree_layout

#        root
#       /    \
#     n0      n1
#    /  \      \
#  n2    n3     n4
#  |
#  n5
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2])


def test_tree_layout():
    depth, anc = tree_layout(PARENTS)
    assert depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    want = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6]}
    for row, seen in want.items():
        assert torch.nonzero(anc[row]).flatten().tolist() == seen
    with pytest.raises(ValueError):
        tree_layout(torch.tensor([-1, 2, 0]))  # a parent after its child
    assert Draft(tokens=torch.arange(6), parents=PARENTS).depth == 3


def test_static_tree_is_prefix_closed():
    paths = static_tree(24, 4)
    assert len(paths) == 24 and max(len(p) for p in paths) <= 4
    assert all(p[:-1] in paths for p in paths if len(p) > 1)
    assert paths[0] == (0,) and (0, 0) in paths


def test_graft_chain_shares_existing_nodes():
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    # 10 -> 12 exists (n0 -> n2), then 77 and 78 are new below n2; n5 (15) is left alone.
    t, p, path = graft_chain(tokens, PARENTS, [10, 12, 77, 78])
    assert t.tolist() == [10, 11, 12, 13, 14, 15, 77, 78] and path == [0, 2, 6, 7]
    assert p.tolist() == PARENTS.tolist() + [2, 6]
    tree_layout(p)  # parents still come first
    ids = torch.tensor([10, 12, 0, 77, 0, 0, 0, 78, 5])  # the target follows the grafted chain to its end
    assert greedy_tree_accept(t, p, ids) == ([1, 3, 7, 8], [10, 12, 77, 78, 5])
    t, p, path = graft_chain(tokens, PARENTS, [10, 12, 15])  # already a path: nothing added
    assert t.tolist() == tokens.tolist() and p.tolist() == PARENTS.tolist() and path == [0, 2, 5]
    t, p, path = graft_chain(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [5, 6, 5])
    assert t.tolist() == [5, 6, 5] and p.tolist() == [-1, 0, 1] and path == [0, 1, 2]  # onto an empty tree: a chain


def test_greedy_tree_accept():
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    # target argmax per row (root, n0..n5): root -> 11 (n1), n1 -> 14 (n4), n4 -> 99 (no child)
    ids = torch.tensor([11, 0, 14, 0, 0, 99, 0])
    assert greedy_tree_accept(tokens, PARENTS, ids) == ([2, 5], [11, 14, 99])
    ids = torch.tensor([10, 12, 0, 15, 0, 0, 7])  # root -> n0 -> n2 -> n5 -> bonus 7
    assert greedy_tree_accept(tokens, PARENTS, ids) == ([1, 3, 6], [10, 12, 15, 7])
    ids = torch.tensor([42, 0, 0, 0, 0, 0, 0])
    assert greedy_tree_accept(tokens, PARENTS, ids) == ([], [42])


def test_greedy_tree_walk_matches_the_full_walk_on_fewer_rows():
    """The lazy walk (LM head only on rows it reaches) gives greedy_tree_accept's answer on random
    trees, evaluates each row at most once and every row of its path, and a walk along the
    drafter's first children costs one call."""
    def full_walk(tokens, parents, ids):  # every row's argmax known up front
        kids = [[c + 1 for c, p in enumerate(parents.tolist()) if p + 1 == r] for r in range(len(parents) + 1)]
        row, rows, out = 0, [], []
        while True:
            out.append(int(ids[row]))
            nxt = next((c for c in kids[row] if int(tokens[c - 1]) == out[-1]), None)
            if nxt is None:
                return rows, out
            rows.append(nxt)
            row = nxt

    g = torch.Generator().manual_seed(0)
    fewer = 0
    for trial in range(300):
        n = int(torch.randint(1, 24, (), generator=g))
        parents = torch.tensor([int(torch.randint(-1, i, (), generator=g)) for i in range(n)])
        tokens = torch.randint(0, 3, (n,), generator=g)  # a small alphabet: many matches
        ids = torch.randint(0, 3, (n + 1,), generator=g)
        asked = []

        def argmax_rows(rs):
            asked.extend(rs)
            return ids[rs].tolist()

        # every other trial steers the walk by random node confidences
        conf = torch.rand(n, generator=g).tolist() if trial % 2 else None
        rows, out, n_eval = greedy_tree_walk(tokens, parents, argmax_rows, batch=1 + trial % 5, conf=conf)
        assert (rows, out) == full_walk(tokens, parents, ids) == greedy_tree_accept(tokens, parents, ids)
        assert n_eval == len(asked) == len(set(asked)) and {0, *rows} <= set(asked)
        fewer += n_eval < n + 1
    assert fewer > 200
    calls = []
    ids = torch.tensor([10, 12, 0, 15, 0, 0, 7])  # root -> n0 -> n2 -> n5 -> bonus 7: first children all the way
    walk = greedy_tree_walk(torch.tensor([10, 11, 12, 13, 14, 15]), PARENTS,
                            lambda rs: calls.append(rs) or ids[rs].tolist(), batch=4)
    assert walk == ([1, 3, 6], [10, 12, 15, 7], 4) and calls == [[0, 1, 3, 6]]


def test_greedy_tree_walk_asks_for_the_rows_it_likely_reaches():
    """With node confidences a call takes the rows most likely reached (the product of the
    confidences down the path, best first) while that is at least TREE_WALK_MIN_REACH."""
    from forerun.tree import TREE_WALK_MIN_REACH

    tokens = torch.tensor([10, 11, 12, 13, 14, 15])  # PARENTS: n0, n1 under the root; n2, n3 under n0; ...
    ids = torch.tensor([11, 0, 14, 0, 0, 99, 0])  # root -> n1 -> n4 -> 99
    conf = [0.3, 0.9, 0.9, 0.2, 0.8, 0.9]
    calls = []
    walk = greedy_tree_walk(tokens, PARENTS, lambda rs: calls.append(rs) or ids[rs].tolist(), conf=conf)
    assert walk[:2] == ([2, 5], [11, 14, 99])
    # reach: n1 0.9, n4 0.72, n0 0.3, n2 0.27; n3 0.06, n5 0.243 are below the threshold
    assert TREE_WALK_MIN_REACH == 0.25 and calls == [[0, 2, 5, 1, 3]]
    calls.clear()
    greedy_tree_walk(tokens, PARENTS, lambda rs: calls.append(rs) or ids[rs].tolist(), conf=[0.1] * 6)
    assert calls == [[0], [2], [5]]  # nothing is likely: one row per call


def test_sample_tree_accept_is_lossless():
    """The first output token follows p at the root, whatever the candidates."""
    g = torch.Generator().manual_seed(0)
    V = 5
    p = torch.zeros(7, V)
    p[0] = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0])
    p[1:] = torch.full((6, V), 1.0 / V)
    tokens = torch.tensor([1, 4, 2, 3, 0, 1])  # root's children: token 1 (likely) and token 4 (p = 0)
    N = 20000
    counts = torch.zeros(V)
    for _ in range(N):
        rows, out = sample_tree_accept(tokens, PARENTS, p, g)
        counts[out[0]] += 1
        assert 4 not in out[:1]
    tv = 0.5 * (counts / N - p[0]).abs().sum().item()
    assert tv < 0.015, (counts / N, tv)


def test_tree_pass_matches_chain_passes(gemma):
    """Every node's logits in one tree pass equal those of running its path as a plain chain, and
    keeping one path leaves the cache as if only that path had been run."""
    be = gemma.backend
    prompt = torch.tensor([2, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40])  # longer than the sliding window
    tokens = torch.tensor([50, 51, 52, 53, 54, 55])
    be.reset()
    be.forward(prompt[:-1], 0)
    pos = len(prompt) - 1
    tree_logits = be.forward(torch.cat([prompt[-1:], tokens]), pos, tree=PARENTS).logits
    depth, anc = tree_layout(PARENTS)
    for row in range(1, 7):
        path = [r for r in torch.nonzero(anc[row]).flatten().tolist() if r > 0]
        be.truncate(pos)
        chain = be.forward(torch.cat([prompt[-1:], tokens[[r - 1 for r in path]]]), pos).logits
        assert torch.allclose(tree_logits[row], chain[-1], atol=1e-4), row
    # Keep the path root -> n1 -> n3 -> n5 (rows 1, 3, 6) and continue: same as a plain run.
    be.truncate(pos)
    be.forward(torch.cat([prompt[-1:], tokens]), pos, tree=PARENTS)
    be.keep_rows(pos, [1, 3, 6])
    after_tree = be.forward(torch.tensor([77]), pos + 4).logits
    be.reset()
    plain = be.forward(torch.cat([prompt, tokens[[0, 2, 5]], torch.tensor([77])]), 0).logits[-1]
    assert be.length == pos + 5
    assert torch.allclose(after_tree[-1], plain, atol=1e-4)


def test_engine_keeps_an_accepted_path_off_the_first_branch(gemma):
    """A drafter whose right continuation sits on the second branch of every tree (the first
    branch is wrong): the accepted path's cache rows are not the first ones after the root, so
    the output equals plain decoding only if those rows are moved into place after each pass."""
    from forerun.drafters.base import Draft, Drafter
    from forerun.engine import Engine

    prompt = [2, 50, 7, 33, 81, 4, 19]
    ref = Engine(gemma.backend, None, gemma.eos_token_ids).generate(prompt, max_new_tokens=24).token_ids

    class SecondBranch(Drafter):
        name = "second-branch"

        def propose(self, tokens, k):
            i = len(tokens) - len(prompt)
            right = ref[i: i + 3]
            if len(right) < 2:
                return Draft(tokens=torch.zeros(0, dtype=torch.long))
            wrong = (right[0] + 1) % 90 + 4
            # node 0: a wrong first child; nodes 1..: the right chain under the root's second child
            toks = [wrong, wrong] + right
            parents = [-1, 0, -1] + list(range(2, 2 + len(right) - 1))
            return Draft(tokens=torch.tensor(toks), parents=torch.tensor(parents))

        def fork(self):
            return SecondBranch()

    be = gemma.backend
    res = Engine(be, SecondBranch(), gemma.eos_token_ids).generate(prompt, max_new_tokens=24, k=8)
    assert res.token_ids == ref
    assert res.stats.accepted >= 2 * (res.stats.target_passes - 2)  # the second branch was taken, pass after pass
    # this tiny model's greedy tokens barely depend on far context: check the cache itself, which
    # must hold exactly what a plain prompt pass over the same tokens writes
    n = len(prompt) + len(ref) - 1
    assert be.length == n
    fresh = be.fork()
    fresh.forward(torch.tensor(prompt + ref[:-1]), 0)
    assert torch.allclose(be.cache.k[:, :, :n], fresh.cache.k[:, :, :n], atol=1e-5)
    assert torch.allclose(be.cache.v[:, :, :n], fresh.cache.v[:, :, :n], atol=1e-5)


def test_trees_are_cut_to_the_room_left_before_the_context_limit(gemma):
    """A drafter proposing 8-node trees every step, on prompts 3-13 positions short of the context
    limit: each tree is cut to the positions left, so generation ends at the limit ("context")
    instead of failing on a pass past it."""
    from forerun.drafters.base import Drafter
    from forerun.engine import Engine

    class Bushy(Drafter):
        name = "bushy"

        def propose(self, tokens, k):
            g = torch.Generator().manual_seed(len(tokens))
            n = {0: 0, 1: 2, 2: 5}.get(k, 8)  # depth 3 (8 nodes) where k allows
            toks = torch.randint(4, 90, (8,), generator=g)[:n]
            return Draft(tokens=toks, parents=torch.tensor([-1, -1, 0, 0, 1, 2, 3, 4])[:n])

        def fork(self):
            return Bushy()

    be = gemma.backend
    limit = be.max_context
    for short in range(3, 14):
        prompt = [2] + [int(t) for t in torch.randint(4, 90, (limit - short - 1,), generator=torch.Generator().manual_seed(short))]
        res = Engine(be, Bushy(), ()).generate(prompt, max_new_tokens=64, k=8)
        assert res.finish_reason == "context" and len(prompt) + len(res.token_ids) == limit, short
