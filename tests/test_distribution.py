"""Sampling is lossless, position by position, on a target whose distributions are spread out
(``spread.py``: the harness, the target, the exact marginals and the bounds)."""

from __future__ import annotations

import pytest
import torch

from forerun.batching import BatchEngine, BatchRequest
from forerun.drafters import make_drafter
from forerun.engine import Engine
from forerun.sampling import SamplingParams, logits_to_probs

from conftest import VOCAB, run_batch
from spread import K, N, NEW, PROMPT, SETTINGS, bound, check, entropy, exact, near_copy, sample, spread_target, tv


@pytest.fixture(scope="module")
def spread():
    return spread_target()


@pytest.fixture(scope="module")
def copy_model(spread):
    return near_copy(spread)


def test_the_target_is_spread_and_every_setting_matters(spread):
    """The harness can fail: sampling greedily, or at temperature 1 without top-k/top-p, gives
    marginals far outside the bounds the tests allow."""
    be = spread.backend.fork()
    be.reset()
    logits = be.forward(torch.tensor(PROMPT), 0).logits[-1].float()
    plain = torch.softmax(logits, -1)
    for setting in SETTINGS:
        marg, joint = exact(spread, setting)
        for j, m in enumerate(marg):
            assert abs(float(m.sum()) - 1) < 1e-6
            assert entropy(m) > 1.0, (setting, j, entropy(m))  # far from one token
            greedy_tv = 1 - float(m.max())  # what a greedy sampler's counts would be at best
            assert greedy_tv > 3 * bound(m), (setting, j)
        assert tv(plain, marg[0]) > 3 * bound(marg[0]), setting  # the setting changes the distribution
    a, b = (exact(spread, s)[0][0] for s in SETTINGS)
    assert tv(a, b) > 3 * max(bound(a), bound(b))
    assert torch.allclose(exact(spread, "t0.7-k4")[0][0].float(),
                          logits_to_probs(logits, SamplingParams(**SETTINGS["t0.7-k4"])),
                          atol=1e-6)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["none", "ngram", "suffix", "draft", "layerskip"])
def test_engine_samples_the_target_distribution(spread, copy_model, method, setting):
    drafter = make_drafter(method, spread, draft_model=copy_model, skip_layers=[1]) if method != "none" else None
    eng = Engine(spread.backend, drafter, eos_token_ids=())

    def run(params):
        res = eng.generate(PROMPT, max_new_tokens=NEW, params=params, k=K)
        return res.token_ids, res.stats.drafted

    counts, joint, drafted = sample(run, setting)
    check(spread, setting, counts, joint)
    if method != "none":
        assert drafted > 2000, drafted  # speculation really happened, several tokens per generation


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_bonus_tokens_after_full_acceptance(spread, copy_model, setting):
    """A draft model close to the target: most drafts are accepted whole, so the bonus token (drawn
    from the target at the position after the draft) is a large share of what is counted."""
    eng = Engine(spread.backend, make_drafter("draft", spread, draft_model=copy_model), eos_token_ids=())
    full = 0

    def run(params):
        nonlocal full
        res = eng.generate(PROMPT, max_new_tokens=NEW, params=params, k=K)
        full += res.stats.accepted_per_position[K - 1] if len(res.stats.accepted_per_position) >= K else 0
        return res.token_ids, res.stats.drafted

    counts, joint, _ = sample(run, setting, seed=1)
    check(spread, setting, counts, joint)
    assert full > 2000 * 0.3, full  # whole drafts accepted: bonus tokens sampled at position K


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_batch_engine_samples_the_target_distribution(spread, copy_model, method, setting):
    eng = BatchEngine(spread.backend, (), drafter=make_drafter(method, spread, draft_model=copy_model), max_batch=8)
    eng.policy.costs = {r: 1.0 for r in range(1, 80)}  # drafts look free: every step drafts K
    eng.policy.margin = -1.0
    eng.policy.k_max = K
    counts = torch.zeros(NEW, VOCAB, dtype=torch.float64)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    drafted = 0
    for i in range(0, N, 8):
        reqs = [BatchRequest(prompt=PROMPT, max_new_tokens=NEW,
                             params=SamplingParams(**SETTINGS[setting], seed=int(torch.randint(0, 2**31, (1,), generator=g))))
                for _ in range(8)]
        for ids in run_batch(eng, reqs):
            assert len(ids) == NEW
            for j, t in enumerate(ids):
                counts[j, t] += 1
            joint[ids[0], ids[1]] += 1
        drafted += sum(r.stats.drafted for r in reqs)
    check(spread, setting, counts, joint)
    assert drafted > N, drafted
