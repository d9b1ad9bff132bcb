"""Online adaptation of trained heads: it learns, it reverts, it saves, and output never changes."""

import pytest
import torch
from test_engine import PROMPTS
from test_heads import _sequences

from forerun.batching import BatchEngine, BatchRequest
from forerun.drafters import make_drafter
from forerun.drafters.head_training import TrainConfig, Trainer
from forerun.drafters.heads import load_head
from forerun.engine import Engine
from forerun.errors import ForerunError
from forerun.training.evaluate import replay_generation

FAST = {"lr": 1e-2, "every": 1, "guard_rounds": 8, "window": 24, "batch": 3}


@pytest.fixture(scope="module")
def untrained(gemma, tmp_path_factory):
    """Fresh heads (the target's own next-token head, zeroed residual branches): they know nothing
    of the stream they will see."""
    be = gemma.backend
    out = {}
    for kind in ("eagle", "medusa"):
        tc = TrainConfig(kind=kind, draft_vocab=80, n_heads=2, head_dim=16, intermediate=64, steps_ahead=3)
        tr = Trainer.of_target(tc, be.model)
        path = tmp_path_factory.mktemp(kind + "-untrained")
        tr.new_head(torch.arange(4, 84)).save(path)
        out[kind] = path
    return out


def _stream(gemma, layers, n=24, length=24, seed=3):
    """Sequences that follow a fixed rule (each token's image under a permutation), with the
    target's features over them: a workload whose continuations repeat."""
    be = gemma.backend
    out = []
    for s in _sequences(n=n, length=length, seed=seed):
        be.reset()
        out.append((s.ids, be.forward(torch.tensor(s.ids), 0, layers=layers, logits=False).layers))
    return out


def _replay(drafter, stream, k=3):
    """tau per sequence, replayed as a greedy generation whose answer is the stream's."""
    taus = []
    with torch.inference_mode():
        for ids, feats in stream:
            commits, _ = replay_generation(drafter, ids, 2, feats, k)
            taus.append(sum(commits) / len(commits))
    return taus


def _third(taus, which):
    t = len(taus) // 3
    part = taus[:t] if which == "first" else taus[-t:]
    return sum(part) / len(part)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_adaptation_raises_acceptance_on_a_repetitive_stream(gemma, untrained, kind):
    plain = make_drafter(kind, gemma, head_path=untrained[kind])
    stream = _stream(gemma, list(plain.feature_layers))
    fixed = _replay(plain, stream)
    adapting = make_drafter(kind, gemma, head_path=untrained[kind], adapt=FAST)
    learned = _replay(adapting, stream)
    assert adapting.adapter.updates > 50 and adapting.adapter.reverts == 0
    assert _third(learned, "last") > _third(learned, "first") + 0.3
    assert _third(learned, "last") > _third(fixed, "last") + 0.3


def test_guard_reverts_a_poisoned_update(gemma, untrained, tmp_path):
    # a head that predicts the stream well: adapted on it, saved as the "shipped" head
    teacher = make_drafter("eagle", gemma, head_path=untrained["eagle"], adapt=FAST)
    stream = _stream(gemma, list(teacher.feature_layers))
    _replay(teacher, stream)
    teacher.adapter.save(tmp_path / "good")
    shipped = load_head(tmp_path / "good").state_dict()

    d = make_drafter("eagle", gemma, head_path=tmp_path / "good", adapt=dict(FAST, lr=0.5, every=4))
    ad = d.adapter
    real_windows = ad._windows

    def poisoned(log):  # every update learns random labels at a huge learning rate
        g = torch.Generator().manual_seed(ad.updates)
        return [(torch.randint(4, 84, ids.shape, generator=g), f, s) for ids, f, s in real_windows(log)]

    ad._windows = poisoned
    states = []
    ad.on_update = lambda: states.append((ad.reverts, {k: v.clone() for k, v in d.head.state_dict().items()}))
    taus = _replay(d, _stream(gemma, list(d.feature_layers), n=30))
    assert ad.updates > 0 and ad.reverts >= 1
    after_revert = next(st for r, st in states if r == 1)
    assert all(torch.equal(after_revert[k], shipped[k]) for k in shipped)
    assert min(taus) < _third(taus, "first")  # acceptance did fall before the guard acted


def test_adapted_head_saves_and_reloads_bit_identically(gemma, untrained, tmp_path):
    d = make_drafter("eagle", gemma, head_path=untrained["eagle"], adapt=FAST)
    _replay(d, _stream(gemma, list(d.feature_layers), n=6))
    assert d.adapter.updates > 0
    d.adapter.save(tmp_path / "adapted")
    back = load_head(tmp_path / "adapted").state_dict()
    live = d.head.state_dict()
    assert back.keys() == live.keys() and all(torch.equal(back[k], live[k]) for k in live)
    assert not all(torch.equal(back[k], load_head(untrained["eagle"]).state_dict()[k]) for k in live)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("tree", [None, (6, 3)])
def test_greedy_equality_while_adapting(gemma, untrained, kind, tree):
    d = make_drafter(kind, gemma, head_path=untrained[kind], tree=tree, adapt=dict(FAST, guard_rounds=2))
    ref = Engine(gemma.backend, None, gemma.eos_token_ids)
    eng = Engine(gemma.backend, d, gemma.eos_token_ids)
    for _ in range(2):
        for p in PROMPTS:
            assert eng.generate(p, max_new_tokens=24, k=3).token_ids == ref.generate(p, max_new_tokens=24).token_ids
    assert d.adapter.updates > 0


def test_batches_equal_plain_while_adapting(gemma, untrained):
    prompts = [[2, 10 + i, 11, 12, 13, 10 + i, 11] for i in range(5)]
    plain = [Engine(gemma.backend, None, gemma.eos_token_ids).generate(p, max_new_tokens=20).token_ids for p in prompts]
    drafter = make_drafter("eagle", gemma, head_path=untrained["eagle"], adapt=dict(FAST, guard_rounds=2))
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=drafter, max_batch=3)
    reqs = [eng.submit(BatchRequest(prompt=p, max_new_tokens=20)) for p in prompts]
    while eng.n_waiting or eng.n_running:
        eng.step()
    assert [r.tokens[len(r.prompt):] for r in reqs] == plain
    assert drafter.adapter.updates > 0  # the slots' forks train one shared head


def test_sampling_distribution_while_adapting(tmp_path):
    """Every position of sampled continuations (K-token drafts, K + 2 tokens) follows the target's
    own distribution while the head is being updated, on a target with spread-out distributions
    (``spread.py``)."""
    from spread import NEW, PROMPT, K, check, sample, spread_target

    lm = spread_target()
    be = lm.backend
    tc = TrainConfig(kind="eagle", draft_vocab=80, n_heads=2, head_dim=16, intermediate=64, steps_ahead=3)
    tr = Trainer.of_target(tc, be.model)
    tr.new_head(torch.arange(4, 84)).save(tmp_path / "head")
    d = make_drafter("eagle", lm, head_path=tmp_path / "head", adapt=dict(FAST, every=40, guard_rounds=4))
    eng = Engine(be, d, eos_token_ids=())

    def run(params):
        res = eng.generate(PROMPT, max_new_tokens=NEW, params=params, k=K)
        return res.token_ids, res.stats.drafted

    setting = "t1.4-k6-p0.85"
    counts, joint, drafted = sample(run, setting, seed=2)
    assert drafted > 1000 and d.adapter.updates > 20
    check(lm, setting, counts, joint)


def test_adapt_refused_where_it_cannot_learn(gemma):
    with pytest.raises(ForerunError, match="adapt"):
        make_drafter("ngram", gemma, adapt=True)
