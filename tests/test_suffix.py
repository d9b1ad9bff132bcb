"""The suffix drafter: its index against a brute-force reference, and lossless drafting."""

import random

import pytest

from forerun.batching import BatchEngine, BatchRequest
from forerun.drafters import make_drafter
from forerun.drafters.suffix import SuffixDrafter, TokenIndex, trust_key
from forerun.engine import Engine
from forerun.errors import ForerunError
from forerun.sampling import SamplingParams

# -- brute-force reference -----------------------------------------------------------------------

def ref_occurrences(ctx, history, max_match, own=True):
    """Every (match length, sequence, position) of ctx[-1] with a following token: ctx itself
    first (most recent first; not with ``own=False``), then history sequences (the latest
    inserted first)."""
    out = []
    for seq in ([ctx] if own else []) + list(reversed(history)):
        for p in range(len(seq) - 2, -1, -1):
            if seq[p] != ctx[-1]:
                continue
            n = 0
            while n < min(max_match, len(ctx)) and n <= p and seq[p - n] == ctx[-1 - n]:
                n += 1
            out.append((n, seq, p))
    return out


def ref_continuations(ctx, history, max_match, limit_of, own=True):
    occ = ref_occurrences(ctx, history, max_match, own)
    if not occ:
        return 0, []
    m = max(o[0] for o in occ)
    limit = limit_of(m)
    return m, [seq[p + 1: p + 1 + limit] for n, seq, p in occ if n == m]


def ref_chain(conts, limit, min_prob, stats=None):
    """The chain down the most counted next tokens; ``stats`` gets (confidence, count) per token."""
    path = []
    while len(path) < limit:
        through = [c for c in conts if c[:len(path)] == path]
        nxt = {}
        for i, c in enumerate(through):
            if len(c) > len(path):
                t = c[len(path)]
                cnt, first = nxt.get(t, (0, i))
                nxt[t] = (cnt + 1, first)
        if not nxt:
            break
        tok, (cnt, _) = min(nxt.items(), key=lambda kv: (-kv[1][0], kv[1][1]))
        if cnt / len(through) < min_prob:
            break
        if stats is not None:
            stats.append((cnt / len(through), cnt))
        path.append(tok)
    return path


def ref_tree(conts, max_nodes, max_depth, min_prob):
    """Every node (a path) whose tokens each pass min_prob given their parent, sorted by (-score,
    depth, recency); the best max_nodes."""
    nodes = {}
    for r, c in enumerate(conts):
        for d in range(1, min(len(c), max_depth) + 1):
            nodes.setdefault(tuple(c[:d]), r)
    def count(path):
        return sum(1 for c in conts if tuple(c[:len(path)]) == path)
    scored = []
    for path, rec in nodes.items():
        score, ok = 1.0, True
        for d in range(1, len(path) + 1):
            p = count(path[:d]) / count(path[:d - 1])
            if p < min_prob:
                ok = False
                break
            score = score * p
        if ok:
            scored.append((-score, len(path), rec, path))
    scored.sort()
    return [s[3] for s in scored[:max_nodes]]


def _drafter_over(ctx, history, **kw):
    d = SuffixDrafter(max_occurrences=None, **kw)
    for h in history:  # earlier requests: their outputs enter the shared history
        d.begin([0], SamplingParams(), None)
        d.accepted([0] + h, 0)
    d.begin(ctx[:3], SamplingParams(), None)
    d.accepted(ctx, 0)
    return d


def ref_candidate(ctx, history, max_match, k, min_prob, own):
    """(tokens, trust keys, match length) of the chain from one index's longest match."""
    m, conts = ref_continuations(ctx, history, max_match, lambda m: k, own)
    stats = []
    toks = ref_chain(conts, k, min_prob, stats) if m else []
    keys = [trust_key(m + j, own, p, cnt) for j, (p, cnt) in enumerate(stats)]
    return toks, keys, m


@pytest.mark.parametrize("seed", range(40))
def test_chain_matches_brute_force(seed):
    rnd = random.Random(seed)
    vocab = rnd.choice([3, 4, 6])
    history = [[rnd.randrange(vocab) for _ in range(rnd.randrange(0, 60))] for _ in range(rnd.randrange(0, 4))]
    ctx = [rnd.randrange(vocab) for _ in range(rnd.randrange(3, 80))]
    max_match, min_prob, k = rnd.choice([2, 5, 32]), rnd.choice([0.0, 0.1, 0.4]), rnd.randrange(1, 12)
    d = _drafter_over(ctx, history, max_match=max_match, min_prob=min_prob)
    table = d.history.acceptance
    for key in {trust_key(m, own, c, s) for m in range(1, 18) for own in (True, False) for c in (1.0, 0.7, 0.4, 0.1)
                for s in (1, 2, 5)}:  # some learned acceptance, different per key
        for _ in range(rnd.randrange(0, 6)):
            table.observe(key, int(rnd.random() < 0.6), 1)
    # this request's context (ctx[3:] is also its own output in the shared history, never read)
    refs = [ref_candidate(ctx, [], max_match, k, min_prob, True),
            ref_candidate(ctx, history, max_match, k, min_prob, False)]
    cands = d.candidates(ctx, k)
    assert [(c.tokens, c.keys, c.match) for c in cands] == [r for r in refs if r[0]]
    draft = d.propose(ctx, k)
    offered = [r for r in refs if r[0]]
    if not offered:
        assert len(draft) == 0 and draft.bucket == 0
        return

    def value(keys):  # expected tokens of the whole chain
        out, reach = 0.0, 1.0
        for key in keys:
            reach *= table.rate(key)
            out += reach
        return out

    best = max(value(r[1]) for r in offered)
    chosen = next(r for r in offered if value(r[1]) == best)  # ties: this request's own context
    assert draft.tokens.tolist() == chosen[0]
    assert draft.conf == pytest.approx([table.rate(key) for key in chosen[1]])
    own = chosen is offered[0] and bool(refs[0][0])
    assert draft.bucket == min(chosen[2], 4) + (0 if own else 4)


def test_every_chain_on_offer_learns_from_the_committed_tokens():
    """After a round, each chain's tokens are scored against what was committed, up to its first
    miss, whatever length the engine verified."""
    d = SuffixDrafter()
    d.begin([0], SamplingParams(), None)
    d.accepted([0, 5, 6, 7, 8], 0)  # an earlier output: 5 6 7 8
    ctx = [1, 5, 6, 9, 1, 5]
    d.begin(ctx, SamplingParams(), None)
    local, hist = d.candidates(ctx, 3)
    assert (local.tokens, local.own, hist.tokens, hist.own) == ([6, 9, 1], True, [6, 7, 8], False)
    d.propose(ctx, 3)
    table = d.history.acceptance
    d.accepted(ctx + [6, 7], 1)  # one draft token accepted and the target's own: 6 7
    assert table.rate(local.keys[0]) > 0.5 > table.rate(local.keys[1])  # taken, then refused
    assert table.rate(hist.keys[0]) > 0.5 and table.rate(hist.keys[1]) > 0.5
    assert hist.keys[2] not in table.counts  # never reached: nothing learned about it
    # the chain whose tokens proved better is now preferred
    d.begin(ctx, SamplingParams(), None)
    assert d.propose(ctx, 3).tokens.tolist() == [6, 7, 8]


@pytest.mark.parametrize("seed", range(25))
def test_tree_matches_brute_force(seed):
    rnd = random.Random(100 + seed)
    vocab = rnd.choice([3, 5])
    history = [[rnd.randrange(vocab) for _ in range(rnd.randrange(0, 50))] for _ in range(rnd.randrange(0, 3))]
    ctx = [rnd.randrange(vocab) for _ in range(rnd.randrange(3, 60))]
    nodes, k, min_prob = rnd.randrange(1, 20), rnd.randrange(1, 7), rnd.choice([0.0, 0.2])
    d = _drafter_over(ctx, history, max_match=4, spec_factor=2.0, min_prob=min_prob, tree_nodes=nodes)
    limit_of = lambda m: min(k, 2 * m)  # noqa: E731
    m, conts = ref_continuations(ctx, history, 4, limit_of)
    draft = d.propose(ctx, k)
    want = ref_tree(conts, nodes, limit_of(m), min_prob) if m else []
    toks, parents = draft.tokens.tolist(), draft.parents.tolist() if draft.parents is not None else []
    paths = []
    for t, p in zip(toks, parents):
        paths.append((paths[p] if p >= 0 else ()) + (t,))
    assert paths == want
    assert draft.depth <= k
    if draft.conf is not None:
        assert all(0 < c <= 1 for c in draft.conf)


def test_history_is_bounded_and_recent_outputs_win():
    idx = TokenIndex(max_tokens=100)
    sids = [idx.new_sequence(range(40)) for _ in range(5)]
    assert idx.total <= 100 and list(idx.seqs) == sids[-2:]
    for _ in range(200):  # dropped sequences leave the index too, eventually
        idx.new_sequence(range(40))
    assert sum(len(v) for v in idx.uni.values()) <= 3 * 100 + 4096
    # the most recent occurrences are read first, and at most max_occurrences of them: the older
    # occurrence of (1, 2) matches 3 tokens, the newer one 2
    ctx = [9, 1, 2, 3, 5, 1, 2, 4, 7, 9, 1, 2]
    for cap, want in ((None, [3, 5, 1]), (1, [4, 7, 9])):
        d = SuffixDrafter(max_occurrences=cap, spec_factor=4)
        d.begin(ctx, SamplingParams(), None)
        assert d.propose(ctx, 3).tokens.tolist() == want
    d = SuffixDrafter(max_occurrences=None, spec_factor=4)
    d.begin([0], SamplingParams(), None)
    d.accepted([0, 1, 2, 3, 1, 2, 4], 0)
    d.begin([7, 1, 2, 3, 1, 2, 5, 1, 2], SamplingParams(), None)
    # four occurrences of (1, 2), each matching 2 tokens: followed by 5 and 3 (this request) and by
    # 4 and 3 (history). A chain comes from one index: this request's, the most recent on a tie (5);
    # a tree counts both, so 3 wins on count
    assert d.propose([7, 1, 2, 3, 1, 2, 5, 1, 2], 1).tokens.tolist() == [5]
    d.tree_nodes = 1
    assert d.propose([7, 1, 2, 3, 1, 2, 5, 1, 2], 1).tokens.tolist() == [3]


def test_learns_across_requests():
    """An output repeated across requests is drafted whole from the second time on."""
    d = SuffixDrafter()
    answer = [11, 12, 13, 14, 15, 16, 17, 18]
    d.begin([1, 2, 3], SamplingParams(), None)
    d.accepted([1, 2, 3] + answer, 0)
    d.begin([4, 5, 11], SamplingParams(), None)
    draft = d.propose([4, 5, 11], 7)  # the whole rest, a confidence per token: adaptive K cuts it
    assert draft.tokens.tolist() == answer[1:] and len(draft.conf) == len(answer) - 1
    assert d.propose([4, 5, 11, 12, 13, 14], 16).tokens.tolist() == answer[4:]
    fork = d.fork()  # a server's slots share one history
    fork.begin([9, 13], SamplingParams(), None)
    assert fork.propose([9, 13, 14], 3).tokens.tolist() == [15, 16, 17]
    d.forget_history()
    fork.begin([9, 13], SamplingParams(), None)
    assert fork.propose([9, 13, 14], 3).tokens.tolist() == []


PROMPTS = [[2, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11], [2, 50, 7, 33, 81, 4, 19], [2, 5]]


@pytest.mark.parametrize("tree", [None, (6, None), (12, 3)])
@pytest.mark.parametrize("k", [2, "auto"])
def test_greedy_equality(gemma, tree, k):
    drafter = make_drafter("suffix", gemma, tree=tree)
    drafted = 0
    for rnd in range(2):  # the second round drafts from the first one's outputs too
        for prompt in PROMPTS:
            ref = Engine(gemma.backend, None, gemma.eos_token_ids).generate(prompt, max_new_tokens=24)
            got = Engine(gemma.backend, drafter, gemma.eos_token_ids).generate(prompt, max_new_tokens=24, k=k)
            assert got.token_ids == ref.token_ids
            drafted += got.stats.drafted
    assert drafted > 0


def test_greedy_equality_llama(llama):
    drafter = make_drafter("suffix", llama)
    for prompt in PROMPTS:
        ref = Engine(llama.backend, None, llama.eos_token_ids).generate(prompt, max_new_tokens=20)
        assert Engine(llama.backend, drafter, llama.eos_token_ids).generate(prompt, max_new_tokens=20, k=3).token_ids == ref.token_ids


def test_batch_engine_shares_history(gemma):
    prompts = [[2, 10 + i, 11, 12, 13, 10 + i, 11] for i in range(5)]
    plain = [Engine(gemma.backend, None, gemma.eos_token_ids).generate(p, max_new_tokens=20).token_ids for p in prompts]
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=make_drafter("suffix", gemma), max_batch=3)
    reqs = [eng.submit(BatchRequest(prompt=p, max_new_tokens=20)) for p in prompts]
    while eng.n_waiting or eng.n_running:
        eng.step()
    assert [r.tokens[len(r.prompt):] for r in reqs] == plain
    assert sum(r.stats.drafted for r in reqs) > 0
    assert eng.drafter.history.index.total > 0  # every slot wrote into the prototype's history


def test_tree_refused_where_it_cannot_run(gemma):
    with pytest.raises(ForerunError, match="lookup"):
        make_drafter("suffix", gemma, tree=(8, None), tree_lookup=True)
