"""A draft model's vocabulary grown by the tokens of its contexts (``ContextVocab``) on the integer
path: tiny random GGUF files read straight from the file (the LM head's rows from its blocks). The
draft model is the target's own file, its vocabulary cut to the first 40 of 320 tokens; prompts are
made of the others. Checked: the output is plain decoding's (greedy, seeded; alone and batched);
the draft proposes context tokens it could not before, and only those; a batched step reads one
head for every chain; the joined head computes the rows' own logits; the added tokens are dropped
past their cap."""

import pytest
import torch
from conftest import run_batch
from test_gguf_model import lean_backend
from tiny_gguf import VOCAB, write_tiny_gguf

from forerun.batching import BatchEngine, BatchRequest
from forerun.drafters.draft_model import ContextVocab, DraftModelDrafter
from forerun.engine import Engine
from forerun.sampling import SamplingParams

BASE = torch.arange(40)  # the draft vocabulary before any context


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("ctx") / "llama.gguf", "llama")
    return lean_backend(path)[0], lean_backend(path)[0]  # target, draft: the same weights, caches of their own


def _prompts(n=4):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(40, VOCAB, (10 + i,), generator=g).tolist() for i in range(n)]


def _watched(drafter, seen):
    propose = drafter.propose
    drafter.propose = lambda tokens, k, more=None: (d := propose(tokens, k, more), seen.append((list(tokens), d)))[0]
    return drafter


def test_context_tokens_join_the_draft_vocabulary_and_the_output_stays_plain(pair):
    target, draft = pair
    plain = Engine(target, None, ())
    accepted = {}
    for grow in (False, True):
        seen = []
        drafter = _watched(DraftModelDrafter(draft.fork(), BASE, context_vocab=grow), seen)
        assert (drafter.context is not None) == grow
        eng = Engine(target, drafter, ())
        accepted[grow] = 0
        for p in _prompts():
            for k in (4, "auto"):
                out = eng.generate(p, max_new_tokens=24, k=k)
                assert out.token_ids == plain.generate(p, max_new_tokens=24, k=0).token_ids, (grow, k)
                accepted[grow] += out.stats.accepted
        shown, proposed = set(BASE.tolist()), []  # the vocabulary, and what contexts showed it so far
        for ctx, d in seen:
            shown |= set(ctx)
            proposed.append((set(shown), set(d.tokens.tolist())))
        outside = [t for _, got in proposed for t in got if t >= len(BASE)]
        if grow:  # context tokens proposed, and none a context had not shown (this request's, or earlier ones')
            assert outside and all(got <= ctx for ctx, got in proposed)
        else:
            assert not outside
    assert accepted[True] > accepted[False], accepted


def test_seeded_and_batched_output_through_a_grown_vocabulary_is_plain_decodings(pair):
    target, draft = pair
    prompts = _prompts()
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=3)]
    plain = Engine(target, None, ())
    want = [plain.generate(p, max_new_tokens=20, params=params[i % 2]).token_ids for i, p in enumerate(prompts)]
    drafter = DraftModelDrafter(draft.fork(), BASE)
    eng = Engine(target, drafter, ())
    assert [eng.generate(p, max_new_tokens=20, params=params[i % 2], k=4).token_ids
            for i, p in enumerate(prompts)] == want
    batch = BatchEngine(target, (), drafter=DraftModelDrafter(draft.fork(), BASE), max_batch=4)
    reqs = [BatchRequest(prompt=p, max_new_tokens=20, params=params[i % 2]) for i, p in enumerate(prompts)]
    assert run_batch(batch, reqs) == want
    assert sum(r.stats.drafted for r in reqs) > 0


def test_a_batched_step_drafts_with_the_vocabulary_every_chain_grew(pair):
    """Each sequence's context adds its own tokens before the batch drafts: every chain reads its
    tokens through the one head the batch runs (built once), so each draft is the one it makes alone."""
    _, draft = pair
    proto = DraftModelDrafter(draft.fork(), BASE)
    a, b = _prompts(2)
    forks = [proto.fork(), proto.fork()]
    for f, p in zip(forks, (a, b)):
        f.begin(p, SamplingParams(), None)
        f.catch_up(p)
    built, be = [], proto.context.backend
    be.joined_head = lambda first, rows: built.append(len(rows)) or type(be).joined_head(be, first, rows)
    together = DraftModelDrafter.propose_batch(forks, [a, b], [3, 3])
    del be.joined_head
    assert set(a + b) - set(BASE.tolist()) <= set(proto.context.added) and len(built) == 1  # both contexts, one head
    for f, p, d in zip((proto.fork(), proto.fork()), (a, b), together):
        f.begin(p, SamplingParams(), None)
        f.catch_up(p)
        assert torch.equal(f.propose(p, 3).tokens, d.tokens)
    assert any(t >= len(BASE) for d in together for t in d.tokens.tolist())


def test_the_joined_head_computes_its_rows_own_logits_and_starts_afresh_past_its_cap(pair):
    _, draft = pair
    be = draft.fork()
    base = be.integer_sub_head(BASE)
    ctx = ContextVocab(be, BASE, base, max_added=8)
    ctx.add([3, 50, 77, 50, VOCAB + 5])  # a known token, two new ones (once each), one past the draft's head
    head, vocab_map = ctx.current()
    assert vocab_map.tolist() == BASE.tolist() + [50, 77] and ctx.added == [50, 77]
    h = torch.randn(3, be.model.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = be.integer_sub_head(vocab_map)(h)
    assert torch.equal(head(h), whole) and torch.equal(base(h), whole[:, : len(BASE)])
    for i in range(10):  # ten more batches of new rows: one part each, joined again past eight parts
        ctx.add([100 + i])
        grown, m = ctx.current()
        assert m.tolist()[: len(BASE) + 2] == vocab_map.tolist() and len(grown.qlin.parts) <= 8  # rows keep their places
        assert torch.equal(grown(h), be.integer_sub_head(m)(h))
    assert m.tolist() == BASE.tolist() + [50, 77, *range(100, 110)]
    ctx.start_request()  # 12 added, over the cap of 8: the next request starts from the vocabulary
    assert ctx.current()[0] is base and ctx.added == [] and ctx.map is BASE
    ctx.add([50])
    assert ctx.current()[1].tolist() == BASE.tolist() + [50]


def test_a_sampled_draft_is_judged_against_the_grown_distribution_it_drew_from(pair):
    """Its q is the softmax of the joined head's logits over the grown vocabulary, zero elsewhere."""
    _, draft = pair
    d = DraftModelDrafter(draft.fork(), BASE)
    p = _prompts(1)[0]
    params = SamplingParams(temperature=1.0)
    d.begin(p, params, torch.Generator().manual_seed(0))
    d.catch_up(p)
    out = d.propose(p, 1)
    head, vocab_map = d.context.current()
    assert len(vocab_map) > len(BASE)
    ref = draft.fork()
    logits = ref.forward(torch.tensor(p), 0, head=head, last_only=True).logits[-1]
    q = torch.zeros(VOCAB).scatter_(0, vocab_map, torch.softmax(logits, -1))
    assert torch.allclose(out.q[0], q, atol=1e-6) and float(out.q[0].sum()) == pytest.approx(1.0)
    assert float(out.q[0][out.tokens[0]]) > 0
