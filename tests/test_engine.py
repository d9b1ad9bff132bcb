import pytest
import torch
from conftest import tiny_gemma, wrap

from forerun.drafters import make_drafter
from forerun.drafters.ngram import lookup
from forerun.engine import Engine
from forerun.errors import ForerunError
from forerun.sampling import SamplingParams

PROMPTS = [
    [2, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11],  # repetitive: n-gram drafts get accepted
    [2, 50, 7, 33, 81, 4, 19],
    [2, 5],
]


def test_ngram_lookup():
    assert lookup([1, 2, 3, 4, 1, 2], 2, 3, 1) == [3, 4]
    assert lookup([1, 2, 3, 9, 2, 3, 7, 2, 3], 3, 2, 1) == [7, 2, 3]  # most recent match wins
    assert lookup([5, 6, 7], 3, 3, 1) == []
    assert lookup([1, 2, 1], 0, 3, 1) == []


def _greedy(lm, drafter, prompt, k, n=24):
    return Engine(lm.backend, drafter, lm.eos_token_ids).generate(prompt, max_new_tokens=n, k=k)


@pytest.mark.parametrize("model_name", ["gemma", "llama"])
@pytest.mark.parametrize("method", ["ngram", "draft", "layerskip"])
@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_equality(request, model_name, method, k):
    lm = request.getfixturevalue(model_name)
    draft = None
    if method == "draft":
        draft = request.getfixturevalue("gemma_draft") if model_name == "gemma" else wrap(
            __import__("conftest").tiny_llama(3, layers=1), name="tiny-llama-draft")
    drafter = make_drafter(method, lm, draft_model=draft, skip_layers=[1] if method == "layerskip" else None)
    accepted = 0
    for prompt in PROMPTS:
        ref = _greedy(lm, None, prompt, 1)
        got = _greedy(lm, drafter, prompt, k)
        assert got.token_ids == ref.token_ids
        st = got.stats
        assert st.new_tokens == len(got.token_ids) <= 24
        # every pass commits its accepted drafts plus one token of the target's own
        assert st.new_tokens == st.accepted + st.target_passes, (st.new_tokens, st.accepted, st.target_passes)
        accepted += st.accepted
    if k != "auto":  # (auto drafts only where its measured costs say it pays: timing-dependent)
        assert accepted > 0  # the equality above was earned with accepted drafts, not by rejecting all


def test_speculation_actually_drafts(gemma):
    """Greedy equality would pass trivially if nothing were ever accepted: make sure things are."""
    # Self-drafting with the target as its own draft model accepts everything.
    twin = wrap(tiny_gemma(0), name="same")
    res = _greedy(gemma, make_drafter("draft", gemma, draft_model=twin), PROMPTS[1], 4, n=30)
    assert res.stats.acceptance_rate == 1.0
    assert res.stats.mean_accepted_len > 4.0
    assert res.stats.target_passes < 10


@pytest.mark.parametrize("k", [1, 4, 7])
def test_max_new_tokens_never_overshoots(gemma, k):
    twin = wrap(tiny_gemma(0), name="same")
    drafter = make_drafter("draft", gemma, draft_model=twin)
    for n in (1, 2, 5, 9):
        res = _greedy(gemma, drafter, PROMPTS[0], k, n=n)
        assert len(res.token_ids) == n and res.finish_reason == "length"


def test_eos_inside_accepted_run(gemma):
    ref = _greedy(gemma, None, PROMPTS[1], 1, n=20).token_ids
    eos_tok = ref[6]
    eng_ref = Engine(gemma.backend, None, {eos_tok}).generate(PROMPTS[1], max_new_tokens=20)
    twin = wrap(tiny_gemma(0), name="same")
    eng = Engine(gemma.backend, make_drafter("draft", gemma, draft_model=twin), {eos_tok})
    res = eng.generate(PROMPTS[1], max_new_tokens=20, k=8)
    assert res.token_ids == eng_ref.token_ids == ref[: ref.index(eos_tok) + 1]
    assert res.finish_reason == "stop"


def test_context_limit(gemma):
    limit = gemma.backend.max_context
    prompt = [2] + [10] * (limit - 4)
    res = _greedy(gemma, make_drafter("ngram", gemma), prompt, 8, n=50)
    assert len(res.token_ids) == 3 and res.finish_reason == "context"
    with pytest.raises(ForerunError, match="context limit"):
        _greedy(gemma, None, [2] * limit, 1)


@pytest.mark.parametrize("bad", [dict(prompt=[]), dict(max_new_tokens=0), dict(k=0), dict(k=33), dict(k="x")])
def test_engine_bad_input(gemma, bad):
    kw = dict(prompt=[2, 5], max_new_tokens=4, k=2) | bad
    with pytest.raises(ForerunError):
        Engine(gemma.backend, make_drafter("ngram", gemma)).generate(kw.pop("prompt"), **kw)


def test_sampling_seeded(gemma, gemma_draft):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11)
    eng = Engine(gemma.backend, make_drafter("draft", gemma, draft_model=gemma_draft))
    a = eng.generate(PROMPTS[1], max_new_tokens=16, params=params, k=3).token_ids
    b = eng.generate(PROMPTS[1], max_new_tokens=16, params=params, k=3).token_ids
    assert a == b


def test_layer_skip_calibration_is_bounded_and_kept(gemma, tmp_path, monkeypatch):
    """The greedy layer search stops on its budget or when the predicted speedup stops improving,
    and the default calibration is measured once per model and machine, then read back."""
    import forerun.drafters.layer_skip as ls

    be, tok = gemma.backend, gemma.tokenizer
    # passes priced by the layers they run, not by the clock: on 4 tiny layers timing noise can
    # make skipping two layers look dearer than skipping one, and the search then stops on noise
    monkeypatch.setattr(ls, "median_forward_s",
                        lambda backend, x, n, skip_layers=(), **kw: n * (1 + backend.num_layers - len(skip_layers)) * 1e-3)
    timed_out = ls.calibrate(be, tok, new_tokens=8, log=lambda s: None, budget_s=0.0)
    assert timed_out["trace"] == [] and timed_out["stopped"].startswith("time budget")
    patient = ls.calibrate(be, tok, new_tokens=8, log=lambda s: None, patience=1)
    assert patient["stopped"] in ("no better set in 1 rounds", "agreement below 0.2", "every layer tried")
    if patient["stopped"].startswith("no better"):
        assert len(patient["trace"]) < be.num_layers - 2
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    calls = []
    real = ls.calibrate
    monkeypatch.setattr(ls, "calibrate", lambda *a, **k: calls.append(1) or real(*a, **{**k, "new_tokens": 8}))
    first = ls.default_calibration(gemma)
    assert ls.default_calibration(gemma) == first and len(calls) == 1


def test_a_draft_vocabulary_takes_the_sample_up_to_its_share_then_the_lowest_ids(tmp_path, monkeypatch):
    """Of 40 tokens: the 4 special ones, the sample's commonest up to five eighths (25 in all), then
    the lowest ids left; a rule's choice is kept under its own name."""
    from conftest import word_tokenizer

    from forerun.drafters import draft_vocab

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    text = " ".join(f"w{60 + i}" for i in range(30) for _ in range(100 - i))  # w60 the commonest, then w61, ...
    monkeypatch.setattr(draft_vocab, "_sample", lambda: [text])
    v = draft_vocab.draft_vocabulary(word_tokenizer(96), 40)
    assert set(v.tolist()) == {0, 1, 2, 3} | set(range(60, 81)) | set(range(4, 19))
    assert [f.name.endswith(f"-40-r{draft_vocab.RULE}.json") for f in (tmp_path / "draft-vocab").iterdir()] == [True]


def test_a_draft_vocabulary_is_lossless_greedy_and_chosen_once(tmp_path, monkeypatch):
    """``draft_tokens``: the draft model proposes only the commonest tokens (specials, then the
    standard library sample's most frequent, then the lowest ids), its head cut to them; greedy
    output equals plain decoding; the choice is kept per tokenizer and size."""
    from conftest import tiny_gemma, wrap

    from forerun.drafters import make_drafter
    from forerun.drafters.draft_vocab import auto_draft_tokens, draft_vocabulary
    from forerun.errors import ForerunError

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    target, draft = wrap(tiny_gemma(0)), wrap(tiny_gemma(1, layers=2), name="d")
    v = draft_vocabulary(draft.tokenizer, 40)
    assert len(v) == 40 and torch.equal(v, v.sort().values) and {0, 1, 2, 3} <= set(v.tolist())
    assert torch.equal(draft_vocabulary(draft.tokenizer, 40), v) and list((tmp_path / "draft-vocab").iterdir())
    assert auto_draft_tokens(96, None) == 0 and auto_draft_tokens(151936, None) == 32768 and auto_draft_tokens(96, 200) == 0
    drafter = make_drafter("draft", target, draft_model=draft, draft_tokens=40)
    eng = Engine(target.backend, drafter, target.eos_token_ids)
    for p in PROMPTS:
        assert eng.generate(p, max_new_tokens=20, k=4).token_ids == \
            Engine(target.backend, None, target.eos_token_ids).generate(p, max_new_tokens=20).token_ids
    with pytest.raises(ForerunError, match="draft_tokens"):
        make_drafter("ngram", target, draft_tokens=40)


def test_a_windowed_draft_model_reads_little_and_stays_lossless(gemma, gemma_draft):
    """``window``: the draft reads a long prompt (or a long stretch it did not draft for) from its
    last ``window`` tokens, in one pass before drafting (``catch_up``), and drafts on from there;
    ``p_min`` stops drafting before a token the draft is unsure of. Greedy output equals plain
    decoding, and the draft cache never holds more than the window and what came after it."""
    from forerun.drafters.draft_model import DraftModelDrafter

    long_prompt = [2] + [5 + (i * 7) % 40 for i in range(40)]
    plain = Engine(gemma.backend, None, gemma.eos_token_ids)
    for window, p_min in ((6, 0.0), (6, 0.3), (None, 0.3)):
        drafter = DraftModelDrafter(gemma_draft.backend.fork(), window=window, p_min=p_min)
        eng = Engine(gemma.backend, drafter, gemma.eos_token_ids)
        for p in PROMPTS + [long_prompt]:
            out = eng.generate(p, max_new_tokens=24, k=4)
            assert out.token_ids == plain.generate(p, max_new_tokens=24).token_ids, (window, p_min)
            assert out.stats.drafted > 0
            if window is not None:  # what it read: the window, then the drafted and committed tokens
                assert drafter.backend.length <= window + 24 + 4
                assert drafter.offset == max(0, len(p) - window)
    d = DraftModelDrafter(gemma_draft.backend.fork(), window=6)
    d.begin(long_prompt, SamplingParams(), None)
    d.catch_up(long_prompt)
    assert (d.offset, d.backend.length) == (len(long_prompt) - 6, 5)  # all but the last token of the window
    assert len(d.propose(long_prompt, 3)) == 3 and d.backend.length == 8
    with pytest.raises(ForerunError, match="window"):
        DraftModelDrafter(gemma_draft.backend, window=0)
    with pytest.raises(ForerunError, match="probability"):
        DraftModelDrafter(gemma_draft.backend, p_min=1.0)


def test_a_draft_models_reading_skips_its_lm_head(gemma_draft, monkeypatch):
    """``catch_up`` computes no logits where the backend can skip its LM head (nothing reads them
    there), and the drafts after it are those of a model that read the prompt in its first draft step."""
    from forerun.drafters.draft_model import DraftModelDrafter

    p = [2] + [5 + (i * 7) % 40 for i in range(30)]
    d = DraftModelDrafter(gemma_draft.backend.fork())
    asked, fwd = [], d.backend.forward
    monkeypatch.setattr(d.backend, "forward", lambda *a, **k: asked.append(k.get("logits", True)) or fwd(*a, **k))
    d.begin(p, SamplingParams(), None)
    d.catch_up(p)
    assert asked == [not d.backend.capabilities.kv_segments] and d.backend.length == len(p) - 1
    ref = DraftModelDrafter(gemma_draft.backend.fork())
    ref.begin(p, SamplingParams(), None)
    assert d.propose(p, 4).tokens.tolist() == ref.propose(p, 4).tokens.tolist()


def test_a_draft_model_keeps_the_positions_the_next_prompt_shares(gemma, gemma_draft):
    """A draft model's next sequence keeps the cached positions of the tokens it begins with like
    the last one (a system prompt, earlier turns): it reads only the rest, its logits there are
    those of a fresh read of the whole prompt, and the output is plain decoding's. ``forget_history`` drops them."""
    from forerun.drafters.draft_model import DraftModelDrafter

    shared = [2] + [5 + (i * 7) % 40 for i in range(14)]
    a, b = shared + [9, 31, 17, 4], shared + [22, 8, 13]
    plain = Engine(gemma.backend, None, gemma.eos_token_ids)
    d = DraftModelDrafter(gemma_draft.backend.fork())
    eng = Engine(gemma.backend, d, gemma.eos_token_ids)
    assert eng.generate(a, max_new_tokens=12, k=4).token_ids == plain.generate(a, max_new_tokens=12).token_ids
    d.begin(b, SamplingParams(), None)
    assert d.backend.length == len(shared) and d.unread(b) == len(b) - 1 - len(shared)
    fresh = gemma_draft.backend.fork()  # what the model computes reading all of b
    want = fresh.forward(torch.tensor(b), 0, last_only=True).logits[-1]
    got = d.backend.forward(torch.tensor(b[len(shared):]), len(shared), last_only=True).logits[-1]
    assert torch.allclose(got, want, atol=1e-5)
    d.backend.truncate(len(shared))
    assert eng.generate(b, max_new_tokens=12, k=4).token_ids == plain.generate(b, max_new_tokens=12).token_ids
    d.begin(a[:3], SamplingParams(), None)  # shares 3 tokens: keeps the 2 before its last
    assert d.backend.length == 2
    d.propose(a[:3], 2)  # a sequence that ends with its drafts in the cache (it failed): none kept
    d.begin(a, SamplingParams(), None)
    assert d.backend.length == 0
    d.catch_up(a)
    d.accepted(a, 0)
    d.forget_history()
    d.begin(a, SamplingParams(), None)
    assert d.backend.length == 0


def test_p_min_stops_the_draft_where_it_is_unsure(gemma, gemma_draft):
    """A draft cut by ``p_min`` is the prefix of the uncut one up to its first token under p_min,
    and it counts the step that found that token (what the policy charges for drafting)."""
    from forerun.drafters.draft_model import DraftModelDrafter

    full = DraftModelDrafter(gemma_draft.backend.fork())
    full.begin(PROMPTS[0], SamplingParams(), None)
    probs = []
    be, pos, feed = gemma_draft.backend.fork(), 0, torch.tensor(PROMPTS[0])
    for _ in range(6):
        lg = be.forward(feed, pos, last_only=True).logits[-1]
        pos += feed.numel()
        probs.append(float(torch.softmax(lg.float(), -1).max()))
        feed = lg.argmax().view(1)
    want = full.propose(PROMPTS[0], 6).tokens.tolist()
    cut = sorted(probs)[2]  # a threshold some of the six fall under
    n = next((j for j, p in enumerate(probs) if p < cut), 6)
    d = DraftModelDrafter(gemma_draft.backend.fork(), p_min=cut)
    d.begin(PROMPTS[0], SamplingParams(), None)
    got = d.propose(PROMPTS[0], 6)
    assert got.tokens.tolist() == want[:n] and n < 6 and got.steps == min(n + 1, 6)


@pytest.mark.parametrize("source", ["ngram", "suffix"])
def test_a_draft_model_with_a_lookup_chain_is_lossless_and_uses_both(gemma, gemma_draft, source):
    """``draft_lookup``: every round the drafter offers a model-free chain beside its model; the
    policy verifies the chain alone where it promises more (the model then drafts nothing and
    reads those tokens later) and the model's draft elsewhere. Greedy output equals plain
    decoding, alone and in a batch, and both kinds of round happen on a repetitive prompt."""
    from conftest import run_batch

    from forerun.batching import BatchEngine, BatchRequest
    from forerun.drafters.draft_model import DraftModelDrafter

    rounds = []

    class Counted(DraftModelDrafter):
        def lookup_chain(self, tokens, k):
            chain = super().lookup_chain(tokens, k)
            rounds.append("chain" if len(chain) else "none")
            return chain

        def propose(self, tokens, k, more=None):
            rounds[-1] = "model"
            return super().propose(tokens, k, more)

    drafter = make_drafter("draft", gemma, draft_model=gemma_draft, draft_lookup=source)
    drafter = Counted(drafter.backend, lookup=drafter.lookup)
    prompts = PROMPTS + [[2] + [5, 9, 11, 13, 17] * 6]
    plain = Engine(gemma.backend, None, gemma.eos_token_ids)
    want = [plain.generate(p, max_new_tokens=24).token_ids for p in prompts]
    eng = Engine(gemma.backend, drafter, gemma.eos_token_ids)
    assert [eng.generate(p, max_new_tokens=24, k="auto").token_ids for p in prompts] == want
    assert "chain" in rounds and "model" in rounds
    batch = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=drafter, max_batch=4)
    assert run_batch(batch, [BatchRequest(prompt=p, max_new_tokens=24) for p in prompts]) == want
    with pytest.raises(ForerunError, match="draft_lookup"):
        make_drafter("draft", gemma, draft_model=gemma_draft, draft_lookup="tree")
    with pytest.raises(ForerunError, match="draft_lookup"):
        make_drafter("ngram", gemma, draft_lookup="suffix")
