"""Adaptive draft length: the cost/acceptance model, globally and per trust bucket."""

import random

from forerun.bench import _predicted_speedup
from forerun.draft_length import (AcceptanceTable, AdaptiveK, FixedK, TreeOrLookup, chain_yield, expected_tokens,
                                  make_policy)
from forerun.stats import GenerationStats
from forerun.drafters.ngram import NgramDrafter, lookup_match


def _feed(pol, steps, k, accepted, bucket=None, base=0.010, per_token=0.003):
    for _ in range(steps):
        pol.observe(k, accepted, 1e-5 * k, base + per_token * k, bucket=bucket)


def test_make_policy():
    assert isinstance(make_policy("auto"), AdaptiveK)
    assert isinstance(make_policy(3), FixedK) and make_policy(3).next_k() == 3


def test_adaptive_k_follows_acceptance():
    always = AdaptiveK()
    for k in (1, 2, 4, 8):  # measured verify costs grow 0.3 steps per drafted token
        _feed(always, 6, k, k)
    assert always.next_k() >= 8  # everything accepted: long drafts pay
    never = AdaptiveK()
    for k in (0, 1, 2, 4):
        _feed(never, 6, k, 0)
    assert never.k == 0  # nothing accepted: plain decoding
    probes = [never.next_k() for _ in range(never.probe_every)]
    assert probes.count(1) == 1 and probes.count(0) == never.probe_every - 1  # it still probes now and then


def test_adaptive_k_per_bucket():
    pol = AdaptiveK()
    for k in (0, 1, 2, 4, 8):
        _feed(pol, 4, k, k, bucket=4)  # long matches: always right
        _feed(pol, 4, k, 0, bucket=1)  # one-token matches: always wrong
    assert pol.choose(4, 16) >= 8
    assert pol.choose(4, 3) == 3  # never more than the drafter has
    picks = [pol.choose(1, 16) for _ in range(pol.probe_every)]
    assert picks.count(0) == pol.probe_every - 1 and picks.count(1) == 1
    # an unseen bucket starts from acceptance 0.5: 1.5 tokens for 1.3 steps' cost beats 1.75 for 1.6
    assert pol.choose(2, 5) == 1


def test_chain_yield_and_confidence_cut():
    assert chain_yield([]) == [1.0]
    assert chain_yield([0.5, 0.5]) == [1.0, 1.5, 1.75]
    assert chain_yield([1.0, 0.0, 1.0]) == [1.0, 2.0, 2.0, 2.0]
    pol = AdaptiveK()
    assert pol.choose_by_confidence([0.9] * 9) == pol.k_start  # nothing measured yet
    for k in (0, 1, 2, 4, 8):
        _feed(pol, 4, k, 0)  # a pass costs 10 ms + 3 ms per drafted token
    assert pol.choose_by_confidence([]) == 0
    assert pol.choose_by_confidence([0.99] * 20) == pol.k_max  # sure tokens: as many as allowed
    assert pol.choose_by_confidence([0.1] * 8) == 0  # 0.1 more tokens for 30% more time: no draft
    assert pol.choose_by_confidence([0.95, 0.9, 0.1, 0.99, 0.99]) == 2  # cut where the chain turns unlikely
    # drafting is charged per round (the chain was proposed whole), never per kept token
    pol.observe(0, 0, 0.050, 0.010)
    assert pol.round_draft > 0 and pol.choose_by_confidence([0.99] * 20) == pol.k_max


def test_measured_costs_carry_over_to_the_next_request():
    first = AdaptiveK()
    for k in (0, 1, 4):
        _feed(first, 3, k, k)
    first.buckets[3] = [9.0, 1.0, 0]
    nxt = make_policy("auto", first)
    assert nxt.verify == first.verify and nxt.verify is not first.verify
    assert (nxt.draft_cost, nxt.round_draft) == (first.draft_cost, first.round_draft)
    assert nxt.buckets == {} and (nxt.acc, nxt.rej) == (2.0, 2.0)  # acceptance belongs to the request
    assert isinstance(make_policy(4, first), FixedK)


def test_acceptance_table():
    t = AcceptanceTable(decay=1.0)
    assert t.rate("a") == 0.5  # the prior: 1 of 2
    for hit in (True, True, True, False):
        t.observe("a", hit)
    assert t.rate("a") == (3 + 1) / (4 + 2)
    t.observe_run(["x", "y", "z"], [1, 2, 3], [1, 5, 3])  # the run ends at the first miss
    assert t.counts == {"a": [3.0, 4.0], "x": [1.0, 1.0], "y": [0.0, 1.0]}
    t.observe_run(["p", "q"], [1, 2], [1])  # beyond what was committed nothing is known
    assert t.counts["p"] == [1.0, 1.0] and "q" not in t.counts
    forgetful, lasting = AcceptanceTable(decay=0.5), AcceptanceTable(decay=1.0)
    for hit in [False] * 20 + [True] * 20:
        forgetful.observe("k", hit)
        lasting.observe("k", hit)
    assert lasting.rate("k") == 0.5 and forgetful.rate("k") > 0.74  # the forgetful one follows the workload
    try:
        AcceptanceTable(decay=0.0)
    except ValueError:
        pass
    else:
        raise AssertionError("decay 0 accepted")


def test_ngram_reports_match_length():
    toks = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert lookup_match(toks, 3, 4, 1) == ([8, 9, 1], 3)
    assert lookup_match([1, 2, 3, 4], 3, 4, 1) == ([], 0)
    d = NgramDrafter().propose(toks, 2)
    assert d.tokens.tolist() == [8, 9] and d.bucket == 3


def _rounds(pol, n, bucket, *, tree, chain_acc=0, chain_len=4, accepted=0, rows=5):
    # One machine throughout: a round costs 10 ms plus 1 ms per verified row, plus 20 ms of head time.
    for _ in range(n):
        pol.observe(bucket, chain_acc, chain_len, tree, accepted, rows, 0.010 + 0.001 * rows + (0.020 if tree else 0))


def test_tree_or_lookup_learns_what_pays():
    pol = TreeOrLookup()
    assert pol.choose(3, 4, 21) is None  # nothing measured: the tree first
    _rounds(pol, 1, 3, tree=True, chain_acc=4, accepted=5, rows=21)
    assert pol.choose(3, 4, 21) == 4  # then the chain once, to measure a round without the head
    for rows in (1, 2, 3, 5):
        _rounds(pol, 3, 3, tree=False, chain_acc=rows - 1, chain_len=rows - 1, rows=rows)
    # Long matches always right: the chain's 5 tokens in 15 ms beat the tree's 6 in 51 ms.
    _rounds(pol, 6, 3, tree=True, chain_acc=4, accepted=5, rows=21)
    assert pol.choose(3, 4, 21) == 4
    assert pol.choose(3, 2, 19) == 2  # never more than the chain has
    # A bucket where the chain is always wrong but the head's tree yields 5 tokens in 51 ms: the
    # tree beats a plain step (1 token in 11 ms).
    _rounds(pol, 6, 1, tree=True, chain_acc=0, chain_len=4, accepted=4, rows=21)
    assert pol.choose(1, 4, 21) is None
    # Where the tree yields no more than a plain step, nothing is drafted (chain cut to 0).
    _rounds(pol, 20, 0, tree=True, chain_acc=None, chain_len=0, accepted=0, rows=17)
    picks = [pol.choose(0, 0, 17) for _ in range(pol.probe_every)]
    assert picks.count(0) == pol.probe_every - 1 and picks.count(None) == 1  # it still probes the tree
    # Probes that change nothing become rarer: the next windows are 32, 64, 128 choices.
    picks = [pol.choose(0, 0, 17) for _ in range(32 + 64 + 128)]
    assert [i for i, p in enumerate(picks) if p is None] == [31, 32 + 63, 32 + 64 + 127]
    # Once the tree yields more (6 tokens in 47 ms against 1 in 11 ms), the tree is chosen; the choice
    # after the last probe changed, so probing starts again at probe_every and thins out again.
    _rounds(pol, 30, 0, tree=True, chain_acc=None, chain_len=0, accepted=5, rows=17)
    picks = [pol.choose(0, 0, 17) for _ in range(300)]
    assert [i for i, p in enumerate(picks) if p is not None] == [15, 15 + 32, 15 + 32 + 64, 15 + 32 + 64 + 128]


def test_tree_or_lookup_cost_line():
    pol = TreeOrLookup()
    assert pol._cost("chain", 3) is None
    for rows, sec in ((1, 0.010), (3, 0.016)):
        pol.observe(0, None, 0, False, 0, rows, sec)
    assert abs(pol._cost("chain", 5) - 0.022) < 1e-9  # the measured line, extended
    assert pol._cost("chain", 1) == 0.010 and pol._cost("tree", 1) is None


def test_alpha_estimate_recovers_iid_acceptance():
    """Drafts accepted i.i.d. with probability 0.6, four per pass: GenerationStats.alpha recovers 0.6
    (only tested drafts count), while accepted / drafted is far lower; the bench's Leviathan
    prediction built on alpha matches the tokens per pass actually seen."""
    rng = random.Random(0)
    st = GenerationStats()
    for _ in range(20000):
        n = 0
        while n < 4 and rng.random() < 0.6:
            n += 1
        st.record_step(4, n)
    st.record_step(0, 0)  # a pass without a draft is not a rejection
    assert abs(st.alpha - 0.6) < 0.01
    assert st.acceptance_rate < 0.45
    assert abs(expected_tokens(st.alpha, 4) - st.mean_accepted_len) < 0.02
    # free drafts and a verify pass costing one step: predicted speedup = tokens per pass
    none = {"new_tokens": 100, "wall_s": 1.0}
    m = {"drafted": st.drafted, "target_passes": st.target_passes, "alpha": st.alpha, "draft_s": 0.0}
    assert abs(_predicted_speedup(m, none, {"4": 1.0}) - expected_tokens(0.6, 4)) < 0.03
    assert expected_tokens(st.acceptance_rate, 4) < 1.7  # accepted / drafted as alpha: far too low


def test_verify_cost_ratios_are_timed_on_the_given_text(gemma, monkeypatch):
    """With texts, every timed pass feeds that text's own tokens at its positions; texts too short are
    skipped, and with none long enough the ratio falls back to random tokens (and says so)."""
    import torch

    from forerun.bench import verify_cost_ratios

    backend = gemma.backend
    text = [int(t) for t in torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(3))]
    fed = []
    real = backend.forward

    def spy(tokens, pos, *a, **kw):
        fed.append((pos, [int(t) for t in torch.as_tensor(tokens).view(-1)]))
        return real(tokens, pos, *a, **kw)

    verify_cost_ratios(backend, context=20, ks=[1, 3], reps=1)  # the backend's own first-use timings (kernel choice) first
    monkeypatch.setattr(backend, "forward", spy)
    res = verify_cost_ratios(backend, context=20, ks=[1, 3], reps=1, texts=[[7] * 10, text])
    assert res["texts"] == 1 and res["context"] == 20 and res["1"] > 0 and res["3"] > 0
    assert fed and all(toks == text[pos: pos + len(toks)] for pos, toks in fed)
    res = verify_cost_ratios(backend, context=20, ks=[1], reps=1, texts=[[7] * 10])
    assert res["texts"] == 0
