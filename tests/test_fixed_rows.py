"""Fixed-shape passes (``backends/fixed_rows.py``), the GPU's lossless path, run here on the CPU with
the same torch operations: every row of a chain, a token tree or a batched pass is bit for bit the
one-token step at its position, in float32, bfloat16 and float16, across the chunk boundary (16
rows) and the key-span boundary (256 positions); the function itself is the model's."""

import pytest
import torch
from conftest import TEST_DEVICE, run_batch, word_tokenizer
from test_architectures import ARCHS, _build

from forerun.backends.fixed_rows import ROW_BUCKET, key_span
from forerun.backends.greedy_head import ExactFloatArgmax
from forerun.backends.native import NativeBackend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fixed(arch: str, dtype=torch.float32, **cfg):
    model = _build(arch, **cfg).to(TEST_DEVICE, dtype)
    return model, NativeBackend(model, fixed_rows=True, pack_linear=False)


def test_key_spans_are_powers_of_two_of_the_position_alone():
    assert [key_span(p, 8192) for p in (0, 255, 256, 511, 512, 5000)] == [256, 256, 512, 512, 1024, 8192]
    assert key_span(300, 400) == 400


def test_a_row_attends_over_its_own_positions_key_span(monkeypatch):
    """A chain chunk across the 256-position boundary: each row's keys are the first
    ``key_span(position)`` slots, whatever the other rows of its chunk (a row's sums then never
    depend on its neighbours; on some machines' kernels a longer span changes a row's last bits,
    on others not, so the spans are checked themselves: attention over one span is made NaN, and
    the rows that read it turn NaN)."""
    from forerun.backends.fixed_rows import FixedRows

    _, be = fixed("llama", max_position_embeddings=512)
    ids = torch.randint(4, 96, (262,), generator=torch.Generator().manual_seed(4))
    be.forward(ids[:250], 0, logits=False)  # a prompt: the library path
    attend = FixedRows._attend

    def rows_reading(span):  # the last layer's attention over ``span`` keys made NaN: which rows turn NaN
        calls = []

        def poisoned(model, q, kk, vv, hide):
            calls.append(kk.shape[1])
            out = attend(model, q, kk, vv, hide)
            last_layer = len(calls) > (be.num_layers - 1) * per_layer
            return out * float("nan") if last_layer and kk.shape[1] == span else out

        monkeypatch.setattr(FixedRows, "_attend", staticmethod(poisoned))
        be.truncate(250)
        logits = be.forward(ids[250:262], 250).logits  # one chunk: positions 250..261
        return {250 + r for r in range(12) if torch.isnan(logits[r]).any()}, len(calls)

    per_layer = 10**9  # a first pass counts the calls
    _, n = rows_reading(0)
    per_layer = n // be.num_layers

    assert rows_reading(256)[0] == set(range(250, 256)) and rows_reading(512)[0] == set(range(256, 262))


@pytest.mark.parametrize("arch", ARCHS)
def test_fixed_passes_compute_the_model(arch):
    model, be = fixed(arch)
    ids = torch.randint(4, 96, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[None].to(model.device)).logits[0].float()
    be.reset()
    be.forward(ids[:20], 0, logits=False)  # 20 rows: two chunks
    out = torch.cat([be.forward(ids[20:33], 20).logits, be.forward(ids[33:40], 33).logits])
    assert torch.allclose(out, ref[20:], atol=2e-4), (out - ref[20:]).abs().max()


def _steps(be, ids, start, end):
    be.truncate(start)
    return torch.cat([be.forward(ids[i: i + 1], i).logits for i in range(start, end)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3", "qwen2"])
def test_every_row_of_every_pass_is_its_one_token_step(arch, dtype):
    _, be = fixed(arch, dtype, max_position_embeddings=512)
    ids = torch.randint(4, 96, (300,), generator=torch.Generator().manual_seed(1))
    be.reset()
    be.forward(ids[:40], 0, logits=False)
    be.forward(ids[40:240], 40, logits=False)  # a prompt pass (library kernels), shared by every method
    steps = _steps(be, ids, 240, 290)  # crosses 256: rows with key spans of 256 and 512
    for n in (1, 2, 5, ROW_BUCKET, ROW_BUCKET + 1, 33):
        for start in (240, 250):
            be.truncate(240)
            if start > 240:
                be.forward(ids[240:start], 240, logits=False)
            chain = be.forward(ids[start: start + n], start).logits
            assert torch.equal(chain, steps[start - 240: start - 240 + n]), (n, start)
    # a tree: root, two children, a grandchild under each; each row is its path's steps
    root, a, b, c = (int(t) for t in ids[240:244])
    parents = torch.tensor([-1, -1, 0, 1])  # rows 1, 2 under the root; 3 under 1; 4 under 2
    tree = torch.tensor([root, a, 50, b, 60])
    be.truncate(240)
    out = be.forward(tree, 240, tree=parents).logits
    assert torch.equal(out[[0, 1, 3]], steps[:3])
    be.truncate(240)
    other = torch.cat([be.forward(torch.tensor([t]), 240 + i).logits for i, t in enumerate([root, 50, 60])])
    assert torch.equal(out[[0, 2, 4]], other)
    # two sequences in one batched pass: each row as its own sequence's steps give it
    s1, s2 = be.fork(), be.fork()
    s1.forward(ids[:40], 0, logits=False)  # the prompt as ``be`` read it (prompt passes are the library's)
    s1.forward(ids[40:240], 40, logits=False)
    s2.forward(ids[:100], 0, logits=False)
    both = be.forward_batch([s1, s2], [ids[240:245], ids[100:101]], [240, 100])
    assert torch.equal(both[0].logits, steps[:5])
    assert torch.equal(both[1].logits, _steps(s2, ids, 100, 101))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_batched_pass_is_each_sequence_alone_across_shared_chunks(dtype):
    """Three sequences in one batched pass (20 rows: the second's tree spans both chunks, which mix
    sequences): every row bit for bit what that sequence's pass alone gives."""
    _, be = fixed("gemma3", dtype)
    ids = torch.randint(4, 96, (120,), generator=torch.Generator().manual_seed(4))
    parents = torch.tensor([-1, 0, 0, 1])  # root, a chain of two under it, a second child
    feeds = [ids[60:72], ids[30:35], ids[90:93]]
    starts, trees = [60, 30, 90], [None, parents, None]
    alone = []
    for feed, pos, tree in zip(feeds, starts, trees):
        s = be.fork()
        s.forward(ids[:pos], 0, logits=False)
        alone.append(s.forward(feed, pos, **({} if tree is None else {"tree": tree})).logits)
    seqs = []
    for pos in starts:
        s = be.fork()
        s.forward(ids[:pos], 0, logits=False)
        seqs.append(s)
    both = be.forward_batch(seqs, feeds, starts, trees=trees)
    for i, (out, want) in enumerate(zip(both, alone)):
        assert torch.equal(out.logits, want), i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_greedy_speculation_equals_plain_decoding_in_half_precision(dtype):
    from forerun.batching import BatchEngine, BatchRequest
    from forerun.drafters import make_drafter
    from forerun.engine import Engine
    from forerun.models import wrap_model

    model, be = fixed("llama", dtype)
    lm = wrap_model("tiny-fixed", model, word_tokenizer(model.config.vocab_size), backend="native")
    lm.backend = be
    prompts = [[2] + [int(t) for t in torch.randint(4, 96, (12,), generator=torch.Generator().manual_seed(s))] * 2
               for s in range(3)]
    plain = [Engine(be, None, {1}).generate(p, max_new_tokens=24).token_ids for p in prompts]
    twin = wrap_model("tiny-fixed-draft", model, word_tokenizer(model.config.vocab_size), backend="native")
    twin.backend = NativeBackend(model, pack_linear=False)  # the library path: drafts need not be exact
    for method in ("ngram", "suffix", "draft"):  # draft: the target's own weights, so most drafts are taken
        eng = Engine(be, make_drafter(method, lm, draft_model=twin if method == "draft" else None), {1})
        outs = [eng.generate(p, max_new_tokens=24, k=4) for p in prompts]
        assert [o.token_ids for o in outs] == plain, method
        if method == "draft":
            assert sum(o.stats.accepted for o in outs) > 40  # equality earned over multi-row verify passes
    batch = BatchEngine(be, {1}, drafter=make_drafter("ngram", lm), max_batch=3)
    got = run_batch(batch, [BatchRequest(prompt=list(p), max_new_tokens=24) for p in prompts])
    assert got == plain


# -- greedy trees and the batch engine in half precision --------------------------------------
def _near_tie_llama(dtype):
    """A tiny Llama whose LM head holds near twins: row t + 46 is row t with one weight moved by
    about one bfloat16 step, so the two logits round alike in half precision while their exact
    values differ. A greedy row whose best token has a twin then depends on the rule that decides
    it (the exact head picks by the true values, the chunk logits' argmax by the rounded ones)."""
    from conftest import tiny_llama

    m = tiny_llama(0)
    with torch.no_grad():
        w = m.lm_head.weight
        w[50:96] = w[4:50]
        w[50:96, 0] += torch.where(w[4:50, 0] >= 0, 1, -1) * w[4:50, 0].abs().clamp_min(1e-3) * 2 ** -7
    return m.to(TEST_DEVICE, dtype)


@pytest.fixture(scope="module")
def tie_heads(tmp_path_factory):
    """EAGLE and Medusa heads for ``_near_tie_llama`` in a dtype, trained with its float32 copy's
    features (the same weights, so the heads' fingerprints fit the half-precision target) on the
    target's own greedy continuations of the test's prompts: they draft what the target says, so
    the tree passes keep drafts."""
    from conftest import tiny_llama
    from test_heads import _train

    from forerun.engine import Engine
    from forerun.models import wrap_model
    from forerun.training.data import Sequence

    made = {}

    def heads(dtype):
        if dtype not in made:
            m32 = tiny_llama(0)
            m32.load_state_dict({k: v.float() for k, v in _near_tie_llama(dtype).cpu().state_dict().items()})
            lm32 = wrap_model("tie32", m32, word_tokenizer(96), backend="native")
            eng = Engine(NativeBackend(_near_tie_llama(dtype), fixed_rows=True, pack_linear=False), None, {1})
            seqs = [Sequence(p + eng.generate(p, max_new_tokens=24).token_ids, len(p)) for p in TIE_PROMPTS]
            made[dtype] = {}
            for kind in ("eagle", "medusa"):
                head, _ = _train(lm32, kind, tmp_path_factory.mktemp(kind), seqs=seqs * 3, epochs=60)
                made[dtype][kind] = tmp_path_factory.mktemp(kind + "-head")
                head.save(made[dtype][kind])
        return made[dtype]

    return heads


TIE_PROMPTS = [[2] + [int(t) for t in torch.randint(4, 96, (10,), generator=torch.Generator().manual_seed(s))] * 2
               for s in range(4)]
TREE_DRAFTERS = [("suffix", dict(tree=(8, None))), ("eagle", dict(tree=(8, 3))), ("medusa", dict(tree=(8, 2))),
                 ("eagle", dict(tree=(6, 3), tree_lookup=True)),
                 ("medusa", dict(tree=(6, 2), tree_lookup="auto", lookup_from="suffix"))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_greedy_trees_and_the_batch_engine_equal_plain_decoding_in_half_precision(dtype, tie_heads):
    """Greedy token trees (suffix, EAGLE, Medusa, with the lookup branch) on the fixed-shape path,
    one sequence and in the batch engine at 1 and 16 requests, give plain decoding's tokens on a
    target full of near ties: a tree row's token comes from its chunk's logits by the one-token
    step's rule, never from the exact head (which the backend would otherwise use here)."""
    from forerun.batching import BatchEngine, BatchRequest
    from forerun.drafters import make_drafter
    from forerun.engine import Engine
    from forerun.models import wrap_model

    model = _near_tie_llama(dtype)
    be = NativeBackend(model, fixed_rows=True, pack_linear=False, exact_greedy=True)
    assert not be.capabilities.lazy_tree_head
    lm = wrap_model("tie", model, word_tokenizer(96), backend="native")
    lm.backend = be
    prompts = TIE_PROMPTS
    plain = [Engine(be, None, {1}).generate(p, max_new_tokens=24).token_ids for p in prompts]
    exact = ExactFloatArgmax(be.model.lm_head.weight.cpu(), threads=1)
    s = be.fork()
    rows = s.forward(torch.tensor(prompts[0] + plain[0]), 0, return_hidden=True)
    assert (exact.argmax(rows.hidden.float().cpu()) != rows.logits.argmax(-1).cpu()).sum() > 5, \
        "the exact head would decide some of these rows otherwise"
    heads = tie_heads(dtype)
    accepted = 0
    for method, kw in TREE_DRAFTERS:
        head = {"head_path": heads[method]} if method in heads else {}
        outs = [Engine(be, make_drafter(method, lm, **kw, **head), {1}).generate(p, max_new_tokens=24, k=4)
                for p in prompts]
        assert [o.token_ids for o in outs] == plain, (method, kw)
        accepted += sum(o.stats.accepted for o in outs)
        for n in (1, 16):
            eng = BatchEngine(be, {1}, drafter=make_drafter(method, lm, **kw, **head), max_batch=n)
            reqs = [BatchRequest(prompt=list(prompts[i % len(prompts)]), max_new_tokens=24) for i in range(n)]
            assert run_batch(eng, reqs) == [plain[i % len(prompts)] for i in range(n)], (method, kw, n)
    assert accepted > 100  # equality earned over tree passes that kept drafts


# -- passes over 64 rows ------------------------------------------------------------------------
def test_trees_over_64_rows_and_prompt_sized_feeds_keep_each_row_its_own(dtype=torch.bfloat16):
    """A token tree of 80 rows (a head's 64 nodes, the root and a lookup chain) stays in fixed
    chunks: each row is the one-token step on its path. In a batched pass, a sequence fed a
    prompt-sized chain runs alone (as ``forward`` runs it alone), and the other sequences' rows
    stay their steps."""
    _, be = fixed("llama", dtype, max_position_embeddings=512)
    ids = torch.randint(4, 96, (300,), generator=torch.Generator().manual_seed(7))
    be.reset()
    be.forward(ids[:100], 0, logits=False)
    steps = _steps(be, ids, 100, 180)
    parents = torch.tensor([-1] + list(range(78)))  # a chain-shaped tree of 80 rows (rows at depth r)
    be.truncate(100)
    assert torch.equal(be.forward(ids[100:180], 100, tree=parents).logits, steps)
    # a bushy one: the root, 40 children, and a chain of 39 under the first child
    parents = torch.tensor([-1] * 40 + [0] + list(range(40, 78)))
    feed = torch.cat([ids[100:101], ids[101:141], ids[141:180]])
    feed[2:41] = (ids[101:140] - 3) % 92 + 4  # the other children: other tokens
    be.truncate(100)
    out = be.forward(feed, 100, tree=parents).logits
    be.truncate(100)
    path = torch.cat([ids[100:102], ids[141:180]])  # root, first child, its chain
    want = torch.cat([be.forward(path[i: i + 1], 100 + i).logits for i in range(len(path))])
    assert torch.equal(out[[0, 1] + list(range(41, 80))], want)
    # a batched pass: one sequence's 70-row tree, one prompt-sized feed, one one-token step
    a, b, c = be.fork(), be.fork(), be.fork()
    for s in (a, b, c):
        s.forward(ids[:100], 0, logits=False)
    alone_b = be.fork()
    alone_b.forward(ids[:100], 0, logits=False)
    want_b = alone_b.forward(ids[100:200], 100).logits  # a prompt pass: the library's kernels, alone
    tree70 = torch.tensor([-1] + list(range(68)))
    got = be.forward_batch([a, b, c], [ids[100:170], ids[100:200], ids[100:101]], [100, 100, 100],
                           trees=[tree70, None, None])
    assert torch.equal(got[0].logits, steps[:70])
    assert torch.equal(got[1].logits, want_b)
    assert torch.equal(got[2].logits, steps[:1])


def test_tree_sizes_are_bounded_with_a_clear_error():
    from forerun.drafters import MAX_TREE_NODES, make_drafter
    from forerun.errors import ForerunError
    from forerun.models import wrap_model

    model, be = fixed("llama", torch.bfloat16)
    lm = wrap_model("t", model, word_tokenizer(model.config.vocab_size), backend="native")
    lm.backend = be
    assert make_drafter("suffix", lm, tree=(MAX_TREE_NODES, None)).tree_nodes == MAX_TREE_NODES
    with pytest.raises(ForerunError, match="tree_nodes must be in 0..64"):
        make_drafter("suffix", lm, tree=(MAX_TREE_NODES + 1, None))


# -- float16 masked slots ------------------------------------------------------------------------
def test_a_float16_overflow_in_a_masked_value_slot_cannot_turn_a_row_into_nan():
    """A rejected draft whose value vector overflows float16 stays in the cache past the committed
    length; rows that must not see it (their weight on it is exactly 0) still give exactly what a
    cache without it gives, not 0 x Inf = NaN."""
    model = _build("llama").to(TEST_DEVICE, torch.float16)
    X = 90
    with torch.no_grad():  # token X's embedding lies along dim 0 alone, and layer 0's values blow up along it
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 0
        emb[X] = 0
        emb[X, 0] = 1.0
        model.model.layers[0].self_attn.v_proj.weight[:, 0] = 1e4
    be = NativeBackend(model, fixed_rows=True, pack_linear=False)
    ids = torch.randint(4, 80, (40,), generator=torch.Generator().manual_seed(3))
    clean = be.fork()
    clean.forward(ids[:30], 0, logits=False)
    want = clean.forward(ids[30:32], 30).logits
    assert torch.isfinite(want).all()
    s = be.fork()
    s.forward(ids[:30], 0, logits=False)
    s.forward(torch.tensor([int(ids[30]), 50, X, 60]), 30)  # drafts 50, X, 60; X's value overflows
    s.truncate(31)  # the first draft rejected: slots 31.. are stale, X's among them
    got = torch.cat([s.forward(ids[30:31], 30).logits, s.forward(ids[31:32], 31).logits])
    assert torch.equal(got, want)


# -- CUDA graphs' bookkeeping, on the CPU -----------------------------------------------------------
class _Replayer:
    """Stands in for a CUDA graph: replay recomputes the captured chunk into its static outputs, on
    the cache it was captured for (which is what a real graph reads)."""

    def __init__(self, fixed, model, cache, static_in, span, layers, want_logits, outs):
        self.cache, self.run = cache, lambda: fixed.core(model, static_in, span, layers, want_logits, cache)
        self.outs = outs

    def replay(self):
        for o, new in zip(self.outs, self.run()):
            if o is not None:
                o.copy_(new)


def test_each_sequence_replays_only_graphs_captured_on_its_own_cache(monkeypatch):
    """Graphs live with the cache they read: a fork captures its own, a dead fork's
    graphs go with it, and every replay is of a graph captured for the sequence replaying it; the
    text equals eager decoding's, and captures and replays are counted."""
    from forerun.backends.fixed_rows import FixedRows
    from forerun.engine import Engine

    model, be = fixed("llama", torch.bfloat16)
    prompts = [[2] + [int(t) for t in torch.randint(4, 96, (9,), generator=torch.Generator().manual_seed(s))] * 2
               for s in range(4)]
    eager = [Engine(be.fork(), None, {1}).generate(p, max_new_tokens=12).token_ids for p in prompts]
    seen = []

    def capture(self, model, cache, ins, span, layers, want_logits):
        static_in = ins.to(model.device)
        outs = tuple(None if o is None else o.clone()
                     for o in self.core(model, static_in, span, layers, want_logits, cache))
        self.captures += 1
        return _Replayer(self, model, cache, static_in, span, layers, want_logits, outs), static_in, outs

    real_replay = FixedRows._replay

    def replay(self, model, cache, ins, span, layers, want_logits, n):
        out = real_replay(self, model, cache, ins, span, layers, want_logits, n)
        seen.append(cache.graphs[(span, layers, want_logits)][0].cache is cache)
        return out

    monkeypatch.setattr(FixedRows, "_capture", capture)
    monkeypatch.setattr(FixedRows, "_replay", replay)
    be.model.fixed.graphs_off = False
    for p, want in zip(prompts, eager):
        fork = be.fork()
        assert fork.cache.graphs == {}
        assert Engine(fork, None, {1}).generate(p, max_new_tokens=12).token_ids == want
        del fork  # its graphs go with it
    assert seen and all(seen)
    st = be.model.fixed.stats()
    assert st["captured"] >= len(prompts) and st["replayed"] == len(seen) and not st["failed"]


def test_a_failed_capture_is_recorded_as_an_error_and_the_pass_still_runs(monkeypatch):
    """Where a capture fails (here: the capture stream refused), the pass runs eagerly with the
    same result, and the failure is counted for the check's table (``stats()['failed']``)."""
    def refused(*a, **k):
        raise RuntimeError("no capture stream")

    monkeypatch.setattr(torch.cuda, "Stream", refused)
    _, be = fixed("llama", torch.bfloat16)
    ids = torch.randint(4, 96, (20,), generator=torch.Generator().manual_seed(2))
    s = be.fork()
    s.forward(ids[:10], 0, logits=False)
    want = s.forward(ids[10:11], 10).logits
    be.model.fixed.graphs_off = False
    s.truncate(10)
    assert torch.equal(s.forward(ids[10:11], 10).logits, want)
    assert be.model.fixed.stats()["failed"] and be.model.fixed.stats()["captured"] == 0
