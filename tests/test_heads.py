"""Trained draft heads (EAGLE-style, Medusa): training, files, errors, and losslessness."""

import json
import random

import pytest
import torch
from conftest import tiny_gemma, wrap
from test_engine import PROMPTS

from forerun.drafters import make_drafter
from forerun.drafters.head_training import TrainConfig, Trainer, extract_features
from forerun.drafters.heads import load_head, target_fingerprint
from forerun.engine import Engine
from forerun.errors import ForerunError
from forerun.sampling import SamplingParams
from forerun.stats import GenerationStats
from forerun.training.data import Sequence


def _sequences(n=48, length=32, seed=0):
    """A corpus with a rule to learn: each token is followed by its image under a fixed permutation
    (the tiny random target's own outputs just repeat one token, which teaches nothing)."""
    rng = random.Random(seed)
    perm = list(range(4, 96))
    rng.shuffle(perm)
    nxt = dict(zip(range(4, 96), perm))
    out = []
    for _ in range(n):
        ids = [2, rng.randrange(4, 96)]
        while len(ids) < length:
            ids.append(nxt[ids[-1]])
        out.append(Sequence(ids, 1))
    return out


def _target_samples(lm, prompt, params, n=64, new=6):
    """The target's own sampled continuations: a head trained on them proposes what the target
    might sample, so the distribution test sees acceptances as well as rejections."""
    eng = Engine(lm.backend)
    return [Sequence(prompt + eng.generate(prompt, max_new_tokens=new, params=SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=i)).token_ids, len(prompt))
        for i in range(n)]


def _train(lm, kind, tmp_path, epochs=None, stop_after=None, seqs=None, **config):
    be = lm.backend
    # Both heads start as "the target's own next-token head" with zeroed residual branches: a small
    # problem needs a high learning rate to move them in a few steps.
    tc = TrainConfig(kind=kind, draft_vocab=80, epochs=epochs or 10, batch_tokens=256, n_heads=2,
                     head_dim=16, intermediate=64, lr=1e-2, val_fraction=0.2, steps_ahead=3, **config)
    tr = Trainer.of_target(tc, be.model)
    ex = extract_features(be, seqs or _sequences(), tr.extract_layers, None, log=lambda s: None)
    head, report = tr.train(ex, tmp_path, log=lambda s: None, stop_after=stop_after)
    return head, report


@pytest.fixture(scope="module")
def heads(gemma, tmp_path_factory):
    out = {}
    for kind in ("eagle", "medusa"):
        head, report = _train(gemma, kind, tmp_path_factory.mktemp(kind))
        path = tmp_path_factory.mktemp(kind + "-head")
        head.save(path)
        out[kind] = (path, report)
    return out


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_training_improves_validation_agreement(heads, kind):
    hist = heads[kind][1]["history"]
    before, after = hist[0]["val_agreement"], hist[-1]["val_agreement"]
    assert hist[0]["step"] == 0 and len(after) == 3
    assert sum(after) > sum(before) + 0.05, (before, after)


def test_training_resumes_from_checkpoint(gemma, tmp_path):
    """An interrupted run picks up its checkpoint and ends where an uninterrupted one does."""
    full, done = _train(gemma, "medusa", tmp_path / "a", epochs=2)
    _, paused = _train(gemma, "medusa", tmp_path / "b", epochs=2, stop_after=7)
    assert paused["stopped"] and paused["steps"] == 7 < done["steps"]
    resumed, report = _train(gemma, "medusa", tmp_path / "b", epochs=2)
    assert report["steps"] == done["steps"]
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), k


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_saved_head_reloads_bit_identically(heads, kind, gemma, tmp_path):
    fp = target_fingerprint(gemma.backend.embed, gemma.backend.num_layers)
    a = load_head(heads[kind][0], fingerprint=fp)
    a.save(tmp_path)
    b = load_head(tmp_path, fingerprint=fp)
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert x.dtype == y.dtype and torch.equal(x, y), k
    assert a.content_hash() == b.content_hash()


def test_feature_cache_computes_only_new_sequences(gemma, tmp_path):
    """More data later (another seed) reuses the features already cached; the cache holds exactly
    the latest run's sequences and gives back what a fresh forward would."""
    be = gemma.backend
    layers = [0, 1]
    seqs = _sequences(n=6)
    cache = tmp_path / "features.pt"
    calls = []
    real_forward = be.forward

    def counting(ids, pos, **kw):
        calls.append(len(ids))
        return real_forward(ids, pos, **kw)

    be.forward = counting
    try:
        first = extract_features(be, seqs[:4], layers, cache, log=lambda s: None)
        assert len(calls) == 4
        more = extract_features(be, seqs[2:], layers, cache, log=lambda s: None)
        assert len(calls) == 6  # seqs 4 and 5 only
        again = extract_features(be, seqs[2:], layers, cache, log=lambda s: None)
        assert len(calls) == 6
    finally:
        del be.forward
    fresh = extract_features(be, seqs[2:], layers, None, log=lambda s: None)
    for a, b, c in zip(more, again, fresh):
        assert torch.equal(a.feats, b.feats) and torch.equal(a.feats, c.feats) and a.start == c.start
    assert torch.equal(more[0].feats, first[2].feats)
    assert torch.load(cache, weights_only=True)["keys"].__len__() == 4
    other = extract_features(be, seqs[2:3], [0], cache, log=lambda s: None)  # other layers: computed anew
    assert other[0].feats.shape[1] == fresh[0].feats.shape[1] // 2


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_warm_start_continues_from_a_trained_head(heads, gemma, kind, tmp_path):
    """--init: the new head starts with the trained head's weights (validation agreement before
    any step matches the trained head's, saved as float16), output rows follow their tokens into a different draft
    vocabulary, and a head of another shape is refused."""
    be = gemma.backend
    fp = target_fingerprint(be.embed, be.num_layers)
    trained = load_head(heads[kind][0], fingerprint=fp)
    tc = TrainConfig(kind=kind, draft_vocab=80, epochs=1, batch_tokens=256, n_heads=2, head_dim=16, intermediate=64,
                     lr=1e-2, val_fraction=0.2, steps_ahead=3)
    tr = Trainer.of_target(tc, be.model)
    ex = extract_features(be, _sequences(), tr.feature_layers, None, log=lambda s: None)
    _, fresh = tr.train(ex, tmp_path / "a", log=lambda s: None, stop_after=1)
    _, warm = tr.train(ex, tmp_path / "b", log=lambda s: None, stop_after=1, init=trained)
    start, trained_end = warm["history"][0]["val_agreement"], heads[kind][1]["history"][-1]["val_agreement"]
    assert all(abs(a - b) <= 0.05 for a, b in zip(start, trained_end)), (start, trained_end)  # saved as float16
    assert sum(warm["history"][0]["val_agreement"]) > sum(fresh["history"][0]["val_agreement"]) + 0.05
    # A different draft vocabulary: shared tokens keep their trained rows, the others start at the target's.
    d2t = torch.arange(20, 96)
    head = tr.new_head(d2t)
    copied = tr.warm_start(head, trained)
    old = {int(t): i for i, t in enumerate(trained.draft_to_target.tolist())}
    assert copied == sum(int(t) in old for t in d2t.tolist()) > 0
    for j, t in enumerate(d2t.tolist()):
        want = trained.lm_head.weight[old[t]] if t in old else be.model.lm_head.weight[t].float()
        assert torch.equal(head.lm_head.weight[j].detach(), want.detach()), t
    # keep_vocab: the trained head's own vocabulary, every output row carried over, whatever these examples hold.
    few, said = ex[:4], []
    kept, _ = tr.train(few, tmp_path / "c", log=said.append, stop_after=1, init=trained, keep_vocab=True)
    assert torch.equal(kept.draft_to_target.cpu(), trained.draft_to_target.cpu())
    n = len(trained.draft_to_target)
    assert f"{n} of {n} output rows copied" in " ".join(said)
    chosen, _ = tr.train(few, tmp_path / "d", log=lambda s: None, stop_after=1, init=trained)
    assert not torch.equal(chosen.draft_to_target.cpu(), trained.draft_to_target.cpu())
    with pytest.raises(ForerunError, match="needs a head to start from \\(init\\)"):
        tr.train(few, tmp_path / "e", log=lambda s: None, stop_after=1, keep_vocab=True)
    wide = Trainer.of_target(TrainConfig(kind=kind, draft_vocab=80, n_heads=2, head_dim=16, intermediate=128, steps_ahead=3), be.model)
    with pytest.raises(ForerunError, match="intermediate"):
        wide.warm_start(wide.new_head(d2t), trained)


def test_soft_labels_are_the_targets_own_distribution(gemma, tmp_path):
    """The soft labels are the target's next-token distribution, renormalised over the draft
    vocabulary, computed from the cached top-layer features; a head trained on them alone learns."""
    be = gemma.backend
    tc = TrainConfig(kind="eagle", draft_vocab=80, epochs=6, batch_tokens=256, n_heads=2, head_dim=16,
                     intermediate=64, lr=1e-2, val_fraction=0.2, steps_ahead=3, soft_labels=1.0)
    tr = Trainer.of_target(tc, be.model)
    seq = _sequences(n=1)[0]
    ex = extract_features(be, [seq], tr.feature_layers, None, log=lambda s: None)[0]
    d2t = torch.arange(3, 83)
    soft = tr.target_logprobs(ex.feats[None].float(), d2t)[0]
    be.reset()
    full = be.forward(torch.tensor(seq.ids), 0).logits.float()
    want = full[:, d2t].log_softmax(-1)
    assert torch.allclose(soft.exp(), want.exp(), atol=0.02), (soft.exp() - want.exp()).abs().max()  # bfloat16 features
    assert (soft.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    # Trained on soft labels alone, on the target's own sampled continuations: the soft loss falls.
    data = extract_features(be, _target_samples(gemma, [2, 7, 9], SamplingParams(temperature=1.0), n=32, new=12),
                            tr.feature_layers, None, log=lambda s: None)
    head, _ = tr.train(data, tmp_path, log=lambda s: None)
    t2d = torch.full((be.embed.shape[0],), -1, dtype=torch.long)
    t2d[head.draft_to_target] = torch.arange(len(head.draft_to_target))
    batch = tr.batch(data, list(range(len(data))))
    with torch.no_grad():
        after = tr.loss(head, *batch, t2d)[0].item()
        before = tr.loss(tr.new_head(head.draft_to_target), *batch, t2d)[0].item()
    assert after < before - 0.1, (before, after)


def _copy(src, dst):
    dst.mkdir(exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        (dst / f).write_bytes((src / f).read_bytes())
    return dst


def test_head_errors(heads, gemma, tmp_path):
    path = heads["eagle"][0]
    other = wrap(tiny_gemma(5))  # same shapes, different weights
    with pytest.raises(ForerunError, match="another target"):
        make_drafter("eagle", other, head_path=path)
    bigger = wrap(tiny_gemma(0, layers=3))
    with pytest.raises(ForerunError, match="another target"):
        make_drafter("eagle", bigger, head_path=path)
    with pytest.raises(ForerunError, match="medusa head, not eagle"):
        make_drafter("eagle", gemma, head_path=heads["medusa"][0])
    with pytest.raises(ForerunError, match="not a draft head"):
        make_drafter("eagle", gemma, head_path=tmp_path)
    bad = _copy(path, tmp_path / "corrupt")
    (bad / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:200])
    with pytest.raises(ForerunError, match="corrupt"):
        make_drafter("eagle", gemma, head_path=bad)
    bad = _copy(path, tmp_path / "badmap")
    from safetensors.torch import load_file, save_file

    t = load_file(str(bad / "model.safetensors"))
    t["draft_to_target"][3] = 10_000
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ForerunError, match="outside the target vocabulary"):
        make_drafter("eagle", gemma, head_path=bad)
    bad = _copy(path, tmp_path / "badcfg")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["draft_vocab"] = 7
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ForerunError, match="draft_to_target"):
        make_drafter("eagle", gemma, head_path=bad)
    # The head is checked against the target's fingerprint, not against what it says of itself:
    # its own shapes, its map's range, and a checksum that cannot be left empty.
    for edit, needle in ((lambda c: c.update(vocab_size=c["vocab_size"] * 2), "its vocab_size"),
                         (lambda c: c.update(hidden_size=c["hidden_size"] + 8), "its hidden_size"),
                         (lambda c: c["target"].update(embed_checksum=[]), "no checksum"),
                         (lambda c: c["target"].pop("embed_checksum"), "no checksum")):
        bad = _copy(path, tmp_path / f"self-{needle.replace(' ', '_')}-{len(list(tmp_path.iterdir()))}")
        cfg = json.loads((bad / "config.json").read_text())
        edit(cfg)
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ForerunError, match=needle):
            make_drafter("eagle", gemma, head_path=bad)
    with pytest.raises(ForerunError, match="no eagle head is shipped"):
        make_drafter("eagle", gemma)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("k,tree,lookup", [(1, None, False), (3, None, False), ("auto", None, False),
                                           (3, (6, None), False), (4, (12, 4), False), (5, (6, 3), True),
                                           (5, (6, 3), "auto"), (5, (6, 3), "suffix"), (5, (6, 3), "suffix-auto")])
def test_greedy_equality(heads, gemma, kind, k, tree, lookup):
    source = "suffix" if isinstance(lookup, str) and lookup.startswith("suffix") else "ngram"
    lookup = {"suffix": "always", "suffix-auto": "auto"}.get(lookup, lookup)
    drafter = make_drafter(kind, gemma, head_path=heads[kind][0], tree=tree, tree_lookup=lookup, lookup_from=source)
    ref = Engine(gemma.backend, None, gemma.eos_token_ids)
    eng = Engine(gemma.backend, drafter, gemma.eos_token_ids)
    propose, pass_rows = drafter.propose, []
    drafter.propose = lambda tokens, want: (d := propose(tokens, want), pass_rows.append(len(d) + 1))[0]
    drafted = head_rows = verified = passes = 0
    for p in PROMPTS:
        want = ref.generate(p, max_new_tokens=24).token_ids
        res = eng.generate(p, max_new_tokens=24, k=k)
        assert res.token_ids == want
        drafted += res.stats.drafted
        head_rows += res.stats.head_rows
        verified += res.stats.verified_rows
        passes += res.stats.target_passes
        assert res.stats.head_calls >= res.stats.target_passes
    assert drafted > 0
    # a chain pass verifies its draft and one more row; a tree pass at least its depth and one more
    assert verified == drafted + passes if tree is None else verified >= drafted + passes
    if tree is not None and tree[0] >= 12 and gemma.backend.capabilities.lazy_tree_head:
        # greedy trees on the CPU run the LM head only on the rows the acceptance walk reaches
        assert head_rows < sum(pass_rows)


@pytest.mark.parametrize("kind,tree,lookup,setting", [
    ("eagle", None, False, "t0.7-k4"), ("medusa", None, False, "t1.4-k6-p0.85"), ("eagle", (8, 2), False, "t1.4-k6-p0.85"),
    ("medusa", (8, 2), False, "t0.7-k4"), ("eagle", (4, 2), True, "t0.7-k4"), ("eagle", (4, 2), "auto", "t1.4-k6-p0.85"),
    ("eagle", (4, 2), "suffix-auto", "t0.7-k4")])
def test_sampling_distribution(spread, kind, tree, lookup, setting, tmp_path):
    """Every position of a sampled continuation (drafts of K tokens, K + 2 new tokens) follows
    the target's own distribution, on a target with spread-out distributions (``spread.py``)."""
    from spread import NEW, PROMPT, SETTINGS, K, check, sample

    params = SamplingParams(**SETTINGS[setting])
    head, _ = _train(spread, kind, tmp_path / "work", seqs=_target_samples(spread, PROMPT, params))
    head.save(tmp_path / "head")
    source = "suffix" if lookup == "suffix-auto" else "ngram"
    lookup = "auto" if lookup == "suffix-auto" else lookup
    eng = Engine(spread.backend, make_drafter(kind, spread, head_path=tmp_path / "head", tree=tree, tree_lookup=lookup,
                                              lookup_from=source), eos_token_ids=())
    accepted = 0

    def run(p):
        nonlocal accepted
        res = eng.generate(PROMPT, max_new_tokens=NEW, params=p, k=K)
        accepted += res.stats.accepted
        return res.token_ids, res.stats.drafted

    counts, joint, drafted = sample(run, setting, seed=1)
    # speculation really happened (auto drafts only where its measured costs say it pays: timing-dependent)
    assert drafted > (0 if lookup == "auto" else 1000) and accepted > 0
    check(spread, setting, counts, joint)


def test_two_stage_prompts_embed_the_targets_own_passages(tmp_path):
    """Stage 1 answers are kept as data; each stage-2 prompt carries the stage-1 answer it builds on."""
    from conftest import tiny_gemma

    from forerun.training.data import two_stage_prompts
    from forerun.training.seeds import passage_writer_prompts, stage_two

    lm = wrap(tiny_gemma(0))
    lm.tokenizer = _LetterTokenizer()
    out = tmp_path / "distill.jsonl"
    prompts = two_stage_prompts(lm, 4, out, seed=0, max_new_tokens=4, log=lambda s: None)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    plan = passage_writer_prompts(4, 0)
    assert {fam for _, fam, _ in plan} == {"translation", "summarization", "rag", "extraction"}
    assert [r["prompt"] for r in recs] == list(dict.fromkeys(p for p, _, _ in plan))
    assert all(len(r["output_ids"]) <= 8 for r in recs)  # stage 1 writes up to twice the answer length
    expected = [p for p, _, _ in plan]
    for first, family, topic in plan:
        answer = next(r for r in recs if r["prompt"] == first)
        text = lm.tokenizer.decode(answer["output_ids"]).strip()
        expected += stage_two(family, text, topic)
    assert prompts == list(dict.fromkeys(expected))


def test_stage_two_prompts_per_family():
    from forerun.training.seeds import stage_two

    german = "Die Stadt ist sehr alt und schön. Viele Menschen kommen jedes Jahr, um die Häuser zu sehen."
    tr = stage_two("translation", german, "x")
    assert tr and all(p.startswith("Translate German to English: ") for p in tr)
    assert any("Häuser" in p for p in tr)
    assert stage_two("summarization", "An article.", "x")[0].endswith("An article.")
    assert stage_two("rag", "A passage about tides.", "ocean tides")[0].startswith("A passage about tides.\n")
    assert "Some reviews." in stage_two("extraction", "Some reviews.", "x")[0]
    assert stage_two("rag", "   ", "x") == []


class _LetterTokenizer:
    """Any text to ids 4..95 (one per character) and back, enough for prompts in plain English."""

    def __call__(self, text):
        class _Enc:
            input_ids = [2] + [4 + ord(c) % 92 for c in text[:40]]
        return _Enc()

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_heads_in_batches_equal_plain(heads, gemma, kind):
    """Batched serving feeds each slot's head its own sequence's features: output stays plain greedy."""
    from forerun.batching import BatchEngine, BatchRequest

    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, max_batch=3,
                      drafter=make_drafter(kind, gemma, head_path=heads[kind][0]))
    eng.policy.margin = -1.0  # always draft
    eng.calibrate(reps=1)
    want = [Engine(gemma.backend, None, gemma.eos_token_ids).generate(p, max_new_tokens=20).token_ids for p in PROMPTS]
    got = {}
    reqs = [BatchRequest(prompt=p, max_new_tokens=20,
                         on_event=(lambda i: lambda t, f: got.setdefault(i, []).extend(t))(i)) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        eng.submit(r)
    while eng.active or eng.waiting:
        eng.step()
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert sum(r.stats.drafted for r in reqs) > 0


def _root_paths(draft):
    """Every root-to-node token path of a tree draft."""
    tok, par = draft.tokens.tolist(), draft.parents.tolist()
    paths = []
    for i in range(len(tok)):
        path, j = [], i
        while j != -1:
            path.append(tok[j])
            j = par[j]
        paths.append(path[::-1])
    return paths


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_tree_lookup_branch(heads, gemma, kind):
    """With --tree-lookup every tree holds the prompt-lookup continuation as a path, on top of the head's nodes."""
    from forerun.drafters.ngram import lookup

    with pytest.raises(ForerunError, match="give tree_nodes too"):
        make_drafter(kind, gemma, head_path=heads[kind][0], tree_lookup=True)
    drafter = make_drafter(kind, gemma, head_path=heads[kind][0], tree=(3, 2), tree_lookup=True)
    seen = []
    propose = drafter.propose

    def spy(tokens, k):
        d = propose(tokens, k)
        seen.append((list(tokens), k, d))
        return d

    drafter.propose = spy
    prompt = [2, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
    want = Engine(gemma.backend, None, gemma.eos_token_ids).generate(prompt, max_new_tokens=16).token_ids
    assert Engine(gemma.backend, drafter, gemma.eos_token_ids).generate(prompt, max_new_tokens=16, k=4).token_ids == want
    grafted = 0
    for tokens, k, d in seen:
        chain = lookup(tokens, k, 4, 1)
        assert not chain or chain in _root_paths(d)
        grafted += len(d) > 3  # more nodes than the head's own tree: the chain added some
    assert seen and grafted > 0


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_tree_lookup_auto_mixes_rounds(heads, gemma, kind):
    """--tree-lookup auto verifies the tree in some steps and the lookup chain alone in others (the
    engine's policy chooses; the head runs only in tree rounds); output stays plain decoding's."""
    drafter = make_drafter(kind, gemma, head_path=heads[kind][0], tree=(3, 2), tree_lookup="auto")
    assert drafter.offers_tree_or_chain
    kinds = []
    propose = drafter.propose

    def spy(tokens, k):
        d = propose(tokens, k)
        kinds.append("chain" if d.parents is None else "tree")
        return d

    drafter.propose = spy
    prompt = [2, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
    want = Engine(gemma.backend, None, gemma.eos_token_ids).generate(prompt, max_new_tokens=24).token_ids
    eng = Engine(gemma.backend, drafter, gemma.eos_token_ids)
    assert eng.generate(prompt, max_new_tokens=24, k=4).token_ids == want
    choices = eng.policy.choices
    assert kinds and set(kinds) == {"tree"} and choices["tree"] == len(kinds)  # the head ran in tree rounds only
    assert choices["chain"] + choices["none"] > 0  # other rounds verified the lookup chain alone (or nothing)
    assert eng.policy.costs["tree"] and eng.policy.costs["chain"]  # both kinds of round were timed by the engine
    assert drafter.lookup.acc.counts  # the chain's acceptance was followed (its offered confidence)
    twin = drafter.fork()
    assert twin.offers_tree_or_chain and twin.lookup.acc.counts == {}


def test_suffix_lookup_branch_learns_across_requests(heads, gemma):
    """--lookup-from suffix: the lookup chain is suffix drafting's, over the request's context and the
    outputs of earlier requests (shared by forks, as a suffix drafter's are), with its learned
    per-token confidences; output stays plain decoding's."""
    from forerun.drafters.lookup import SuffixLookup

    drafter = make_drafter("eagle", gemma, head_path=heads["eagle"][0], tree=(3, 2), tree_lookup="auto",
                           lookup_from="suffix")
    assert isinstance(drafter.lookup, SuffixLookup)
    ref = Engine(gemma.backend, None, gemma.eos_token_ids)
    eng = Engine(gemma.backend, drafter, gemma.eos_token_ids)
    prompt = [2, 30, 31, 32, 33, 34]
    want = ref.generate(prompt, max_new_tokens=20).token_ids
    assert eng.generate(prompt, max_new_tokens=20, k=4).token_ids == want
    # the first output is in the shared history now: a fork drafts its continuation from there
    twin = drafter.fork()
    twin.begin([2, 40, 41], SamplingParams(), None)
    cont = want[len(prompt):]
    chain = twin.lookup_chain([2, 40, 41] + cont[:4], 8)
    assert chain.tokens.tolist() == cont[4:12][: len(chain)] and len(chain) > 0
    assert chain.conf is not None and len(chain.conf) == len(chain)
    assert drafter.lookup.drafter.history.acceptance.counts  # it learned how often its tokens were taken
    drafter.forget_history()
    assert twin.lookup.drafter.history.index.total == 0
    with pytest.raises(ForerunError, match="lookup_from must be one of"):
        make_drafter("eagle", gemma, head_path=heads["eagle"][0], tree=(3, 2), tree_lookup="auto", lookup_from="x")


def test_native_head_step_matches_the_torch_step():
    """The EAGLE head's layer in one native call (``qrows.c``, paired input) computes what the torch
    step computes on the same 8-bit weights: a prompt, chain steps past the cache's first growth,
    and a token tree's masked rows; the keys and values it writes are the same."""
    from forerun.backends.qweights import qrows_lib
    from forerun.drafters.heads import EagleHead, HeadCache, HeadConfig

    if qrows_lib() is None:
        pytest.skip("the integer kernels need a C compiler")
    torch.manual_seed(0)
    cfg = HeadConfig(kind="eagle", hidden_size=64, vocab_size=100, draft_vocab=64, feature_layers=[0, 1, 2],
                     n_heads=2, head_dim=48, intermediate=96)
    head = EagleHead(cfg, torch.arange(64))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 1.0) + (1.0 if p.ndim == 1 else 0.0))
    head.eval().pack_for_inference(int8=True)
    native = head._native
    assert native is not None
    emb, hid = torch.randn(80, 64), torch.randn(80, 64) * 2

    def run(use_native):
        head._native = native if use_native else None
        cache, outs = HeadCache(), []
        with torch.inference_mode():
            outs.append(head.step(emb[:50], hid[:50], 0, cache)[0])
            for t in range(50, 70):  # one row at a time, past a capacity of 64
                outs.append(head.step(emb[t:t + 1], hid[t:t + 1], t, cache)[0])
            mask = torch.zeros(3, 73, dtype=torch.bool)
            mask[:, :70] = True
            mask[0, 70] = mask[1, 71] = mask[2, 70] = mask[2, 72] = True  # two roots; the third a child of the first
            outs.append(head.step(emb[70:73], hid[70:73], 70, cache, positions=torch.tensor([70, 70, 71]), mask=mask)[0])
        return torch.cat(outs), cache

    got, c_native = run(True)
    want, c_torch = run(False)
    # Both quantize each row's activations to 8 bits; a norm summed in another order may round one
    # code the other way (then that row is off by a part in a thousand), otherwise the rows agree.
    rel = (got - want).norm(dim=1) / want.norm(dim=1)
    assert rel.max() < 1e-2 and (rel < 1e-5).float().mean() > 0.9
    assert torch.allclose(c_native.k[:, :, :73], c_torch.k[:, :, :73], atol=1e-4)
    assert torch.allclose(c_native.v[:, :, :73], c_torch.v[:, :, :73], atol=1e-4)


def test_eval_draft_scores_a_trained_head_above_an_untrained_one(gemma, tmp_path):
    """eval-draft: the target answers, the head is scored teacher-forced on those answers."""
    from forerun.training.evaluate import evaluate_head, format_report

    train_prompts = [[2] + [4 + (7 * i + j) % 90 for j in range(5)] for i in range(40)]
    eng = Engine(gemma.backend, None, gemma.eos_token_ids)
    seqs = [Sequence(p + eng.generate(p, max_new_tokens=12).token_ids, len(p)) for p in train_prompts]
    trained, _ = _train(gemma, "eagle", tmp_path / "w", seqs=seqs)
    be = gemma.backend
    fresh = Trainer.of_target(TrainConfig(kind="eagle", draft_vocab=80, n_heads=2, head_dim=16, intermediate=64, steps_ahead=3), be.model)
    untrained = fresh.new_head(trained.draft_to_target.clone())
    untrained.fuse.weight.data.normal_()  # not the "top layer" start: a head that knows nothing
    prompts = [{"text": " ".join(f"w{4 + (11 * i + 3 * j) % 90}" for j in range(4)), "category": "ab"[i % 2]}
               for i in range(6)]
    good = evaluate_head(gemma, trained, prompts, max_new_tokens=10, steps=3, top_k=4, log=lambda s: None)
    bad = evaluate_head(gemma, untrained, prompts, max_new_tokens=10, steps=3, top_k=4, log=lambda s: None)
    rows = good["categories"]
    assert list(rows) == ["a", "b", "all"]
    assert rows["all"]["prompts"] == 6 and rows["all"]["answer_tokens"] == rows["a"]["answer_tokens"] + rows["b"]["answer_tokens"]
    for r in rows.values():
        assert 0 <= r["draft_vocab_coverage"] <= 1 and len(r["top1_per_position"]) == 3
        assert all(a <= b for a, b in zip(r["top1_per_position"], r["top4_per_position"]))
    assert good["categories"]["all"]["top1_per_position"][0] > bad["categories"]["all"]["top1_per_position"][0] + 0.2
    assert "| **all** | 6 |" in format_report(good)


def test_eval_draft_counts_tokens_outside_the_draft_vocabulary_as_misses(gemma, tmp_path):
    from forerun.training.evaluate import evaluate_head

    eng = Engine(gemma.backend, None, gemma.eos_token_ids)
    prompt = [2, 10, 11, 12]
    answer = eng.generate(prompt, max_new_tokens=8).token_ids
    head, _ = _train(gemma, "medusa", tmp_path / "w", epochs=1)
    # The same head with a draft vocabulary that holds none of the answer's tokens.
    outside = [t for t in range(4, 96) if t not in set(answer)][: head.cfg.draft_vocab]
    head.draft_to_target.copy_(torch.tensor(outside))
    rep = evaluate_head(gemma, head, [{"text": "w10 w11 w12", "category": "x"}], max_new_tokens=8, log=lambda s: None)
    row = rep["categories"]["all"]
    assert row["answer_tokens"] == len(answer) and row["draft_vocab_coverage"] == 0.0
    assert max(row["top1_per_position"]) == 0.0 and max(row["top8_per_position"]) == 0.0


@pytest.fixture(scope="module")
def own_heads(gemma, tmp_path_factory):
    """Heads trained on the tiny target's own greedy answers: they get drafts accepted on it."""
    eng = Engine(gemma.backend, None, gemma.eos_token_ids)
    prompts = [[2] + [4 + (7 * i + j) % 90 for j in range(5)] for i in range(40)]
    seqs = [Sequence(p + eng.generate(p, max_new_tokens=12).token_ids, len(p)) for p in prompts]
    out = {}
    for kind in ("eagle", "medusa"):
        head, _ = _train(gemma, kind, tmp_path_factory.mktemp(kind + "-own"), seqs=seqs)
        out[kind] = tmp_path_factory.mktemp(kind + "-own-head")
        head.save(out[kind])
    return out


@pytest.mark.parametrize("kind,k,tree,lookup", [("eagle", 3, None, False), ("eagle", 4, (8, 3), False),
                                                ("eagle", 4, (6, 3), True), ("medusa", 2, None, False),
                                                ("medusa", 2, (6, None), False)])
def test_replay_commits_what_the_engine_commits(own_heads, gemma, kind, k, tree, lookup):
    """eval-draft --replay: proposing on the known greedy answer, with the features of one pass over
    it, gives the engine's own steps (tokens per verify pass) and so its tau."""
    from forerun.training.evaluate import replay_generation, replay_methods

    drafter = make_drafter(kind, gemma, head_path=own_heads[kind], tree=tree, tree_lookup=lookup)
    spec = Engine(gemma.backend, drafter, gemma.eos_token_ids)
    answers, steps = [], 0
    for i, p in enumerate(PROMPTS + [[2] + [4 + (7 * i + j) % 90 for j in range(5)] for i in (41, 43, 47)]):
        stats = GenerationStats()
        out = [s.tokens for s in spec.stream(p, max_new_tokens=20, k=k, stats=stats)]
        seq = p + [t for step in out for t in step]
        gemma.backend.reset()
        feats = gemma.backend.forward(torch.tensor(seq), 0, layers=drafter.feature_layers, logits=False).layers
        commits, depths = replay_generation(drafter, seq, len(p), feats, k)
        assert commits == [len(step) for step in out] and sum(depths) == stats.drafted
        steps += len(commits)
        answers.append(("ab"[i % 2], seq, len(p)))
    rep = replay_methods(gemma, {"m": (drafter, k)}, answers)["m"]
    assert rep["all"]["new_tokens"] == sum(len(s) - n for _, s, n in answers) and rep["all"]["target_passes"] == steps
    assert rep["all"]["new_tokens"] > steps  # drafts were accepted: the comparison above saw real acceptance
    assert rep["a"]["target_passes"] + rep["b"]["target_passes"] == steps


def test_head_commands_refuse_a_backend_without_hidden_states():
    """Every path to a trained head (drafting, train/eval/export-draft) refuses one message's way
    a backend that cannot hand out hidden states, before anything runs."""
    from types import SimpleNamespace

    from forerun.backends.base import Capabilities
    from forerun.drafters import load_head_drafter, require_hidden_states

    blind = SimpleNamespace(backend=SimpleNamespace(capabilities=Capabilities()))
    for what in ("train-draft", "eval-draft", "export-draft"):
        with pytest.raises(ForerunError, match=f"^{what} reads the target's hidden states: it needs the torch backend"):
            require_hidden_states(blind, what)
    with pytest.raises(ForerunError, match="method eagle reads the target's hidden states.*--backend torch"):
        load_head_drafter("eagle", blind)
    require_hidden_states(SimpleNamespace(backend=SimpleNamespace(capabilities=Capabilities(hidden_states=True))),
                          "train-draft")  # has them: no error


def test_int8_head_layers_track_float_and_fall_back():
    """CPU drafting reads 8-bit head weights where every layer's input is whole blocks of 32: each
    layer's output stays within the Q8_0 rounding bound of the float product, and a head with
    another width keeps its float layers."""
    import torch.nn as nn

    from forerun.backends.head_kernels import Q8Linear
    from forerun.backends.qweights import qrows_lib
    from forerun.drafters.heads import HeadConfig, build_head

    if qrows_lib() is None:
        pytest.skip("qrows.c did not build here (no C compiler)")
    torch.manual_seed(0)
    w = torch.randn(48, 96)
    x = torch.randn(3, 96)
    exact = x @ w.T
    got = Q8Linear(w)(x)
    # weights off by at most half a step (max|w|/254 per block), activations likewise
    bound = (w.abs().amax() / 254 * x.abs().sum(-1, keepdim=True) + x.abs().amax() / 254 * w.abs().sum(-1)) * 1.01
    assert ((got - exact).abs() <= bound).all() and not torch.equal(got, exact)

    def head(hidden):
        cfg = HeadConfig(kind="eagle", hidden_size=hidden, vocab_size=100, draft_vocab=50, feature_layers=[0, 1],
                         target={}, n_heads=2, head_dim=16, intermediate=64)
        return build_head(cfg, torch.arange(50)).eval()

    packed = head(64).pack_for_inference()
    assert all(isinstance(k, Q8Linear) for k in packed._packed.values())
    assert len(packed._packed) == sum(isinstance(m, nn.Linear) for m in packed.modules())
    odd = head(48).pack_for_inference()  # 48 is not whole blocks of 32
    assert not any(isinstance(k, Q8Linear) for k in odd._packed.values())
    assert not any(isinstance(k, Q8Linear) for k in head(64).pack_for_inference(int8=False)._packed.values())


@pytest.mark.parametrize("bits", [8, 5, 4])
def test_heads_stored_in_blocks_load_within_half_a_step_and_save_back_identically(heads, tmp_path, bits):
    """``save(dtype="q5")`` etc.: each 32-block of a matrix as codes in [-m, m] and a float16 scale;
    loading gives every weight within half a code step of the original, vectors as float16, and a
    loaded head saves back to the same bytes."""
    from forerun.drafters.heads import load_head

    for kind in ("eagle", "medusa"):
        head = load_head(heads[kind][0])
        head.save(tmp_path / f"{kind}{bits}", dtype=f"q{bits}")
        back = load_head(tmp_path / f"{kind}{bits}")
        m = 2 ** (bits - 1) - 1
        for name, w in head.state_dict().items():
            got = back.state_dict()[name]
            if not w.is_floating_point():
                assert torch.equal(got, w), name
            elif w.ndim == 2 and w.shape[1] % 32 == 0:
                blocks = w.float().reshape(w.shape[0], -1, 32)
                step = (blocks.abs().amax(-1, keepdim=True) / m).half().float()
                err = (got.reshape(blocks.shape) - blocks).abs()
                assert (err <= step * 0.5 + step * 2.0 ** -10 + 1e-30).all(), name  # half a step (scale rounded to float16)
            else:
                assert torch.equal(got, w.half().float()), name
        back.save(tmp_path / f"{kind}{bits}-again", dtype=f"q{bits}")
        assert ((tmp_path / f"{kind}{bits}" / "model.safetensors").read_bytes()
                == (tmp_path / f"{kind}{bits}-again" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError):
        head.save(tmp_path / "bad", dtype="q9")


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_seeded_text_through_heads_equals_plain_decoding(gemma, heads, kind):
    """Seeded sampling through a trained head, as a chain and as a tree, in the engine and through
    the server (three times, then inside 16 concurrent mixed requests): plain decoding's text."""
    from concurrent.futures import ThreadPoolExecutor

    from serving import setup_for
    from test_server import Live

    from forerun.server.run import build_service

    params = SamplingParams(temperature=1.2, top_k=30, seed=5)
    prompt = [2, 7, 8, 9, 7, 8]
    ref = Engine(gemma.backend).generate(prompt, max_new_tokens=16, params=params).token_ids
    for tree in (None, (8, 2)):
        eng = Engine(gemma.backend, make_drafter(kind, gemma, head_path=heads[kind][0], tree=tree))
        res = eng.generate(prompt, max_new_tokens=16, params=params, k=3)
        assert res.token_ids == ref and res.stats.drafted > 0, tree
    srv = Live(build_service(setup_for(gemma, kind, draft=str(heads[kind][0])), name="tiny", max_batch=16,
                             max_tokens=64, calibrate=False))
    try:
        text = " ".join(f"w{t}" for t in prompt)
        want = gemma.tokenizer.decode(Engine(gemma.backend.fork()).generate(
            gemma.tokenizer(text).input_ids, max_new_tokens=16, params=params).token_ids, skip_special_tokens=True)
        body = {"model": "tiny", "prompt": text, "max_tokens": 16, "temperature": 1.2, "top_k": 30, "seed": 5}

        def ask(b):
            status, out = srv.request("POST", "/v1/completions", b)
            assert status == 200, out
            return out["choices"][0]["text"]

        assert [ask(body) for _ in range(3)] == [want] * 3
        mixed = [{"model": "tiny", "prompt": f"w2 w{7 + i % 5} w9", "max_tokens": 6 + i, "temperature": [0.8, 0][i % 2]}
                 for i in range(15)]
        with ThreadPoolExecutor(16) as pool:
            assert list(pool.map(ask, mixed[:7] + [body] + mixed[7:]))[7] == want
    finally:
        srv.close()


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_head_draws_each_drafted_position_with_that_positions_noise(heads, kind, gemma, monkeypatch):
    """Seeded sampling: the head's j-th drafted token is the sequence's token at len(tokens) + j,
    and it is drawn with that position's noise, the one the target draws its token there with (a
    draw with another position's noise keeps the text, for the target decides, but loses the
    coupling that makes a close draft accepted, which no output test can see)."""
    from forerun.sampling import SeededNoise

    calls, seen = [], []
    real = SeededNoise.sample
    monkeypatch.setattr(SeededNoise, "sample", lambda self, q, position: seen.append(position) or real(self, q, position))
    drafter = make_drafter(kind, gemma, head_path=heads[kind][0])
    propose = drafter.propose

    def spy(tokens, k):
        seen.clear()
        d = propose(tokens, k)
        calls.append((len(tokens), list(seen), len(d)))
        return d

    drafter.propose = spy
    params = SamplingParams(temperature=0.8, seed=11)
    plain = Engine(gemma.backend, None, gemma.eos_token_ids).generate(PROMPTS[0], max_new_tokens=20, params=params)
    out = Engine(gemma.backend, drafter, gemma.eos_token_ids).generate(PROMPTS[0], max_new_tokens=20, params=params, k=3)
    assert out.token_ids == plain.token_ids
    drafted = [(n, pos) for n, pos, length in calls if length]
    assert drafted and all(pos == [n + j for j in range(len(pos))] for n, pos in drafted), drafted
