"""The draft-length policy: the cost/acceptance model, globally, per trust bucket, per token, and
the tree-or-lookup choice."""

import random

from forerun.bench_report import predicted_speedup, time_split
from forerun.draft_length import Acceptance, DraftLength, chain_yield, expected_tokens, interpolate
from forerun.drafters import make_drafter
from forerun.drafters.ngram import NgramDrafter, lookup_match
from forerun.engine import Engine
from forerun.stats import GenerationStats


def _measured(pol, base=0.010, per_row=0.003, rows=range(1, 20), kind="pass"):
    """A machine where a pass costs 10 ms plus 3 ms per row beyond the first (each row seen twice:
    the first pass of a row count is not a sample)."""
    for r in rows:
        for _ in range(2):
            pol.observe_pass(r, base + per_row * (r - 1), kind)


def _one(pol, avail, bucket=None, conf=None, charge=False):
    return pol.choose([avail], [bucket], [conf], charge_drafting=charge)[0]


def test_fixed_k():
    pol = DraftLength(3)
    assert pol.fixed == 3 and pol.choose([5, 2, 0], [None] * 3) == [3, 2, 0]


def test_adaptive_k_follows_acceptance():
    pol = DraftLength()
    assert _one(pol, 16) == pol.k_start  # nothing measured yet
    _measured(pol)
    pol.accepted.counts[None] = [20.0, 0.1]  # everything accepted: long drafts pay
    assert _one(pol, 16) >= 8
    assert _one(pol, 3) == 3  # never more than the drafter has
    pol.accepted.counts[None] = [0.1, 20.0]  # nothing accepted: plain decoding, with a probe now and then
    picks = [_one(pol, 16) for _ in range(pol.probe_every)]
    assert picks.count(1) == 1 and picks.count(0) == pol.probe_every - 1
    for _ in range(30):  # probes that succeed bring drafting back
        pol.observe(None, 1, 1)
    assert _one(pol, 16) >= 2


def test_probes_of_costly_drafters_thin_out():
    """A drafter that costs per token (its probe is a whole drafting round) is probed at doubling
    intervals while its probes fail; a plan that drafts again resets the interval."""
    pol = DraftLength(refresh_every=1000)  # no pass is timed here: no refresh of the plain step's cost
    _measured(pol)
    pol.observe_draft(1, 1e-3)
    pol.accepted.counts[None] = [0.1, 20.0]
    picks = [_one(pol, 16, charge=True) for _ in range(8 + 16 + 32)]
    probes = [i for i, k in enumerate(picks) if k]
    assert probes == [7, 7 + 16, 7 + 16 + 32]  # intervals 8, 16, 32
    assert [_one(pol, 16) for _ in range(8)].count(1) == 1  # a cheap drafter's probes stay every 8
    for _ in range(30):
        pol.observe(None, 1, 1)
    assert _one(pol, 16, charge=True) >= 1  # drafting pays again: the interval starts over
    assert pol.probe_gap[None] == pol.probe_every


def test_an_outlier_pass_does_not_make_drafting_look_free():
    """One slow plain step (a page fault, another process) moves its average by a fifth at most, and
    a plain step's cost that drafting has kept from being timed is measured again after
    ``refresh_every`` choices: drafting does not go on for ever on a stale, inflated baseline."""
    pol = DraftLength(refresh_every=16)
    _measured(pol)  # 10 ms a step, 3 ms per extra row
    pol.observe_pass(1, 0.500)
    assert pol.cost(1) < 0.010 * 1.21
    pol.observe_pass(1, 0.020)  # a slow hour: the baseline really doubled, so drafting looks cheap
    pol.observe_pass(1, 0.020)
    pol.accepted.counts[None] = [1.0, 3.0]  # a quarter of drafts accepted: 1.25 tokens for 1.3 steps
    picks = [_one(pol, 16) for _ in range(20)]
    assert picks[:16] == [1] * 16  # against the inflated baseline one draft token seems to pay
    assert picks[16] == 0  # 16 choices without a plain step: one runs, to be timed
    for _ in range(20):
        pol.observe_pass(1, 0.010)  # the machine is fast again
    assert _one(pol, 16) == 0


def test_a_plain_step_never_timed_is_timed_before_drafting_is_weighed_against_it():
    """A draft model drafts from its first round, so its passes all have several rows and a plain
    step's cost would only ever be a guess drawn from them: the policy times one (twice: the first
    pass of a row count is not a sample) before it weighs drafting against it, alone as in a batch;
    and its refresh counts choices across requests, which are often shorter than ``refresh_every``."""
    pol = DraftLength(refresh_every=16)
    _measured(pol, rows=range(2, 20))  # 10 ms + 3 ms a row beyond the first, never a pass of one row
    pol.observe_draft(4, 0.004)
    sure = [0.95] * 8
    assert _one(pol, 8, conf=sure, charge=True) == 0  # a plain step, to time it
    pol.observe_pass(1, 0.010)  # not a sample yet
    assert _one(pol, 8, conf=sure, charge=True) == 0
    pol.observe_pass(1, 0.010)
    assert _one(pol, 8, conf=sure, charge=True) > 0
    picks = []
    for _ in range(10):  # short requests of 3 choices each, every one drafting
        pol = pol.renewed("auto")
        for _ in range(3):
            picks.append(_one(pol, 8, conf=sure, charge=True))
            if picks[-1] == 0:
                pol.observe_pass(1, 0.010)
    assert 0 in picks[14:20]  # 16 choices after the last plain step, whichever request they fell in


def test_a_pass_is_priced_no_dearer_than_a_longer_one():
    """One slow first sample starts a row count's average high (3 rows at 50 ms beside 4 rows at
    33 ms); the policy would then avoid those passes and never measure them again, so a pass is
    priced at most what a pass of more rows averaged."""
    pol = DraftLength()
    for r, t in ((1, 0.026), (2, 0.026), (3, 0.050), (4, 0.033), (5, 0.042)):
        for _ in range(2):
            pol.observe_pass(r, t)
    assert pol.cost(3) == 0.033 and pol.cost(4) == 0.033 and pol.cost(5) == 0.042 and pol.cost(1) == 0.026
    assert _one(pol, 2, conf=[0.9, 0.9]) == 2  # two drafts (3 rows) priced as 4 rows cost; at 50 ms, one


def test_a_probe_is_not_charged_as_drafting_cost():
    """A costly drafter's probe catches up on every position since its last round: not what a
    drafted token costs while drafting goes on."""
    pol = DraftLength()
    _measured(pol)
    pol.observe_draft(1, 1e-3)
    pol.accepted.counts[None] = [0.1, 20.0]
    while _one(pol, 16, charge=True) == 0:
        pol.observe_draft(0, 0.0)
    pol.observe_draft(1, 0.5)  # the probe's round
    assert pol.draft_cost == 1e-3
    pol.accepted.counts[None] = [20.0, 0.1]
    assert _one(pol, 16, charge=True) > 0
    pol.observe_draft(4, 8e-3)  # a round of the plan: charged (a sample counts twice the average at most)
    assert pol.draft_cost == 1e-3 * (0.8 + 0.2 * 2)


def test_adaptive_k_per_bucket_and_drafting_cost():
    pol = DraftLength()
    _measured(pol)
    for _ in range(20):
        pol.observe(4, 8, 8)  # long matches: always right
        pol.observe(1, 4, 0)  # one-token matches: always wrong
    assert _one(pol, 16, bucket=4) >= 8
    assert _one(pol, 16, bucket=1) == 0
    # an unseen bucket starts from acceptance 0.5: 1.5 tokens for 1.3 steps' cost beats 1.75 for 1.6
    assert _one(pol, 5, bucket=2) == 1
    # a drafter that is not cheap is charged per drafted token: at a full step per token, no drafts
    assert _one(pol, 16, bucket=4, charge=True) == pol.k_start  # its cost not measured yet
    pol.observe_draft(4, 0.040)
    assert _one(pol, 16, bucket=4, charge=True) < _one(pol, 16, bucket=4)


def test_chain_yield_and_confidence_cut():
    assert chain_yield([]) == [1.0]
    assert chain_yield([0.5, 0.5]) == [1.0, 1.5, 1.75]
    assert chain_yield([1.0, 0.0, 1.0]) == [1.0, 2.0, 2.0, 2.0]
    pol = DraftLength()
    _measured(pol, per_row=0.003)
    assert _one(pol, 0, conf=[]) == 0
    assert _one(pol, 20, conf=[0.99] * 20) == pol.k_max  # sure tokens: as many as allowed
    assert _one(pol, 8, conf=[0.1] * 8) == 0  # 0.1 more tokens for 30% more time: no draft
    assert _one(pol, 5, conf=[0.95, 0.9, 0.1, 0.99, 0.99]) == 2  # cut where the chain turns unlikely


def test_measured_costs_carry_over_to_the_next_request():
    first = DraftLength(k_max=12)
    _measured(first, rows=(1, 2, 5))
    first.observe_draft(2, 0.004)
    first.observe(3, 4, 4)
    first.choices["tree"] = 2
    first.observe_tree(3, 4)
    nxt = first.renewed("auto")
    assert nxt.tree_yield == {3: 4} and nxt.tree_yield is not first.tree_yield
    assert nxt.costs == first.costs and nxt.costs["pass"] is not first.costs["pass"]
    assert nxt.draft_cost == first.draft_cost and nxt.k_max == 12
    assert nxt.accepted.counts == {} and nxt.choices["tree"] == 0  # acceptance belongs to the request
    fixed = first.renewed(4)
    assert fixed.fixed == 4 and fixed.renewed("auto").k_max == 12


def test_interpolate():
    pts = {1: 0.010, 3: 0.016}
    assert abs(interpolate(pts, 2) - 0.013) < 1e-12 and interpolate(pts, 1) == 0.010
    assert abs(interpolate(pts, 5) - 0.022) < 1e-12  # the measured line, extended
    assert interpolate({4: 0.02}, 9) == 0.02  # one point: flat
    assert interpolate({2: 0.010, 3: 0.030}, 1) == 0.010  # never below the cheapest measured
    pol = DraftLength()
    pol.observe_pass(3, 0.5)
    assert pol.cost(3) is None  # the first pass of a row count is not a sample
    pol.observe_pass(3, 0.02)
    assert pol.cost(3) == 0.02 and pol.cost(3, "tree") is None


def test_acceptance():
    """The one acceptance estimate: rounds of one token (a drafter's table keyed per token) and
    rounds of several (the policy's buckets, an n-gram lookup's lengths), a prior, fallbacks, a cap."""
    t = Acceptance(decay=1.0)
    assert t.rate("a") == 0.5  # the prior: 1 taken, 1 refused
    for hit in (True, True, True, False):
        t.observe("a", int(hit), 1)
    assert t.rate("a") == (3 + 1) / (4 + 2)
    t.observe_run(["x", "y", "z"], [1, 2, 3], [1, 5, 3])  # the run ends at the first miss
    assert t.counts == {"a": [4.0, 2.0], "x": [2.0, 1.0], "y": [1.0, 2.0]}
    t.observe_run(["p", "q"], [1, 2], [1])  # beyond what was committed nothing is known
    assert t.counts["p"] == [2.0, 1.0] and "q" not in t.counts
    runs = Acceptance(decay=1.0, prior=(2.0, 2.0))
    runs.observe("b", 3, 5)  # three taken, then a refusal
    assert runs.counts["b"] == [5.0, 3.0]
    runs.observe("b", 4, 4)  # all taken: no refusal
    runs.observe("b", 0, 0)  # nothing drafted: nothing learned
    assert runs.counts["b"] == [9.0, 3.0]
    assert runs.rate("unseen", "b") == 0.75 and runs.rate("unseen", "also unseen") == 0.5
    assert Acceptance(prior=(50.0, 0.0), cap=0.98).rate("k") == 0.98
    forgetful, lasting = Acceptance(decay=0.5), Acceptance(decay=1.0)
    for hit in [False] * 20 + [True] * 20:
        forgetful.observe("k", int(hit), 1)
        lasting.observe("k", int(hit), 1)
    assert lasting.rate("k") == 0.5 and forgetful.rate("k") > 0.74  # the forgetful one follows the workload
    try:
        Acceptance(decay=0.0)
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


def test_tree_or_chain_learns_what_pays():
    pol = DraftLength()
    assert pol.tree_or_chain(3, [0.5] * 4, 21) is None  # nothing measured: the tree first
    pol.observe_pass(21, 0.051, "tree")
    pol.observe_pass(21, 0.051, "tree")
    pol.observe_tree(3, 5)
    assert pol.tree_or_chain(3, [0.5] * 4, 21) == 4  # then the chain, to measure a round without the head
    _measured(pol, per_row=0.001, rows=range(1, 6), kind="chain")  # a chain round: 10 ms + 1 ms per row
    # A sure chain's 5 tokens in 14 ms beat the tree's 6 in 51 ms.
    for _ in range(6):
        pol.observe_tree(3, 6)
    assert pol.tree_or_chain(3, [0.999] * 4, 21) == 4
    assert pol.tree_or_chain(3, [0.999] * 2, 19) == 2  # never more than the chain has
    # A bucket where the chain is always wrong but the head's tree yields 6 tokens in 51 ms: the
    # tree beats a plain step (1 token in 10 ms).
    for _ in range(6):
        pol.observe_tree(1, 6)
    assert pol.tree_or_chain(1, [0.01] * 4, 21) is None
    # Where the tree yields no more than a plain step, nothing is drafted (chain cut to 0).
    for _ in range(20):
        pol.observe_tree(0, 1)
    picks = [pol.tree_or_chain(0, [], 21) for _ in range(pol.tree_probe_every)]
    assert picks.count(0) == pol.tree_probe_every - 1 and picks.count(None) == 1  # it still probes the tree
    # Probes that change nothing become rarer: the next windows are 32, 64, 128 choices.
    picks = [pol.tree_or_chain(0, [], 21) for _ in range(32 + 64 + 128)]
    assert [i for i, p in enumerate(picks) if p is None] == [31, 32 + 63, 32 + 64 + 127]
    # Once the tree yields more (6 tokens in 51 ms against 1 in 10 ms), the tree is chosen; the choice
    # after the last probe changed, so probing starts again at tree_probe_every and thins out again.
    for _ in range(30):
        pol.observe_tree(0, 6)
    picks = [pol.tree_or_chain(0, [], 21) for _ in range(300)]
    assert [i for i, p in enumerate(picks) if p is not None] == [15, 15 + 32, 15 + 32 + 64, 15 + 32 + 64 + 128]
    assert pol.choices["tree"] + pol.choices["chain"] + pol.choices["none"] == 2 + 2 + 1 + 16 + 224 + 300


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
    assert abs(predicted_speedup(m, none, {"4": 1.0}) - expected_tokens(0.6, 4)) < 0.03
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


def test_a_costly_drafter_drafts_while_the_next_token_pays():
    """``draft_more``: with passes of 10 ms + 1 ms a row and drafting at 2.7 ms a token, a draft
    whose tokens the target takes 9 times in 10 goes on, one taken twice in 10 stops; ``cut``
    verifies none of a chain the target would hardly take and all of a sure one; and a costly
    drafter whose first token stopped paying still gets a probe (its confidences are learnt only
    from its drafts)."""
    pol = DraftLength()
    # nothing measured yet: it drafts on to k_start tokens, whatever the draft thinks (not to k_max:
    # under load each longer draft made a batched pass of a row count never timed before)
    assert pol.draft_more([0.1]) and pol.draft_more([0.1] * (pol.k_start - 1))
    assert not pol.draft_more([0.9] * pol.k_start)
    _measured(pol, per_row=0.001)
    pol.observe_draft(4, 0.0108)
    pol.observe_draft(4, 0.0108)
    assert pol.draft_more([0.9]) and pol.draft_more([0.9, 0.9, 0.9])
    assert not pol.draft_more([0.2]) and not pol.draft_more([0.9, 0.2])
    assert pol.cut([0.02, 0.02]) == 0 and pol.cut([0.95] * 5) == 5 and pol.cut([0.95, 0.9, 0.01]) == 2
    ks = [_one(pol, 1, conf=[0.05], charge=True) for _ in range(pol.probe_every)]
    assert ks[:-1] == [0] * (pol.probe_every - 1) and ks[-1] == 1
    assert DraftLength(3).draft_more([0.0]) and DraftLength(3).cut([0.0, 0.0]) == 2  # a fixed k drafts it all


def test_a_lookup_chain_or_the_draft_model_whichever_pays():
    """``lookup_or_model``: a sure lookup chain is verified alone (the model drafts nothing), a
    doubtful one loses to a draft model the target takes 9 times in 10; no chain, the model."""
    pol = DraftLength()
    assert pol.lookup_or_model([0.3, 0.3], [0.9] * 4) == 2  # nothing measured: the chain where there is one
    _measured(pol, per_row=0.001)
    pol.observe_draft(4, 0.0108)
    pol.observe_draft(4, 0.0108)
    assert pol.lookup_or_model([0.95] * 6, [0.9] * 8) == 6
    assert pol.lookup_or_model([0.3, 0.2], [0.9] * 8) is None
    assert pol.lookup_or_model([], [0.9] * 8) is None
    assert pol.lookup_or_model([0.5, 0.5], [0.1] * 8) == pol.cut([0.5, 0.5]) > 0
    assert DraftLength(3).lookup_or_model([0.1] * 5, [0.9]) == 3


def test_in_a_batch_a_drafted_row_costs_what_it_adds_to_the_pass():
    """``batch``/``seq_cost``: alone, a sequence's rows cost a pass of that many rows; in a step of
    16 sequences, a drafted row costs what it adds to the shared pass against a sequence's share of
    it, so a draft that pays alone (and a lookup chain of middling confidence) does not pay there."""
    pol = DraftLength()
    for r in range(1, 40):  # 10 ms a pass plus 1 ms a row
        for _ in range(2):
            pol.observe_pass(r, 0.010 + 0.001 * r)
    pol.observe_draft(4, 0.0004)
    pol.observe_draft(4, 0.0004)
    assert abs(pol.seq_cost(3) - 0.013) < 1e-9
    assert pol.draft_more([0.5]) and pol.cut([0.5, 0.5]) == 2 and pol.lookup_or_model([0.5, 0.5], [0.1] * 4) == 2
    pol.batch(16, 16)
    assert abs(pol.seq_cost(1) - 0.026 / 16) < 1e-9 and abs(pol.seq_cost(3) - 0.026 / 16 - 0.002) < 1e-9
    assert not pol.draft_more([0.5]) and pol.cut([0.5, 0.5]) == 0
    assert pol.lookup_or_model([0.5, 0.5], [0.1] * 4) is None
    pol.batch(1, 1)
    assert pol.draft_more([0.5])


def test_in_a_batch_noisy_pass_averages_do_not_make_drafted_rows_free():
    """``batch_pass``: measured averages at nearby row counts are noisy; where a pass of 24 rows
    averaged less than one of 16 (as a calibration on a busy machine gave), the rows a batch of 16
    adds still cost at least what a row cost from 1 row to 16, so a lookup chain the target takes
    4 times in 10 is not verified for 16 sequences (it was, every row priced at nothing), while
    alone it pays."""
    pol = DraftLength()
    for r, t in ((1, 0.060), (2, 0.062), (4, 0.080), (8, 0.130), (16, 0.270), (24, 0.260), (32, 0.540)):
        for _ in range(2):
            pol.observe_pass(r, t)
    assert pol.cost(16) == 0.260  # no dearer than the 24 rows measured
    assert pol.batch_pass(16, 24) >= 0.260 + 8 * (0.260 - 0.060) / 15 - 1e-12
    assert pol.batch_pass(1, 2) == pol.cost(2) and pol.batch_pass(16, 16) == pol.cost(16)
    assert pol.choose([8] * 16, [None] * 16, [[0.4] * 8] * 16) == [0] * 16
    pol.batch(16, 16)
    assert pol.cut([0.4] * 4) == 0 and pol.seq_cost(2) - pol.seq_cost(1) >= (0.260 - 0.060) / 15 - 1e-12
    pol.batch(1, 1)
    assert pol.cut([0.4] * 4) > 0


def test_until_drafting_is_measured_one_sequence_of_a_batch_drafts():
    """Passes measured but not a drafted token (a server's first batch after its calibration):
    one sequence drafts and so measures drafting; the others step plainly, rather than each
    drafting ``k_start`` unpriced tokens. A draft model's lookup chain is then cut where it pays
    by the passes alone (the model where none of it does), not verified whole."""
    pol = DraftLength()
    _measured(pol, per_row=0.001, rows=range(1, 40))
    assert pol.choose([1, 0, 1, 1], [None] * 4, charge_drafting=True) == [1, 0, 0, 0]
    assert pol.choose([0, 1, 1], [None] * 3, charge_drafting=True) == [0, 1, 0]
    assert pol.choose([1], [None], charge_drafting=True) == [1]
    assert pol.choose([3, 3], [None] * 2) != [0, 0]  # a cheap drafter's plan is priced as before
    pol.batch(16, 16)
    assert pol.lookup_or_model([0.4] * 8, [0.9] * 8) is None
    assert pol.lookup_or_model([0.99] * 8, [0.9] * 8) == pol.cut([0.99] * 8) > 0
    assert DraftLength().lookup_or_model([0.4] * 8, [0.9] * 8) == 8  # nothing measured: the chain


def _draft_model_rounds(pol, speed, conf=0.5, rounds=600, request=128, step=0.040, draft=0.3):
    """A draft model's rounds as ``Decoder._draft_model`` runs them, on a machine whose one-token
    step costs ``step`` x ``speed(t)`` (a pass of R rows the ratios below; a draft token ``draft``
    steps) and a target that takes each drafted token with chance ``conf``; a new request (the
    policy ``renewed``) every ``request`` rounds. Per round: whether a draft was verified."""
    ratio = {1: 1.0, 2: 1.05, 3: 1.21, 4: 1.46, 5: 2.0, 6: 2.3, 7: 2.6, 8: 2.9, 9: 3.2}
    out = []
    for t in range(rounds):
        if t and t % request == 0:
            pol = pol.renewed("auto")
        s = speed(t)
        kept = 0
        if pol.choose([1], [None], [[conf]], charge_drafting=True)[0]:
            confs = [conf]
            while len(confs) < 8 and pol.draft_more(confs):
                confs.append(conf)
            pol.observe_draft(len(confs), len(confs) * draft * step * s, apart=True)
            kept = pol.cut(confs)
        pol.observe_pass(kept + 1, ratio[kept + 1] * step * s)
        out.append(kept > 0)
    return out


def test_a_slow_spell_does_not_stop_a_draft_model_for_good():
    """The machine slows fivefold for 100 rounds while a draft model drafts (another process):
    its passes and drafting are measured slow. Once it is fast again, plain steps are timed fast
    while the costs of drafting's passes stay as the spell left them, so drafting looks too dear
    and stops, and with it what would measure those costs again. Unless probes measure them: a
    probe's draft is verified (not cut to nothing) and its drafting time counts (its reading is
    timed apart), and a fast sample weighs more than a slow one. Drafting pays on this machine
    (without the spell it drafts every round but those that time a plain step: the first two
    rounds after its first draft, then one every ``refresh_every`` choices) and must come back
    within two requests."""
    calm = _draft_model_rounds(DraftLength(), lambda t: 1.0)
    assert calm[:4] == [True, True, False, False] and sum(calm) >= 600 - 2 - 600 // 64
    spell = _draft_model_rounds(DraftLength(), lambda t: 5.0 if 100 <= t < 200 else 1.0)
    assert sum(spell[456:600]) >= 135  # the second request after the spell drafts again


def test_a_draft_model_reads_a_long_prompt_only_where_the_answer_repays_it():
    """``worth_reading``: a step of 10 ms (+1 ms a row), a draft token 2.7 ms, a token read
    2.5 ms. A prompt of 400 tokens costs a second to read, a hundred steps: not at the first token,
    not for an answer cut short by what the request may still make, and once the tokens made so
    far, were as many to follow, would repay it at what the drafts save; a short prompt, which an
    answer of ``ANSWER_PRIOR`` tokens repays, at once. Drafts the target would hardly take save a
    quarter of a step at the least, so low estimates never keep the model from reading for good;
    once the model's whole rounds are measured, their cost a token decides. Unmeasured or with
    ``k`` fixed: it reads (that measures)."""
    pol = DraftLength()
    assert pol.worth_reading(400, 0, 128, [0.9] * 8)  # nothing measured
    _measured(pol, per_row=0.001)
    pol.observe_draft(4, 0.0108)
    pol.observe_draft(4, 0.0108)
    assert pol.worth_reading(400, 0, 128, [0.9] * 8)  # the reading is not measured yet
    pol.observe_reading(16, 1.0)  # too short a reading to be a sample
    assert pol.read_cost is None
    pol.observe_reading(100, 0.25)
    assert abs(pol.read_cost - 0.0025) < 1e-12
    conf = [0.9] * 8
    gain = chain_yield(conf)
    saving = 0.010 - min((j * 0.0027 + pol.cost(j + 1)) / gain[j] for j in range(1, 9))
    repaid = int(1.0 / saving) + 1  # the tokens that repay a second's reading
    assert 100 < repaid < 400
    assert not pol.worth_reading(400, 0, 1000, conf)
    assert not pol.worth_reading(400, repaid - 2, 1000, conf)
    assert pol.worth_reading(400, repaid, 1000, conf)
    assert not pol.worth_reading(400, repaid, repaid - 2, conf)  # too little left to repay it
    assert pol.worth_reading(20, 0, 1000, conf)  # 50 ms: sixteen tokens repay it
    assert not pol.worth_reading(20, 0, 1000, [0.0] * 8)  # not at a quarter of a step a token
    assert not pol.worth_reading(400, 399, 1000, [0.0] * 8)  # a quarter of a step a token
    assert pol.worth_reading(400, 400, 1000, [0.0] * 8)
    pol.observe_model_round(2, 0.008)  # the model's rounds measured: 4 ms a committed token, whatever the rates say
    assert not pol.worth_reading(400, 165, 1000, [0.0] * 8) and pol.worth_reading(400, 167, 1000, [0.0] * 8)
    assert pol.renewed("auto").read_cost == pol.read_cost  # it describes the machine and the model
    assert pol.renewed("auto").model_round == pol.model_round
    assert DraftLength(4).worth_reading(400, 0, 128, conf)


def test_a_draft_model_leaves_a_long_prompt_unread_for_a_short_answer(gemma, gemma_draft):
    """In the decode step: with a reading measured dear, a draft model asked for three tokens
    after a long prompt reads none of it (a plain step is cheaper than what the reading would
    cost), and the output is plain decoding's."""
    drafter = make_drafter("draft", gemma, draft_model=gemma_draft)
    eng = Engine(gemma.backend, drafter)
    prompt = [2] + [(7 * i) % 90 + 3 for i in range(120)]
    first = eng.generate(prompt[:24], max_new_tokens=40, k="auto")  # measures steps and drafting
    plain = Engine(gemma.backend, None).generate(prompt, max_new_tokens=3).token_ids
    eng.policy.observe_reading(100, 1.0)  # ten milliseconds a token read
    got = eng.generate(prompt, max_new_tokens=3, k="auto")
    assert got.token_ids == plain and got.stats.drafted == 0
    shared = next(i for i, (a, b) in enumerate(zip(prompt[:24] + first.token_ids, prompt)) if a != b)
    assert drafter.backend.length == shared  # what the first request left of the same start, nothing read


def test_a_draft_models_reading_is_timed_apart_from_its_drafting(gemma, gemma_draft):
    """``stats.read_s``: the part of ``draft_s`` a draft model spent reading what it had not read
    (here, its prompt before the first draft); the bench's time split shows it apart and prices a
    drafted token without it, and with it in brackets."""
    eng = Engine(gemma.backend, make_drafter("draft", gemma, draft_model=gemma_draft))
    prompt = [2] + [(5 * i) % 80 + 3 for i in range(60)]
    st = eng.generate(prompt, max_new_tokens=12, k=2).stats
    assert st.drafted > 0 and 0.0 < st.read_s < st.draft_s
    again = eng.generate(prompt[:2], max_new_tokens=12, k=2).stats  # one token to read: no reading
    assert again.read_s == 0.0 and again.draft_s > 0.0
    none = {"target_passes": 10, "new_tokens": 10, "verify_s": 1.0, "wall_s": 1.0, "draft_s": 0.0}
    m = {"target_passes": 4, "new_tokens": 10, "verify_s": 0.5, "wall_s": 1.0, "draft_s": 0.3, "read_s": 0.1,
         "drafted": 8}
    split = time_split({"none": none, "draft:2": m})["draft:2"]
    assert abs(split["read"] - 10.0) < 1e-9 and abs(split["draft"] - 30.0) < 1e-9
    assert abs(split["draft_per_step"] - 0.25) < 1e-9 and abs(split["draft_per_step_read"] - 0.375) < 1e-9
