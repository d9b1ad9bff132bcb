"""Seeded sampling gives one text: a function of the model, the prompt, the settings and the seed,
whatever the method drafts, the batch it shares and the load (``sampling.SeededNoise``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import run_batch
from spread import bound, tv

from forerun.batching import BatchEngine, BatchRequest
from forerun.drafters import make_drafter
from forerun.engine import Engine
from forerun.sampling import SamplingParams, SeededNoise, _mix

PROMPT = [2, 7, 8, 7, 8, 7, 8, 9, 7, 8]
PARAMS = SamplingParams(temperature=0.9, top_k=20, seed=1234)
METHODS = ("none", "ngram", "suffix", "draft", "layerskip", "suffix-tree")


def _drafter(method, lm, draft_model):
    if method == "none":
        return None
    tree = (8, None) if method.endswith("-tree") else None
    return make_drafter(method.removesuffix("-tree"), lm, draft_model=draft_model, skip_layers=[1], tree=tree)


def test_seeded_noise_draws_the_distribution():
    """argmax(p / E) with E from (seed, position) is an exact sample of p: over many seeds the
    counts follow p (zeros included), at every position; and the noise is the seed's and the
    position's alone."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(40, generator=g) * 1.5, -1)
    p[torch.randperm(40, generator=g)[:8]] = 0  # tokens top-k / top-p removed
    p /= p.sum()
    n = 6000
    for position in (3, 250):
        counts = torch.zeros(40, dtype=torch.float64)
        for seed in range(n):
            counts[int(SeededNoise(seed).sample(p, position))] += 1
        assert counts[p == 0].sum() == 0
        assert tv(counts, p) < bound(p, n), (position, tv(counts, p))
    a, b = SeededNoise(7), SeededNoise(7)
    assert torch.equal(a.noise(5, 40), b.noise(5, 40)) and not torch.equal(a.noise(5, 40), a.noise(6, 40))
    assert not torch.equal(a.noise(5, 40), SeededNoise(8).noise(5, 40))


def test_seeded_noise_is_never_zero_on_a_large_vocabulary():
    """At a 262,144-token vocabulary the uniform draw behind E = -log(1 - u) is exactly 0 at a few
    tokens of a few hundred positions (u comes in steps of 2^-24); E stays above 0 there, so a
    token that top-k or top-p removed (probability 0) never wins the race (0 / 0 would)."""
    vocab, hits = 262144, 0
    for position in range(400):
        noise = SeededNoise(99)
        e = noise.noise(position, vocab)
        u = torch.rand(vocab, generator=torch.Generator().manual_seed(_mix(99, position)))  # the draw behind E
        zero = torch.nonzero(u == 0).flatten()
        assert float(e.min()) > 0, position
        if len(zero):  # the race where the draw was 0: that token given probability 0 must lose
            hits += 1
            p = torch.full((vocab,), 1.0 / (vocab - len(zero)))
            p[zero] = 0
            assert float(p[noise.sample(p, position)]) > 0, position
    assert hits > 0  # some position did draw u = 0


def test_seeded_noise_is_independent_across_positions_and_seeds():
    """The tokens a seed draws at two positions (and at one position under two seeds) are
    independent: over 6,000 seeds, the 4 x 4 pairs of draws from a uniform p over 4 tokens at
    positions 9 and 10 (and under seeds s and s + 1) fill the 16 cells alike (chi-square, 15
    degrees of freedom, below its 0.1% point 37.7)."""
    p = torch.full((4,), 0.25)
    n = 6000
    for pair in ("positions", "seeds"):
        counts = torch.zeros(4, 4)
        for s in range(n):
            a = int(SeededNoise(s).sample(p, 9))
            b = int(SeededNoise(s).sample(p, 10)) if pair == "positions" else int(SeededNoise(s + n).sample(p, 9))
            counts[a, b] += 1
        chi2 = float(((counts - n / 16) ** 2 / (n / 16)).sum())
        assert chi2 < 37.7, (pair, chi2)


@pytest.mark.parametrize("k", [3, "auto"])
def test_seeded_text_is_the_same_for_every_method(spread, copy_model, k):
    """Every method, alone and inside a batch of 16 mixed requests (other prompts, other seeds,
    greedy and unseeded ones), gives plain decoding's seeded text."""
    ref = Engine(spread.backend, None, ()).generate(PROMPT, max_new_tokens=16, params=PARAMS).token_ids
    assert len(set(ref)) > 4  # drawn, not a repeated token
    for method in METHODS:
        drafter = _drafter(method, spread, copy_model)
        eng = Engine(spread.backend, drafter, ())
        outs = [eng.generate(PROMPT, max_new_tokens=16, params=PARAMS, k=k) for _ in range(2)]
        assert [o.token_ids for o in outs] == [ref, ref], method
        if method != "none":
            assert sum(o.stats.drafted for o in outs) > 0, method  # speculation happened
        batch = BatchEngine(spread.backend, (), drafter=drafter, max_batch=16)
        others = [SamplingParams(temperature=0.7, seed=i) if i % 3 == 0 else
                  SamplingParams(temperature=1.2, top_p=0.9) if i % 3 == 1 else SamplingParams() for i in range(15)]
        reqs = [BatchRequest(prompt=[2, 7 + i % 5, 9, 8], max_new_tokens=8 + i, params=s) for i, s in enumerate(others)]
        reqs.insert(7, BatchRequest(prompt=PROMPT, max_new_tokens=16, params=PARAMS))
        assert run_batch(batch, reqs)[7] == ref, method


def test_a_different_seed_gives_another_text(spread):
    eng = Engine(spread.backend, make_drafter("ngram", spread), ())
    texts = {tuple(eng.generate(PROMPT, max_new_tokens=16, params=SamplingParams(temperature=0.9, top_k=20, seed=s)).token_ids)
             for s in range(4)}
    assert len(texts) == 4


@pytest.mark.parametrize("method", METHODS)
def test_server_seeded_requests_repeat_for_every_method(spread, copy_model, method):
    """Through the server: the same seeded request three times, then inside 16 concurrent mixed
    requests, gives plain decoding's text every time."""
    pytest.importorskip("fastapi")
    from serving import setup_for
    from test_server import Live

    from forerun.server.run import build_service

    tree = {"tree_nodes": 8} if method.endswith("-tree") else {}
    kw = {"skip_layers": "1"} if method == "layerskip" else {}
    setup = setup_for(spread, method.removesuffix("-tree"), draft_model=copy_model if method == "draft" else None,
                      **tree, **kw)
    srv = Live(build_service(setup, name="tiny", max_batch=16, max_tokens=64, calibrate=False))
    try:
        prompt = " ".join(f"w{t}" for t in PROMPT)
        ids = spread.tokenizer(prompt).input_ids
        ref = Engine(spread.backend.fork(), None, ()).generate(ids, max_new_tokens=16, params=PARAMS).token_ids
        want = spread.tokenizer.decode(ref, skip_special_tokens=True)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.9, "top_k": 20, "seed": 1234}

        def ask(b):
            status, out = srv.request("POST", "/v1/completions", b)
            assert status == 200, out
            return out["choices"][0]["text"]

        assert [ask(body) for _ in range(3)] == [want] * 3, method
        mixed = [{"model": "tiny", "prompt": f"w2 w{7 + i % 5} w9 w8", "max_tokens": 8 + i,
                  "temperature": [0.7, 1.2, 0][i % 3], **({"seed": i} if i % 3 == 0 else {})} for i in range(15)]
        mixed.insert(7, body)
        with ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(ask, mixed))
        assert texts[7] == want, method
    finally:
        srv.close()


def test_a_windowed_draft_draws_with_each_positions_noise(spread, copy_model):
    """A draft model that read only its window still draws the token at sequence position i with
    position i's noise (the one the target draws its token there with), so that a draft close to
    the target is accepted; and the seeded text is plain decoding's, alone and in a batch."""
    from forerun.drafters.draft_model import DraftModelDrafter

    seen = []

    class Spy(SeededNoise):
        def sample(self, q, position):
            seen.append(position)
            return super().sample(q, position)

    d = DraftModelDrafter(copy_model.backend.fork(), window=4)
    d.begin(PROMPT, PARAMS, Spy(PARAMS.seed))
    d.catch_up(PROMPT)
    assert d.offset == len(PROMPT) - 4
    d.propose(PROMPT, 3)
    assert seen == [len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 2]
    _seeded_alone_and_batched(spread, DraftModelDrafter(copy_model.backend.fork(), window=4, p_min=0.05), k=3)


def _seeded_alone_and_batched(spread, drafter, k) -> None:
    """``drafter`` gives plain decoding's seeded text alone (drafting) and inside a batch of 16
    seeded requests."""
    ref = Engine(spread.backend, None, ()).generate(PROMPT, max_new_tokens=16, params=PARAMS).token_ids
    out = Engine(spread.backend, drafter, ()).generate(PROMPT, max_new_tokens=16, params=PARAMS, k=k)
    assert out.token_ids == ref and out.stats.drafted > 0
    batch = BatchEngine(spread.backend, (), drafter=drafter, max_batch=16)
    reqs = [BatchRequest(prompt=[2, 7 + i % 5, 9, 8], max_new_tokens=8 + i, params=SamplingParams(temperature=0.7, seed=i))
            for i in range(15)]
    reqs.insert(7, BatchRequest(prompt=PROMPT, max_new_tokens=16, params=PARAMS))
    assert run_batch(batch, reqs)[7] == ref


@pytest.mark.parametrize("source", ["ngram", "suffix"])
def test_a_draft_model_with_a_lookup_chain_keeps_the_seeded_text(spread, copy_model, source):
    """Method draft with a model-free chain beside it (``draft_lookup``): plain decoding's seeded
    text, alone and inside a batch of 16 mixed requests."""
    _seeded_alone_and_batched(spread, make_drafter("draft", spread, draft_model=copy_model, draft_lookup=source), "auto")
