"""Batched speculation: many sequences per target pass, each equal to its own plain decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import always_draft, run_batch

from forerun.batching import BatchEngine, BatchRequest, QueueFull
from forerun.draft_length import DraftLength
from forerun.drafters.ngram import NgramDrafter
from forerun.engine import Engine
from forerun.errors import ForerunError
from forerun.sampling import SamplingParams


def _prompts(n, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(4, vocab, (3 + i,), generator=g).tolist()
        out.append([2] + base * 3)  # repeats: n-gram drafts find matches
    return out


def test_forward_batch_equals_single_passes(gemma):
    be = gemma.backend
    seqs = [be.fork() for _ in range(3)]
    prompts = _prompts(3)
    singles = []
    for s, p in zip(seqs, prompts):
        s.forward(torch.tensor(p[:-2]), 0)
        ref = be.fork()
        ref.forward(torch.tensor(p[:-2]), 0)
        singles.append(ref.forward(torch.tensor(p[-2:]), len(p) - 2).logits)
    out = [o.logits for o in be.forward_batch(seqs, [torch.tensor(p[-2:]) for p in prompts], [len(p) - 2 for p in prompts])]
    for a, b, s, p in zip(out, singles, seqs, prompts):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert s.length == len(p)


def test_one_attention_call_for_all_sequences_equals_one_per_sequence(gemma, each_build):
    """The batched pass attends for every sequence in one kernel call: each row's output equals,
    bit for bit, attention over that sequence's own cache alone (chains and a window)."""
    from forerun.backends.attention import RowKeys, SequenceRows, attention_rows, attn_rows_kernel

    if attn_rows_kernel() is None:
        pytest.skip("no C compiler")
    be = gemma.backend
    m = be.model
    g = torch.Generator().manual_seed(0)
    seqs, keys, qs = [], [], []
    spots = [(5, 3), (17, 1), (9, 4)]
    for n, (pos, T) in enumerate(spots):
        s = be.fork().cache
        s.ensure_capacity(pos + T)
        s.k.copy_(torch.randn(s.k.shape, generator=g))
        s.v.copy_(torch.randn(s.v.shape, generator=g))
        seqs.append(s)
        keys.append(RowKeys.chain(pos, T, 8 if n == 1 else None))
        qs.append(torch.randn(T, m.n_heads, m.head_dim, generator=g))
    joined = SequenceRows(seqs, keys, [p for p, _ in spots])
    for idx in range(be.num_layers):
        alone = torch.cat([attention_rows(q, s.k[idx], s.v[idx], k, m.scale) for s, k, q in zip(seqs, keys, qs)])
        assert torch.equal(joined.attend(torch.cat(qs), idx, m.scale), alone)
    # and the rows' keys and values go where each sequence's own store puts them
    rows = sum(T for _, T in spots)
    k = torch.randn(rows, m.n_kv_heads, m.head_dim, generator=g)
    v = torch.randn(rows, m.n_kv_heads, m.head_dim, generator=g)
    twins = [be.fork().cache for _ in seqs]
    r = 0
    for t, s, (pos, T) in zip(twins, seqs, spots):
        t.ensure_capacity(s.k.shape[2])
        t.k.copy_(s.k)
        t.v.copy_(s.v)
        t.store(1, k[r: r + T], v[r: r + T], pos)
        r += T
    joined.store(k, v, 1)
    for t, s in zip(twins, seqs):
        assert torch.equal(t.k, s.k) and torch.equal(t.v, s.v)


@pytest.mark.parametrize("speculate", [True, False])
def test_greedy_batch_equals_plain(gemma, speculate):
    prompts = _prompts(5)
    plain = [Engine(gemma.backend, None, gemma.eos_token_ids).generate(p, max_new_tokens=20).token_ids for p in prompts]
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=3, speculate=speculate)
    eng.calibrate(reps=1)
    reqs = [BatchRequest(prompt=p, max_new_tokens=20) for p in prompts]
    outs = run_batch(eng, reqs)
    assert outs == plain
    drafted = sum(r.stats.drafted for r in reqs)
    assert (drafted > 0) == speculate
    assert (sum(r.stats.accepted for r in reqs) > 0) == speculate  # equality earned with accepted drafts
    for r in reqs:  # every pass commits its accepted drafts plus one token of the target's own
        assert r.stats.new_tokens == len(r.tokens) - len(r.prompt) == r.stats.accepted + r.stats.target_passes
    assert eng._n_slots == 3  # slots are reused by later requests


def test_requests_join_and_leave_between_steps(gemma):
    prompts = _prompts(4, seed=1)
    plain = [Engine(gemma.backend, None, gemma.eos_token_ids).generate(p, max_new_tokens=n).token_ids
             for p, n in zip(prompts, (3, 17, 9, 25))]
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=4)
    eng.calibrate(reps=1)
    got = {}
    reqs = [BatchRequest(prompt=p, max_new_tokens=n) for p, n in zip(prompts, (3, 17, 9, 25))]
    for r in reqs:
        r.on_event = (lambda r: lambda toks, fin: got.setdefault(r.id, []).extend(toks))(r)
    eng.submit(reqs[0])
    eng.submit(reqs[1])
    eng.step()
    eng.step()
    eng.submit(reqs[2])  # joins while others run
    eng.step()
    eng.submit(reqs[3])
    while eng.active or eng.waiting:
        eng.step()
    assert [got[r.id] for r in reqs] == plain


def test_cancel_frees_the_slot_and_queue_is_bounded(gemma):
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=1, max_waiting=1)
    finishes = []
    a = BatchRequest(prompt=_prompts(1)[0], max_new_tokens=50, on_event=lambda t, f: f and finishes.append(f))
    b = BatchRequest(prompt=_prompts(1)[0], max_new_tokens=2, on_event=lambda t, f: f and finishes.append(f))
    eng.submit(a)
    eng.step()
    eng.submit(b)
    with pytest.raises(QueueFull):
        eng.submit(BatchRequest(prompt=[2, 5], max_new_tokens=2))
    eng.cancel(a)
    eng.step()
    assert finishes[0] == "cancelled" and eng.active == [b]
    while eng.active:
        eng.step()
    assert finishes == ["cancelled", "length"]


def test_a_cancelled_waiting_request_leaves_the_queue_at_once(gemma):
    """Cancelling a request that is still waiting frees its place in the queue (no more 429s for
    it) and tells its listener, without a step of the engine."""
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=1, max_waiting=1)
    events = {}
    reqs = [BatchRequest(prompt=_prompts(1)[0], max_new_tokens=4,
                         on_event=(lambda i: lambda t, f: f and events.setdefault(i, f))(i)) for i in range(3)]
    eng.submit(reqs[0])
    eng.submit(reqs[1])
    with pytest.raises(QueueFull):
        eng.submit(reqs[2])
    eng.cancel(reqs[1])
    assert events == {1: "cancelled"} and eng.n_waiting == 1
    eng.submit(reqs[2])  # its place is free now
    eng.cancel(reqs[1])  # twice: still one event
    while eng.active or eng.waiting:
        eng.step()
    assert events == {1: "cancelled", 0: "length", 2: "length"}


def _load_aware(**kw) -> DraftLength:
    return DraftLength(k_max=4, decay=0.95, margin=0.03, **kw)


def test_load_aware_k_stops_drafting_when_rows_cost_full_price():
    pol = _load_aware()
    pol.accepted.counts[None] = [5.0, 5.0]  # acceptance 0.5
    pol.costs["pass"] = {r: 0.010 for r in range(1, 6)}  # flat: drafts are free at batch 1
    assert pol.choose([4], [None]) == [4]
    pol.costs["pass"] = {r: 0.010 * r for r in range(1, 100)}  # every row costs a full step: never pays
    assert pol.choose([4] * 8, [None] * 8) == [0] * 8
    # a trusted bucket keeps its drafts when an untrusted one loses them
    pol.costs["pass"] = {r: 0.010 + 0.004 * r for r in range(1, 100)}
    pol.accepted.counts[3] = [19.0, 1.0]
    pol.accepted.counts[1] = [1.0, 19.0]
    ks = pol.choose([4, 4], [3, 1])
    assert ks[0] > 0 and ks[1] == 0
    # sequential backends: a step costs one pass per sequence, so a second sequence's drafts are
    # priced on its own pass
    seq = _load_aware(sequential=True)
    seq.accepted.counts[None] = [5.0, 5.0]
    seq.costs["pass"] = {1: 0.010, 2: 0.010, 3: 0.030, 4: 0.050, 5: 0.070}
    assert seq.choose([4, 4], [None, None]) == [1, 1]


def test_load_aware_k_reads_per_token_confidences():
    """A draft's own per-token estimates (Draft.conf) replace its bucket's: a chain is cut where
    its tokens turn unlikely, and a sure chain keeps its drafts beside an unsure one."""
    pol = _load_aware()
    pol.costs["pass"] = {r: 0.010 + 0.004 * r for r in range(1, 100)}
    pol.accepted.counts[None] = [1.0, 19.0]  # the bucket alone would say: never draft
    assert pol.choose([4], [None]) == [0]
    assert pol.choose([4], [None], [[0.99, 0.98, 0.05, 0.99]]) == [2]
    assert pol.choose([4, 4], [None, None], [[0.99] * 4, [0.05] * 4]) == [4, 0]
    assert pol.choose([4, 4], [None, None], [None, [0.99] * 4]) == [0, 4]


def test_load_aware_k_probes_a_bucket_it_stopped_drafting_for():
    """An acceptance estimate that fell too low is measured again: after probe_every choices with
    drafts on offer and none kept, the bucket gets one draft token; good results bring drafting back."""
    pol = _load_aware(probe_every=5)
    pol.costs["pass"] = {r: 0.010 + 0.004 * r for r in range(1, 100)}
    pol.accepted.counts[1] = [0.1, 19.0]  # acceptance ~0: drafting does not pay
    picks = [pol.choose([4, 4], [1, 1]) for _ in range(10)]
    assert [p for p in picks if any(p)] == [[1, 0], [1, 0]]  # one probe every 5 choices, one sequence
    assert picks[4] == [1, 0] and picks[9] == [1, 0]
    for _ in range(20):
        pol.observe(1, 1, 1)  # the probes are accepted
    assert sum(pol.choose([4, 4], [1, 1])) >= 2  # both sequences draft again
    assert pol.choose([0, 0], [1, 1]) == [0, 0]  # nothing on offer: no probe
    # a chain with its own confidences is never probed: its drafter learns from every committed token
    assert all(pol.choose([4], [7], [[0.01] * 4]) == [0] for _ in range(12))


@pytest.mark.parametrize("vocab", [None, 40])
def test_draft_model_batches_equal_plain(gemma, gemma_draft, vocab, monkeypatch):
    """A draft model per slot (not cheap: the policy plans K before drafting) stays token-identical,
    with its whole head and with a cut one; the slots draft together, every draft model step one
    batched pass over those still drafting (``DraftModelDrafter.propose_batch``)."""
    from forerun.drafters.draft_model import DraftModelDrafter

    prompts = _prompts(6, seed=2)
    plain = [Engine(gemma.backend, None, gemma.eos_token_ids).generate(p, max_new_tokens=15).token_ids for p in prompts]
    be = gemma_draft.backend.fork()
    rows = []
    real = type(be).forward_batch
    monkeypatch.setattr(type(be), "forward_batch", lambda self, seqs, *a, **kw: (
        rows.append(len(seqs)) if kw.get("last_only") else None) or real(self, seqs, *a, **kw))
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, max_batch=4,
                      drafter=DraftModelDrafter(be, None if vocab is None else torch.arange(vocab)))
    always_draft(eng.policy, monkeypatch)  # every slot, so the draft path is exercised, batched
    reqs = [BatchRequest(prompt=p, max_new_tokens=15) for p in prompts]
    assert run_batch(eng, reqs) == plain
    assert sum(r.stats.drafted for r in reqs) > 0
    assert rows and max(rows) > 1  # drafted together


def test_layerskip_batches_equal_plain(gemma):
    from forerun.drafters import make_drafter

    prompts = _prompts(3, seed=4)
    plain = [Engine(gemma.backend, None, gemma.eos_token_ids).generate(p, max_new_tokens=15).token_ids for p in prompts]
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=make_drafter("layerskip", gemma, skip_layers=[1]),
                      max_batch=3)
    eng.policy.margin = -1.0
    reqs = [BatchRequest(prompt=p, max_new_tokens=15) for p in prompts]
    assert run_batch(eng, reqs) == plain
    assert sum(r.stats.drafted for r in reqs) > 0


class _FailingNgram(NgramDrafter):
    """An n-gram drafter that fails on sequences starting with token 3."""

    def fork(self):
        return _FailingNgram()

    def propose(self, tokens, k):
        if tokens[0] == 3:
            raise RuntimeError("drafter broke")
        return super().propose(tokens, k)


def test_failures_end_only_their_own_request(gemma, monkeypatch):
    """A drafter failing, a pass failing for one sequence, a slot that cannot be made, failing
    housekeeping: each ends (with "error") only the request it belongs to; the others finish with
    plain decoding's tokens."""
    import forerun.decode as decode

    prompts = _prompts(3)
    ref = [Engine(gemma.backend, None, gemma.eos_token_ids).generate(p, max_new_tokens=12).token_ids for p in prompts]

    def run(eng, reqs):
        events = {}
        for i, r in enumerate(reqs):
            r.on_event = (lambda i: lambda t, f: events.setdefault(i, []).append((t, f)))(i)
            eng.submit(r)
        eng.run(until=lambda: not eng.active and not eng.waiting)
        toks = {i: [t for ts, _ in ev for t in ts] for i, ev in events.items()}
        finish = {i: ev[-1][1] for i, ev in events.items()}
        return toks, finish

    # 1. the drafter of one sequence fails
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=_FailingNgram(), max_batch=4)
    toks, finish = run(eng, [BatchRequest(prompt=[3] + prompts[0], max_new_tokens=12)]
                       + [BatchRequest(prompt=p, max_new_tokens=12) for p in prompts[1:]])
    assert finish == {0: "error", 1: "length", 2: "length"} and [toks[1], toks[2]] == ref[1:]

    # 2. the batched pass fails because of one sequence, which fails again on its own
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=4)
    bad = BatchRequest(prompt=prompts[0], max_new_tokens=12)
    real_batch, real_alone = gemma.backend.forward_batch, decode.verify

    def forward_batch(seqs, *a, **kw):
        if bad.slot is not None and any(s is bad.slot.backend for s in seqs) and bad.produced >= 3:
            raise RuntimeError("pass broke")
        return real_batch(seqs, *a, **kw)

    def alone(target, checks, *a, **kw):
        if len(checks) == 1 and bad.slot is not None and checks[0].backend is bad.slot.backend:
            raise RuntimeError("pass broke again")
        return real_alone(target, checks, *a, **kw)

    monkeypatch.setattr(gemma.backend, "forward_batch", forward_batch)
    monkeypatch.setattr(decode, "verify", alone)
    toks, finish = run(eng, [bad] + [BatchRequest(prompt=p, max_new_tokens=12) for p in prompts[1:]])
    assert finish == {0: "error", 1: "length", 2: "length"} and [toks[1], toks[2]] == ref[1:]
    assert bad.error == "RuntimeError: pass broke again"
    monkeypatch.undo()

    # 3. no slot can be made for one request taken off the queue; 4. housekeeping fails
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=4)
    real_slot, calls = eng._slot, []

    def slot():
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("no room for a cache")
        return real_slot()

    eng._slot = slot
    eng.HOUSEKEEPING_STEPS = 1
    eng.housekeeping = lambda: 1 / 0
    toks, finish = run(eng, [BatchRequest(prompt=p, max_new_tokens=12) for p in prompts])
    assert finish == {0: "error", 1: "length", 2: "length"} and [toks[1], toks[2]] == ref[1:]
    assert eng.dead is None


def test_prepared_slots_serve_every_request(gemma):
    """A server makes its slots at start; requests then take them and make none of their own."""
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, max_batch=3)
    eng.prepare_slots()
    assert eng._n_slots == 3 and len(eng._free) == 3
    eng.prepare_slots()  # idempotent
    assert eng._n_slots == 3
    prompts = _prompts(5)
    outs = run_batch(eng, [BatchRequest(prompt=p, max_new_tokens=6) for p in prompts])
    plain = [Engine(gemma.backend.fork(), None, gemma.eos_token_ids).generate(p, max_new_tokens=6).token_ids
             for p in prompts]
    assert outs == plain and eng._n_slots == 3 and len(eng._free) == 3


class _OracleTree:
    """A tree drafter that knows each prompt's greedy continuation: under the root a wrong token
    and the right one, under the right one a wrong and a right one, and so on, with the right path
    ending in a wrong token every third step; so acceptance runs through second children, and the
    cache must keep rows that are not the first ones of the pass."""

    def __new__(cls, refs):
        from forerun.drafters.base import Draft, Drafter

        class Oracle(Drafter):
            name = "oracle-tree"
            proposes_trees = True

            def __init__(self):
                self.calls = 0

            def propose(self, tokens, k):
                self.calls += 1
                prompt, ref = next((p, r) for p, r in refs if tokens[: len(p)] == p)
                truth = ref[len(tokens) - len(prompt):][:k]
                toks, parents, at = [], [], -1
                for j, t in enumerate(truth):
                    right = t if (self.calls + j) % 3 else (t + 1) % 90 + 3
                    toks += [(t + 7) % 90 + 3, right]
                    parents += [at, at]
                    at = len(toks) - 1
                return Draft(tokens=torch.tensor(toks, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))

            def fork(self):
                return Oracle()

        return Oracle()


@pytest.mark.parametrize("integer", [False, True])
def test_tree_drafters_verify_trees_in_the_batch_engine(gemma, integer):
    """Token trees in the batch engine (the server's): several sequences, each with its own tree,
    in one batched pass; greedy output equals plain decoding, on the float path and the integer
    path. A tree drafter on a backend without trees is refused up front."""
    from conftest import wrap
    from test_architectures import _build
    from test_integer_path import integer_model

    from forerun.drafters import make_drafter

    # a tiny model whose greedy text varies (a cache left holding a rejected branch changes it)
    lm = integer_model("qwen3")[1] if integer else wrap(_build("qwen3"), name="tiny-qwen3")
    prompts = _prompts(4)
    plain = [Engine(lm.backend.fork(), None, lm.eos_token_ids).generate(p, max_new_tokens=14).token_ids
             for p in prompts]
    refs = [(p, r) for p, r in zip(prompts, plain)]
    for drafter in (_OracleTree(refs), make_drafter("suffix", lm, tree=(8, None))):
        eng = BatchEngine(lm.backend, lm.eos_token_ids, drafter=drafter, max_batch=3)
        eng.policy.costs["pass"] = {r: 1.0 for r in range(1, 80)}  # drafts look free: every step drafts
        eng.policy.margin = -1.0
        reqs = [BatchRequest(prompt=p, max_new_tokens=14) for p in prompts]
        assert run_batch(eng, reqs) == plain, drafter.name
        if drafter.name == "oracle-tree":
            assert sum(r.stats.accepted for r in reqs) > 10  # trees were accepted, through second children

    class NoTrees:
        capabilities = type("C", (), {"token_trees": False, "batched": False, "kv_segments": False})()
        max_context = 100

    with pytest.raises(ForerunError, match="token trees"):
        BatchEngine(NoTrees(), (), drafter=make_drafter("suffix", gemma, tree=(8, None)))


def test_calibration_is_bounded_in_time(gemma):
    """Start-up timing stops at its budget (coarse row counts first; the cost model interpolates)."""
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=8)
    costs = eng.calibrate(reps=1, budget_s=0.0)
    assert list(costs) == [1, 2]
    assert eng.policy.cost(3) > 0
    full = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=2, k_max=8).calibrate(reps=1)
    assert list(full) == list(range(1, 17))  # within the budget: every row count up to 2 x (8 + 1)


def test_calibration_is_kept_for_the_next_start(gemma, tmp_path, monkeypatch):
    """With ``keep_as`` (the server passes the model's key) the costs are timed once per model and
    machine; the next engine reads them back without a pass."""
    from forerun.models import model_key

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    key = model_key(gemma)
    first = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=2, k_max=8)
    costs = first.calibrate(reps=1, keep_as=key)
    assert list(costs) == list(range(1, 17))
    second = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=2, k_max=8)
    monkeypatch.setattr(second, "_pass", lambda *a, **k: pytest.fail("timed again"))
    assert second.calibrate(reps=1, keep_as=key) == costs
    other = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=1, k_max=8)
    assert list(other.calibrate(reps=1, keep_as=key)) == list(range(1, 10))  # another engine shape: timed
    # changed kernels (their sources' digest) are timed again
    import forerun.batching

    monkeypatch.setattr(forerun.batching, "sources_id", lambda: "other kernels")
    again = []
    third = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=2, k_max=8)
    monkeypatch.setattr(third, "_pass", lambda *a, **k: again.append(1))
    third.calibrate(reps=1, keep_as=key)
    assert again


def test_slots_reserve_a_bounded_cache(gemma, monkeypatch):
    """A slot allocates its cache up front, at most RESERVE_POSITIONS of it (a long-context model's
    whole context would be gigabytes per slot); a longer request still decodes as plain decoding."""
    from forerun.backends.native import NativeBackend

    asked = []
    real = NativeBackend.reserve
    monkeypatch.setattr(NativeBackend, "reserve", lambda self, n: (asked.append(n), real(self, n))[1])
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, max_batch=2)
    eng.RESERVE_POSITIONS = 40
    eng.prepare_slots()
    assert asked == [40, 40]
    prompt = _prompts(1)[0] * 4  # past the reserved positions
    out = run_batch(eng, [BatchRequest(prompt=prompt, max_new_tokens=20)])[0]
    plain = Engine(gemma.backend.fork(), None, gemma.eos_token_ids).generate(prompt, max_new_tokens=20).token_ids
    assert len(prompt) + 20 > 40 and out == plain


def test_a_seeded_request_samples_the_same_alone_and_in_a_shared_pass():
    """Seeded sampling without speculation: each request draws from its own seed, so its text is
    the same alone (the single-sequence engine) and in a batched pass shared with other requests,
    and the same run after run (with speculation too: ``test_seeded.py``)."""
    from spread import spread_target

    target = spread_target()  # spread-out distributions: the draws decide the text
    prompts = _prompts(3, seed=5)
    params = [SamplingParams(temperature=0.9, top_k=20, seed=100 + i) for i in range(3)]
    runs = []
    for _ in range(2):
        eng = BatchEngine(target.backend, (), drafter=None, max_batch=3)
        runs.append(run_batch(eng, [BatchRequest(prompt=p, max_new_tokens=16, params=s) for p, s in zip(prompts, params)]))
    alone = [Engine(target.backend, None, ()).generate(p, max_new_tokens=16, params=s).token_ids
             for p, s in zip(prompts, params)]
    assert runs[0] == runs[1] == alone
    assert len({t for out in alone for t in out}) > 10  # the texts are really drawn


def test_a_batched_draft_is_each_sequences_own(gemma_draft):
    """``propose_batch``: each sequence's draft equals what it drafts alone (greedy, with a cut
    head; sequences of different lengths, one asked for no tokens), its cache as long."""
    from forerun.drafters.draft_model import DraftModelDrafter

    proto = DraftModelDrafter(gemma_draft.backend.fork(), torch.arange(50))
    prompts, ks = _prompts(4, seed=7), [5, 3, 0, 4]
    alone, together = [proto.fork() for _ in prompts], [proto.fork() for _ in prompts]
    for d in alone + together:
        d.begin([], SamplingParams(), None)
    want = [d.propose(p, k) for d, p, k in zip(alone, prompts, ks)]
    got = DraftModelDrafter.propose_batch(together, prompts, ks)
    assert [g.tokens.tolist() for g in got] == [w.tokens.tolist() for w in want]
    assert [len(g) for g in got] == ks and [g.steps for g in got] == [w.steps for w in want]
    assert [d.backend.length for d in together] == [d.backend.length for d in alone]


def test_submit_refuses_what_generate_refuses_with_the_same_message(gemma):
    """``BatchEngine.submit`` and ``Engine.generate`` check a request in one place (``check_request``):
    no new tokens, a non-integer count, token ids outside the vocabulary, an empty prompt and a
    prompt that fills the context are refused alike, and nothing is queued."""
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, max_batch=2)
    one = Engine(gemma.backend, None, gemma.eos_token_ids)
    vocab, limit = gemma.backend.vocab_size, gemma.backend.max_context
    for prompt, n, match in (([2, 5], 0, "max_new_tokens must be an integer >= 1, got 0"),
                             ([2, 5], 2.0, "max_new_tokens must be an integer >= 1"),
                             ([2, 5], True, "max_new_tokens must be an integer >= 1"),
                             ([2, vocab], 4, f"prompt token ids must be integers in 0..{vocab - 1}"),
                             ([2, -1], 4, "prompt token ids must be integers"),
                             ([2, 5.0], 4, "prompt token ids must be integers"),
                             ([], 4, "empty prompt"),
                             ([2] * limit, 4, "context limit")):
        with pytest.raises(ForerunError, match=match):
            eng.submit(BatchRequest(prompt=prompt, max_new_tokens=n))
        with pytest.raises(ForerunError, match=match):
            one.generate(prompt, max_new_tokens=n)
    assert not eng.waiting and not eng.active
