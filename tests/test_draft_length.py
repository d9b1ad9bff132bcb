"""Adaptive draft length: the cost/acceptance model, globally and per trust bucket."""

from forerun.draft_length import AdaptiveK, make_policy, FixedK
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


def test_ngram_reports_match_length():
    toks = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert lookup_match(toks, 3, 4, 1) == ([8, 9, 1], 3)
    assert lookup_match([1, 2, 3, 4], 3, 4, 1) == ([], 0)
    d = NgramDrafter().propose(toks, 2)
    assert d.tokens.tolist() == [8, 9] and d.bucket == 3
