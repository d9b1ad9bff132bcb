"""Speculative sampling through the whole engine, with enough generations to see a shift of 0.01
in total variation: a model without a network (``table_model``) as target and draft, so 50,000
generations take about a minute. What ``test_distribution.py`` checks at 1,200 generations on
tiny transformers (where a bias under about a tenth of the mass passes), here to a hundredth: a
draft model's chains (the rejection sampler, and seeded acceptance) under temperature and top-k,
and a token tree whose second children are taken (the tree sampler) under temperature and top-p."""

from __future__ import annotations

import pytest
import torch
from spread import chi2, chi2_crit
from table_model import TableBackend, TwoWayTree, near

from forerun.drafters.draft_model import DraftModelDrafter
from forerun.engine import Engine
from forerun.sampling import SamplingParams, logits_to_probs

PROMPT = [0, 1, 2, 0, 1, 2, 0]
V, K, NEW = 6, 3, 4
SETTINGS = {
    "t0.9-k4": dict(temperature=0.9, top_k=4),  # top-k cuts 2 of 6 tokens: q keeps some that p cut
    "t0.8-p0.8": dict(temperature=0.8, top_p=0.8),  # top-p cuts 1-3 tokens, varying with the prefix
}
GENERATIONS = 50_000
ALPHA_Z = 3.090  # one-sided normal point of 1e-3, for each of the five checks


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tensors of 6 entries: torch's second thread only adds hand-over time (a fifth of the run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    return TableBackend(V, seed=3)


@pytest.fixture(scope="module")
def exact(target):
    cache = {}

    def truth(setting: str):
        if setting not in cache:
            cache[setting] = exact_marginals(target, SETTINGS[setting])
        return cache[setting]

    return truth


def exact_marginals(target: TableBackend, setting: dict):
    """The target's exact marginals of the NEW positions and the joint of the first two, by walking
    every prefix of positive probability."""
    params = SamplingParams(**setting)
    marg = [torch.zeros(V, dtype=torch.float64) for _ in range(NEW)]
    joint = torch.zeros(V, V, dtype=torch.float64)

    def walk(prefix: list[int], prob: float):
        dist = logits_to_probs(target.logits_of(tuple(PROMPT + prefix)), params).double()
        j = len(prefix)
        marg[j] += prob * dist
        if j == 1:
            joint[prefix[0]] += prob * dist
        if j + 1 < NEW:
            for t in torch.nonzero(dist > 0).flatten().tolist():
                walk(prefix + [t], prob * float(dist[t]))

    walk([], 1.0)
    return marg, joint


def generate_many(eng: Engine, setting: dict, seeded: bool, n: int = GENERATIONS, seed: int = 0):
    counts = torch.zeros(NEW, V, dtype=torch.float64)
    joint = torch.zeros(V, V, dtype=torch.float64)
    drafted = whole = 0
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**31, (n,), generator=g).tolist()
    for s in seeds:
        if not seeded:  # the CPU generator alone (torch.manual_seed also records a stack for each GPU kind)
            torch.default_generator.manual_seed(s)
        res = eng.generate(PROMPT, max_new_tokens=NEW, params=SamplingParams(**setting, seed=s if seeded else None), k=K)
        ids = res.token_ids
        assert len(ids) == NEW, ids
        for j, t in enumerate(ids):
            counts[j, t] += 1
        joint[ids[0], ids[1]] += 1
        drafted += res.stats.drafted
        acc = res.stats.accepted_per_position
        whole += acc[K - 1] if len(acc) >= K else 0
    return counts, joint, drafted, whole


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_check_sees_a_shift_of_a_hundredth(exact, setting):
    """The power, measured: GENERATIONS draws from the exact marginal of the first and second
    position with a shift of total variation 0.01 planted fail the chi-square check in at least
    85 of 100 trials, both where the shift is easiest to see (mass moved from the likeliest token
    to the least likely one kept: 100 of 100) and where it is hardest (between the two likeliest:
    91 and 93 of 100 at these seeds); unshifted draws fail it in at most 1."""
    marg, _ = exact(setting)
    g = torch.Generator().manual_seed(1)
    for p in marg[:2]:
        kept = [t for t in torch.argsort(p, descending=True).tolist() if p[t] > 0]
        for a, b in ((kept[0], kept[-1]), (kept[0], kept[1])):

            def failures(delta):
                q = p.clone()
                q[a] -= delta
                q[b] += delta
                return sum(chi2(torch.bincount(torch.multinomial(q.float(), GENERATIONS, replacement=True, generator=g),
                                               minlength=V), p)[0] >= chi2_crit(len(kept) - 1, ALPHA_Z) for _ in range(100))

            assert failures(0.01) >= 85 and failures(0.0) <= 1, (a, b)


def check(counts, joint, truth):
    marg, jexact = truth
    for j, (c, m) in enumerate(zip(counts, marg)):
        x, df = chi2(c, m)
        assert x < chi2_crit(df, ALPHA_Z), (j, x, chi2_crit(df, ALPHA_Z))
    x, df = chi2(joint, jexact)
    assert x < chi2_crit(df, ALPHA_Z), ("joint", x, chi2_crit(df, ALPHA_Z))


@pytest.mark.parametrize("seeded", [False, True])
def test_the_engine_samples_the_target_to_a_hundredth(target, exact, seeded):
    """50,000 generations of 4 tokens with drafts of 3 from a draft model, unseeded (the rejection
    sampler) and seeded (``SeededNoise``), against the exact marginals of the four positions and
    the joint of the first two (each a chi-square at 1e-3). The draft model's q is
    near p but not p, and its top-k keeps tokens the target's cut: drafts are taken whole, cut
    short and rejected at a token p gives 0."""
    setting = SETTINGS["t0.9-k4"]
    draft = near(target, noise=0.6)
    q = logits_to_probs(draft.logits_of(tuple(PROMPT)), SamplingParams(**setting))
    assert bool(((exact("t0.9-k4")[0][0] == 0) & (q > 0)).any())  # q's top-k keeps a token p cut
    counts, joint, drafted, whole = generate_many(Engine(target, DraftModelDrafter(draft), eos_token_ids=()),
                                                  setting, seeded)
    assert drafted > GENERATIONS and whole > GENERATIONS // 10, (drafted, whole)
    check(counts, joint, exact("t0.9-k4"))


def test_the_tree_sampler_samples_the_target_to_a_hundredth(target, exact):
    """50,000 generations with a token tree of two children at the root (``TwoWayTree``), under
    temperature and top-p: each round's first child is accepted, or rejected and its token taken
    out of the residual before the second child is tried; second children are taken in many
    rounds, and some candidates are tokens top-p gave p = 0. The same checks as above."""
    setting = SETTINGS["t0.8-p0.8"]
    tree = TwoWayTree(near(target, noise=0.6))
    counts, joint, drafted, _ = generate_many(Engine(target, tree, eos_token_ids=()), setting, seeded=False)
    assert drafted > GENERATIONS and tree.second_taken > GENERATIONS // 4, (drafted, tree.second_taken)
    cut = [t for t in range(V) if exact("t0.8-p0.8")[0][0][t] == 0]
    assert cut and set(cut) & set(tree.propose(list(PROMPT), 2).tokens.tolist()), cut  # a candidate p cut
    check(counts, joint, exact("t0.8-p0.8"))
